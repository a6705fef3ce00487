"""`gpu_tool.py bench`: the replay benchmark at several budgets, each run one
`expert-stream bench` process (page cache dropped before every timed run, streamed side under
a cgroup v2 memory cap where this machine allows one, stock side by side at "full")."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tool_common import (CLI, add_cap_args, add_checkpoint_args, budget_for_share, cap_for, checkpoint_here, parse_pairs,
                         run_logged, table, write_outputs)


def register(sub) -> None:
    p = sub.add_parser("bench", help="replay benchmark runs at several budgets (expert-stream bench)",
                       description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="output folder (bench.json, bench.txt, runs/)")
    add_checkpoint_args(p)
    p.add_argument("--runs", default="0.25,0.5,full",
                   help="comma list: a share of each layer's experts in the budget (0.25), 'full' (every "
                   "expert, stock side by side), or 'auto' (budget_gib auto: the process sizes itself to its "
                   "memory, under --cap-gib its cgroup cap)")
    p.add_argument("--stock", choices=("full", "yes", "no"), default="full",
                   help="run stock mlx-lm beside the streamed side: at 'full' runs only (default), every run, or never")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="run every budget once per variant (repeatable; default one run with the defaults). "
                   "lower-case keys are streaming settings (--set), UPPER-CASE ones environment variables "
                   "of the bench process (MLX reads its CUDA settings once per process), e.g. "
                   "cuda:slot_write=cuda or nographs:MLX_USE_CUDA_GRAPHS=0")
    add_cap_args(p, "the streamed side")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--disk-gb", type=float, default=1.0, help="GB the bench reads to measure the disk first")
    p.add_argument("--trace-start", type=int, default=None, help="expert-stream bench --trace-start")
    p.add_argument("--timeout", type=float, default=None, help="seconds per bench process (default: none)")
    p.set_defaults(func=main)


def variants(specs: list[str]) -> list[tuple[str, dict, dict]]:
    """(name, settings, environment) of each --variant."""
    out = []
    for spec in specs or ["default:"]:
        name, _, pairs = spec.partition(":")
        kv = parse_pairs(pairs, f"--variant {spec}")
        out.append((name, {k: v for k, v in kv.items() if not k.isupper()}, {k: v for k, v in kv.items() if k.isupper()}))
    return out


def one_run(args, ck: Path, run: str, variant: tuple[str, dict, dict]) -> dict:
    name, settings, env = variant
    if run == "auto":
        share, budget, slots = None, "auto", None
    else:
        share = 1.0 if run == "full" else float(run)
        budget, slots = budget_for_share(ck, share)
    cap, cap_note = cap_for(budget if run != "auto" else None, args)
    stock = "yes" if args.stock == "yes" or (args.stock == "full" and run == "full") else "no"
    argv = [*CLI, "bench", str(ck), "--budget-gib", str(budget), "--stock", stock,
            "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
            "--disk-gb", str(args.disk_gb), "--json"]
    if args.trace is not None:
        argv += ["--routing", str(args.trace)]
    if args.trace_start is not None:
        argv += ["--trace-start", str(args.trace_start)]
    if cap is not None:
        argv += ["--memory-cap", str(cap)]
    for k, v in settings.items():
        argv += ["--set", f"{k}={v}"]
    tag = f"{run}-{name}"
    t0 = time.perf_counter()
    rc, stdout = run_logged(argv, args.out / "runs" / f"{tag}.log", env=env, timeout=args.timeout)
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError:
        tail = (args.out / "runs" / f"{tag}.log").read_text().strip().splitlines()[-3:]
        report = {"error": f"no report (rc {rc}): " + " | ".join(tail)}
    # An auto budget's size is what the engine resolved in the child (the slots' bytes).
    slot_gb = report.get("slot_gb")
    report.update(run=run, variant=name, variant_settings=settings, variant_env=env, share=share,
                  slots_target=slots, budget_gib=budget, slot_gib=slot_gb * 1e9 / 2**30 if slot_gb else None,
                  cap_gib=cap, cap=cap_note, rc=rc,
                  wall_s=round(time.perf_counter() - t0, 1))
    (args.out / "runs" / f"{tag}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


HEADER = ["run", "variant", "budget GiB", "slot GiB", "slots", "cap GiB", "decode tok/s", "stock tok/s", "to stock",
          "miss/tok", "MB/tok", "read GB/s", "disk GB/s", "to bound", "to bound (reader)", "reads hidden",
          "sim lru", "sim belady", "peak GiB", "result"]


def row(r: dict) -> list:
    sim = (r.get("routing") or {}).get("sim_misses_per_token") or {}
    cap = r.get("memory_cap") or {}
    if r.get("result") == "killed":
        result = r["killed_under_cap"]
    elif "error" in r:
        result = r["error"][:120]
    else:
        result = "ok"
    mb = r.get("bytes_per_token")
    slots = r.get("slots_per_layer")
    if slots == [] and r.get("slot_gib"):
        slots = "all"  # every layer holds every expert: none streams
    elif slots:
        slots = f"{min(slots)}-{max(slots)}" if min(slots) != max(slots) else slots[0]
    else:
        slots = r["slots_target"]
    budget = r["budget_gib"] if isinstance(r["budget_gib"], str) else f"{r['budget_gib']:g}"
    return [r["run"], r["variant"], budget, r.get("slot_gib"), slots, r["cap_gib"] or "none",
            r.get("decode_tok_s"), r.get("stock_tok_s"), r.get("ratio_to_stock"), r.get("misses_per_token"),
            mb / 1e6 if mb is not None else None, r.get("read_gbps_run"), r.get("disk_gbps"),
            r.get("ratio_to_bound"), r.get("ratio_to_bound_run"), r.get("reads_hidden_share"),
            sim.get("lru"), sim.get("belady"), cap["peak_gb"] * 1e9 / 2**30 if cap.get("peak_gb") else None, result]


def parse_runs(text: str) -> list[str]:
    runs = [r.strip() for r in text.split(",") if r.strip()]
    for r in runs:
        try:
            ok = r in ("auto", "full") or 0 < float(r) <= 1
        except ValueError:
            ok = False
        if not ok:
            sys.exit(f"--runs: {r!r} is not a share in (0, 1], 'full' or 'auto'")
    return runs


def main(args) -> int:
    runs, vs = parse_runs(args.runs), variants(args.variant)
    ck = checkpoint_here(args, args.out)
    reports = []
    for run in runs:
        for v in vs:
            reports.append(one_run(args, ck, run, v))
            print(f"bench {run} {v[0]}: rc {reports[-1]['rc']}, {reports[-1]['wall_s']} s", flush=True)
            # Written after every run: a call cut short still leaves the runs done.
            notes = sorted({r["cap"] for r in reports})
            text = (f"checkpoint {ck}; trace {args.trace or 'none (own routing)'}; "
                    f"{args.prompt_tokens} prompt + {args.gen_tokens} generated tokens\n"
                    + "".join(f"cap: {n}\n" for n in notes) + table(HEADER, [row(r) for r in reports]))
            write_outputs(args.out, "bench", {"checkpoint": str(ck), "trace": str(args.trace) if args.trace else None,
                                              "runs": reports}, text, echo=False)
    print(text, end="")
    return 0 if all(r["rc"] == 0 for r in reports) else 1
