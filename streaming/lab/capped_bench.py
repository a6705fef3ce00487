"""The benchmark's streamed side in a child process under a memory cap (benchmark lab code).

The child (this module run as `python -m`) runs `bench.run_streamed` inside a cgroup v2 group
whose `memory.max` is the cap (streaming/lab/memory_cap.py) and prints its report as JSON; a child
OOM-killed under the cap becomes a report saying so. Stock mlx-lm, when it runs, runs in the
calling process, outside the cap: it is the everything-resident reference, not a contestant.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from .bench import BenchConfig, apply_stock, finish, stock_reference, stock_wanted, without_stock
from ..errors import ExpertStreamError
from .memory_cap import run_capped
from ..settings import GIB


class BenchChildError(ExpertStreamError):
    """The capped benchmark process failed for another reason than the cap."""


_PATHS = ("model_dir", "routing", "corpus")


def _config_json(cfg: BenchConfig) -> str:
    d = asdict(cfg)
    for key in _PATHS:
        d[key] = str(d[key]) if d[key] is not None else None
    return json.dumps(d)


def _config_from_json(text: str) -> BenchConfig:
    d = json.loads(text)
    for key in _PATHS:
        d[key] = Path(d[key]) if d[key] is not None else None
    if d["known_t_compute"] is not None:
        d["known_t_compute"] = tuple(d["known_t_compute"])
    return BenchConfig(**d)


def run_bench_capped(cfg: BenchConfig, cap_gib: float,
                     log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict:
    from ..footprint import checkpoint_footprint

    want_stock = stock_wanted(cfg, checkpoint_footprint(cfg.model_dir))
    report = run_streamed_capped(replace(cfg, stock="yes" if want_stock else "no"), cap_gib, log)
    if report.get("result") == "killed":
        return report
    if want_stock:
        apply_stock(report, stock_reference(cfg, log))
    else:
        without_stock(report, cfg)
    return finish(report)


def run_streamed_capped(cfg: BenchConfig, cap_gib: float,
                        log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> dict:
    """The streamed side (bench.run_streamed) in a child process under the cap; its report, or
    one saying it was killed. cfg.stock "yes" says stock runs later and out here: the child
    then does not time compute with forced hits."""
    log(f"memory cap: streamed side in a cgroup v2 group with memory.max = {cap_gib} GiB")
    argv = [sys.executable, "-m", "expert_stream.streaming.lab.capped_bench", _config_json(cfg)]
    run = run_capped(argv, int(cap_gib * GIB))
    cap = {"gib": cap_gib, "mechanism": "cgroup v2 memory.max", "oom_kills": run.oom_kills,
           "peak_gb": run.peak_bytes / 1e9 if run.peak_bytes is not None else None,
           "stock_under_cap": False}
    if run.killed:
        log(f"killed under the {cap_gib} GiB cap (rc {run.returncode}, oom_kill {run.oom_kills})")
        return {"model_dir": str(cfg.model_dir), "budget_gib": cfg.budget_gib, "result": "killed",
                "killed_under_cap": f"killed under the {cap_gib} GiB cap", "returncode": run.returncode,
                "memory_cap": cap}
    if run.returncode != 0:
        raise BenchChildError(f"the capped benchmark process exited with {run.returncode} (its log is above)")
    report = json.loads(run.stdout)
    report["memory_cap"] = cap
    return report


def main(argv: list[str]) -> int:
    from .bench import run_streamed

    cfg = _config_from_json(argv[0])
    try:
        report, _ = run_streamed(cfg)
    except ExpertStreamError as exc:
        print(f"expert-stream bench (capped process): error: {exc}", file=sys.stderr)
        return 2
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
