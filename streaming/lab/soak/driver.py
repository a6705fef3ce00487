"""The soak's run: checkpoints and stock answers up front, the host started, clients sending a
seeded mix of requests while the faults land, then the counts. The seed is printed first, so a
failure replays (the same choices; thread timing is the machine's)."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .client import SERVER_DOWN, UNCLEAR, request
from .faults import Chaos, call, run_faults
from .host_process import HostUnderSoak
from .models import PROMPTS, prepare
from .tally import Tally, lines, sample_tree

# Which model a client asks for: the two streamed ones most, the dense one, the one the faults
# add and remove, and one that is never served.
MODEL_MIX = {"moe-a": 4, "moe-b": 3, "dense": 2, "moe-c": 1, "nobody": 0.3}
PROMPT_MIX = {"short": 4, "tiny": 2, "code": 2, "long": 2}


@dataclass
class SoakPlan:
    host: str  # "openai" (mlx-openai-server) or "mlx_lm" (mlx_lm.server)
    seconds: float
    seed: int
    work: Path
    clients: int = 3
    deadline_s: float = 600.0  # a request with no answer by then is a hang
    fault_gap_s: tuple = (1.0, 6.0)  # seconds between faults
    settings: dict = field(default_factory=dict)  # streaming settings of every streamed model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_loop(host, models, tally: Tally, rng: random.Random, stop: threading.Event, deadline_s: float) -> None:
    names, weights = list(MODEL_MIX), list(MODEL_MIX.values())
    while not stop.is_set():
        if host.down.is_set():  # the soak killed the server: wait for it, as a client would retry
            time.sleep(0.2)
            continue
        model = rng.choices(names, weights)[0]
        prompt_name = rng.choices(list(PROMPT_MIX), list(PROMPT_MIX.values()))[0]
        prompt, max_tokens = PROMPTS[prompt_name]
        expected = models.expected.get((model, prompt_name))
        starts = host.starts
        verdict = request(host.port, model, prompt, max_tokens, rng.random() < 0.5, expected, deadline_s)
        if verdict.kind == UNCLEAR and (host.down.is_set() or host.starts != starts):
            verdict.kind = SERVER_DOWN  # the soak killed the server (mlx_lm.server) meanwhile
        tally.verdict(model, verdict)


def sample_loop(host, tally: Tally, stop: threading.Event) -> None:
    while not stop.wait(2.0):
        if host.alive():
            tally.sample(*sample_tree(host.pid))
            try:
                tally.saw_paths(status_of(host, timeout=30).get("models", {}))
            except (OSError, ValueError):
                pass  # not answering now: the next sample asks again


def status_of(host, timeout: float = 120) -> dict:
    """GET /expert-stream/status ({} on another status code)."""
    code, body = call(host.port, "GET", "/expert-stream/status", timeout=timeout)
    return json.loads(body) if code == 200 else {}


def run_soak(plan: SoakPlan, say=print) -> dict:
    """Run one soak; return the summary (also printed through `say`)."""
    say(f"soak: host {plan.host}, seed {plan.seed}, {plan.seconds:.0f} s, {plan.clients} clients, work {plan.work}"
        + (f", streamed models with {plan.settings}" if plan.settings else ""))
    work = Path(plan.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    models = prepare(work / "models")
    say(f"soak: checkpoints and {len(models.expected)} stock answers in {time.perf_counter() - t0:.0f} s")
    host = HostUnderSoak(plan.host, models.folders, work, free_port(), plan.settings)
    say(f"soak: the host answered after {host.start():.0f} s on {host.base}")
    tally, stop = Tally(), threading.Event()
    master = random.Random(plan.seed)
    chaos = Chaos(host, models, tally, random.Random(master.random()), plan.deadline_s)
    threads = [threading.Thread(target=client_loop, name=f"soak-client-{i}", daemon=True,
                                args=(host, models, tally, random.Random(master.random()), stop, plan.deadline_s))
               for i in range(plan.clients)]
    threads += [threading.Thread(target=run_faults, args=(chaos, stop, plan.fault_gap_s), name="soak-faults",
                                 daemon=True),
                threading.Thread(target=sample_loop, args=(host, tally, stop), name="soak-sample", daemon=True)]
    tally.sample(*sample_tree(host.pid))
    started = time.perf_counter()
    try:
        for t in threads:
            t.start()
        next_note = 60.0
        while time.perf_counter() - started < plan.seconds and (host.alive() or host.down.is_set()):
            time.sleep(1.0)
            if time.perf_counter() - started >= next_note:
                next_note += 60.0
                say(f"soak: {time.perf_counter() - started:.0f} s, {tally.progress()}")
        stop.set()
        for t in threads:
            t.join(plan.deadline_s + 30)
            if t.is_alive():
                tally.failure(f"{t.name} did not end within the deadline after the run")
        if not host.alive():
            tally.failure(f"the host exited with {host.process.returncode} during the run")
        server = server_view(host, chaos, tally)
    finally:
        stop.set()
        host.stop()
    header = {"host": plan.host, "seed": plan.seed, "settings": plan.settings,
              "seconds": round(time.perf_counter() - started), "clients": plan.clients}
    summary = tally.summary(header, server)
    for line in lines(summary):
        say(line)
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def server_view(host, chaos, tally) -> dict:
    """The server's own figures at the end: reloads and refusals, restarts, final resources."""
    if not host.alive():
        return {}
    tally.sample(*sample_tree(host.pid))
    status = status_of(host)
    models = status.get("models", {})
    tally.saw_paths(models)
    restarts = {m: s.get("restarts", 0) for m, s in models.items() if s.get("restarts")}
    return {"server reloads": status.get("reloads"), "server reloads refused": status.get("reloads_refused"),
            "restarts": restarts, "host starts": host.starts}
