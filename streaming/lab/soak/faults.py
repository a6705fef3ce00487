"""What the soak injects, one fault at a time, each checked as it lands: config edits (valid
and every kind of invalid), SIGHUP storms, reload requests (loopback, and refused ones from a
foreign Host, a proxy or a web page), kill -9 of a model process, a shard truncated or
rewritten in place and restored, a model added and removed beside the running ones, malformed
HTTP bodies, and a client that disconnects mid-stream."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path

from .client import ABSOLUTE_PATH, HANG, UNCLEAR, request
from .config_edits import invalid_edits
from .host_process import BUDGETS
from .models import PROMPTS

APPLY_TIMEOUT_S = 600  # a changed entry of mlx-openai-server starts a model process (15-120 s)
KILLS_PER_10_MIN = 2  # the host restarts a model 3 times in 10 minutes, then leaves it in error


def call(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 120) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Chaos:
    """Runs faults against one host and tells the tally what each one found."""

    def __init__(self, host, models, tally, rng, deadline_s: float):
        self.host, self.models, self.tally, self.rng = host, models, tally, rng
        self.deadline_s = deadline_s
        self.kills: list[float] = []
        self.faults = [(self.valid_edit, 3), (self.invalid_edit, 4), (self.sighup_storm, 2),
                       (self.reload_requests, 3), (self.kill_model_process, 1), (self.shard_change, 2),
                       (self.add_and_remove_model, 2), (self.malformed_bodies, 2), (self.disconnect, 2)]

    def one(self) -> None:
        fault = self.rng.choices([f for f, _ in self.faults], [w for _, w in self.faults])[0]
        self.tally.fault(fault.__name__)
        fault()

    # -- helpers ------------------------------------------------------------------------------
    def status(self) -> dict:
        code, body = call(self.host.port, "GET", "/expert-stream/status")
        if code != 200:
            raise RuntimeError(f"status answered {code}: {body[:300]!r}")
        return json.loads(body)

    def post_reload(self, headers: dict | None = None) -> tuple[int, dict]:
        code, body = call(self.host.port, "POST", "/expert-stream/reload", b"", headers, timeout=APPLY_TIMEOUT_S)
        try:
            return code, json.loads(body)
        except ValueError:
            return code, {"raw": body.decode(errors="replace")}

    def apply(self, text: str, what: str) -> None:
        """Write a valid file and make it applied: by the reload endpoint, SIGHUP or the watcher."""
        self.host.write_config(text)
        way = self.rng.choice(("endpoint", "SIGHUP", "watcher"))
        if way == "endpoint":
            code, body = self.post_reload()
            if code != 200:
                self.tally.failure(f"{what}: a valid edit was refused by the endpoint ({code}): {body}")
                return
        elif way == "SIGHUP":
            os.kill(self.host.pid, signal.SIGHUP)
        wanted = hashlib.sha256(text.encode()).hexdigest()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < APPLY_TIMEOUT_S:
            status = self.status()
            if status.get("applied_hash") == wanted and not status.get("reloading"):
                self.tally.reload_applied(way)
                return
            if status.get("failed_hash") == wanted:
                self.tally.failure(f"{what}: a valid edit was refused ({way}): {status.get('last_error')}")
                return
            time.sleep(0.3)
        self.tally.failure(f"{what}: a valid edit was not applied within {APPLY_TIMEOUT_S} s ({way})")

    # -- the faults ---------------------------------------------------------------------------
    def valid_edit(self) -> None:
        knobs = self.host.knobs
        knobs.budget_gib = self.rng.choice([b for b in BUDGETS if b != knobs.budget_gib])
        self.apply(self.host.valid_text(), f"moe-a's budget to {knobs.budget_gib} GiB")

    def invalid_edit(self) -> None:
        edits = invalid_edits(self.host.host)
        name = self.rng.choice(sorted(edits))
        doc = self.host.knobs.document(self.host.host, self.host.folders, self.host.port)
        self.host.write_config(edits[name](doc, self.host.host, self.host.work))
        code, body = self.post_reload()
        message = json.dumps(body)
        if code != 422:
            self.tally.failure(f"invalid edit {name!r} was not refused: {code} {message[:500]}")
        elif ABSOLUTE_PATH.search(message):
            self.tally.failure(f"invalid edit {name!r}: the refusal shows an absolute path: {message[:500]}")
        else:
            self.tally.reload_refused(name)
        self.apply(self.host.valid_text(), f"the file back after {name!r}")

    def sighup_storm(self) -> None:
        for _ in range(self.rng.randint(3, 15)):
            os.kill(self.host.pid, signal.SIGHUP)
            time.sleep(self.rng.uniform(0, 0.05))
        time.sleep(1.0)
        if not self.host.alive():
            self.tally.failure("the host died in a SIGHUP storm")
        else:
            self.status()

    def reload_requests(self) -> None:
        code, body = self.post_reload()
        if code == 200:
            self.tally.reload_applied("endpoint")
        else:
            self.tally.failure(f"a loopback reload of the valid file answered {code}: {body}")
        for headers in ({"Host": f"evil.example:{self.host.port}"}, {"Origin": "http://evil.example"},
                        {"X-Forwarded-For": "203.0.113.9"}):
            code, _ = self.post_reload(headers)
            if code == 403:
                self.tally.count("reloads refused (foreign Host, Origin, proxy)")
            else:
                self.tally.failure(f"a reload with {headers} answered {code}, not 403")

    def kill_model_process(self) -> None:
        """kill -9 of a model process: one of mlx-openai-server's, which the host restarts; under
        mlx_lm.server the server itself, which the soak starts again (requests meanwhile find
        no server, and count apart)."""
        import psutil

        now = time.time()
        self.kills = [t for t in self.kills if now - t < 600]
        if len(self.kills) >= KILLS_PER_10_MIN:
            return
        if self.host.host == "mlx_lm":
            self.kills.append(now)
            self.tally.count("servers killed (kill -9) and started again")
            self.host.restart_after_kill()
            return
        children = [p for p in psutil.Process(self.host.pid).children(recursive=True)
                    if "spawn_main" in " ".join(_cmdline(p)) and "resource_tracker" not in " ".join(_cmdline(p))]
        if children:
            self.rng.choice(sorted(children, key=lambda p: p.pid)).send_signal(signal.SIGKILL)
            self.kills.append(now)
            self.tally.count("model processes killed (kill -9)")

    def shard_change(self) -> None:
        served = self.rng.choice(("moe-a", "moe-b"))
        shard = sorted(Path(self.models.folders[served]).glob("*.safetensors"))[0]
        original, stat = shard.read_bytes(), shard.stat()
        how = self.rng.choice(("truncated", "rewritten"))
        with open(shard, "r+b") as f:
            if how == "truncated":
                f.truncate(len(original) // 2)
            else:
                # The header, same length: a load in the window must fail, as must a loaded model's
                # next read. (Tensor bytes rewritten before a load make another model, which no
                # check can tell from the real one; test_shard_changes covers them under a loaded model.)
                f.seek(8)
                f.write(b"#" * int.from_bytes(original[:8], "little"))
        self.tally.count(f"shards {how} in place")
        time.sleep(self.rng.uniform(2, 8))
        with open(shard, "r+b") as f:
            f.write(original)
            f.truncate(len(original))
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    def add_and_remove_model(self) -> None:
        """moe-c (budget auto) loads beside the running models, answers, then goes."""
        knobs = self.host.knobs
        knobs.with_c = True
        self.apply(self.host.valid_text(), "moe-c added")
        prompt, max_tokens = PROMPTS["short"]
        verdict = request(self.host.port, "moe-c", prompt, max_tokens, False,
                          self.models.expected[("moe-c", "short")], self.deadline_s)
        self.tally.verdict("moe-c", verdict)
        knobs.with_c = False
        self.apply(self.host.valid_text(), "moe-c removed")

    def malformed_bodies(self) -> None:
        bodies = [b"{not json", b"[]", b"", json.dumps({"model": "moe-a"}).encode(),
                  json.dumps({"model": "moe-a", "messages": "hello"}).encode(),
                  json.dumps({"model": "moe-a", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": "many"}).encode(),
                  json.dumps({"model": 5, "messages": [{"role": "user", "content": "hi"}]}).encode(),
                  b"\xff\xfe\x00garbage"]
        body = self.rng.choice(bodies)
        code, answer = call(self.host.port, "POST", "/v1/chat/completions", body,
                            {"Content-Type": "application/json"}, timeout=self.deadline_s)
        if 400 <= code < 500 and not ABSOLUTE_PATH.search(answer.decode(errors="replace")):
            self.tally.count("malformed bodies refused (4xx)")
        else:
            self.tally.failure(f"malformed body {body[:60]!r} answered {code}: {answer[:300]!r}")

    def disconnect(self) -> None:
        """A streaming client that goes away after its first piece; the host must carry on."""
        served = self.rng.choice(("moe-a", "moe-b"))
        prompt, _ = PROMPTS["short"]
        verdict = request(self.host.port, served, prompt, 200, True, None, self.deadline_s,
                          disconnect_after_first=True)
        if verdict.kind in (HANG, UNCLEAR):  # no stock answer of 200 tokens: the text is not judged
            self.tally.failure(f"a disconnecting client's request: {verdict.kind} {verdict.detail}")
        self.tally.count("clients disconnected mid-stream")


def _cmdline(process) -> list:
    try:
        return process.cmdline()
    except Exception:  # the process went away meanwhile
        return []


def run_faults(chaos: Chaos, stop: threading.Event, gap_s: tuple) -> None:
    while not stop.wait(chaos.rng.uniform(*gap_s)):
        try:
            chaos.one()
        except Exception as exc:  # a fault that could not even run is a finding
            chaos.tally.failure(f"fault failed: {type(exc).__name__}: {exc}")
