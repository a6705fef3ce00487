"""`expert-stream bench MODEL_DIR --budget-gib B --ranks N`: the same decode in mlx-lm's pipeline
mode, N ranks on 127.0.0.1 over the ring backend (started through mlx.launch, as on several
machines), beside one process with the same budget. The budget is per rank, as in the server.
On one machine the ranks share its cores and disk: the figures show what each rank reads, not
what N machines would gain."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

from expert_stream.streaming.errors import ExpertStreamError

WORKER = "expert_stream.plugin.cli.lab.bench_rank_worker"


def mlx_launch() -> list[str]:
    """MLX's own launcher (the `mlx.launch` console script), run by this interpreter."""
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="console_scripts") if e.name == "mlx.launch"]
    if not found:
        raise ExpertStreamError("mlx.launch is not installed (it comes with mlx); --ranks needs it")
    return [sys.executable, "-c",
            f"import sys; from {found[0].module} import {found[0].attr} as m; sys.exit(m())"]


def free_ports(count: int) -> int:
    """A first port with `count` free ports after it (the ring backend takes one per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            start = s.getsockname()[1]
        if start + count < 65536 and all(_free(start + i) for i in range(count)):
            return start
    raise ExpertStreamError(f"no {count} consecutive free ports on 127.0.0.1 for the ring backend")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _reports(done: subprocess.CompletedProcess, what: str) -> list[dict]:
    found = [json.loads(line.split("BENCH ", 1)[1]) for line in done.stdout.splitlines() if "BENCH {" in line]
    if done.returncode != 0 or not found:
        raise ExpertStreamError(f"bench {what} failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return found


def run_ranks(model_dir: str, budget_gib: float, ranks: int, prompt_tokens: int, gen_tokens: int,
              settings: dict, timeout: float = 3600) -> dict:
    args = {"model_dir": model_dir, "budget_gib": budget_gib, "prompt_tokens": prompt_tokens,
            "gen_tokens": gen_tokens, "settings": settings}
    alone = subprocess.run([sys.executable, "-m", WORKER, json.dumps({**args, "ranks": 1})],
                           capture_output=True, text=True, timeout=timeout)
    cmd = [*mlx_launch(), "--hosts", "127.0.0.1", "-n", str(ranks), "--backend", "ring",
           "--starting-port", str(free_ports(ranks)), "--python", sys.executable, "-m", WORKER,
           json.dumps({**args, "ranks": ranks})]
    pipelined = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    per_rank = sorted(_reports(pipelined, f"with {ranks} ranks"), key=lambda r: r["rank"])
    return {"model_dir": model_dir, "budget_gib_per_rank": budget_gib, "ranks": ranks,
            "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
            "one_process": _reports(alone, "in one process")[0], "per_rank": per_rank}


def print_ranks(r: dict) -> None:
    one = r["one_process"]
    print(f"bench: {r['model_dir']}, {r['budget_gib_per_rank']} GiB per process, {r['prompt_tokens']}-token "
          f"prompt, {r['gen_tokens']} decode tokens; {r['ranks']} ranks on 127.0.0.1 (ring backend)")
    print(f"  {'run':<14} {'layers':>8} {'slots GB':>9} {'decode tok/s':>13} {'prefill tok/s':>14} "
          f"{'MB/token':>9} {'misses/token':>13} {'read wait ms/token':>19}")
    rows = [("one process", one)] + [(f"rank {x['rank']}", x) for x in r["per_rank"]]
    for name, x in rows:
        layers = f"{x['layers'][0]}-{x['layers'][1] - 1}"
        print(f"  {name:<14} {layers:>8} {x['slot_bytes'] / 1e9:>9.4f} {x['decode_tok_s']:>13.2f} "
              f"{x['prefill_tok_s']:>14.1f} {x['bytes_per_token'] / 1e6:>9.3f} {x['misses_per_token']:>13.2f} "
              f"{x['read_wait_ms_per_token']:>19.2f}")
