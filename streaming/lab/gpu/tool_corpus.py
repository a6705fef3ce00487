"""`gpu_tool.py corpus`: `expert-stream bench --corpus` (teacher-forced decode over text files on a
trained checkpoint: the model's own router decides, every step's logits compared bitwise with
stock's) with variants side by side, on a checkpoint optionally copied first to a RAM-backed
folder (/dev/shm) standing in for a fast SSD, under a memory cap where one is asked for. One
bench process runs every corpus file and variant; this writes its series and one table."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tool_common import CLI, add_cap_args, budget_for_share, cap_for, checkpoint_here, fmt, run_logged, table, write_outputs


def register(sub) -> None:
    p = sub.add_parser("corpus", help="bench --corpus (trained router, teacher-forced) with variants side by side",
                       description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="output folder (corpus.json, corpus.txt, bench.log)")
    p.add_argument("--checkpoint", type=Path, required=True, help="a trained MLX checkpoint folder (with its tokenizer)")
    p.add_argument("--copy-to", type=Path, default=None, metavar="DIR",
                   help="copy the checkpoint into DIR/<name> first and run on the copy (e.g. /dev/shm)")
    p.add_argument("--corpus", action="append", required=True, metavar="FILE", help="a text file (repeatable)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="streaming settings of one side (repeatable; ratios are to the first), "
                   "e.g. off:prefetch=false and on:prefetch=true")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--share", type=float, default=None,
                        help="budget as a share of each layer's experts (at least top-k slots)")
    budget.add_argument("--budget-gib", default=None, help="the budget in GiB, or auto (the default: auto)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=96)
    p.add_argument("--warmup-steps", type=int, default=8, help="bench --warmup-steps")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the variants, alternating (bench --rounds)")
    p.add_argument("--disk-gb", type=float, default=0.05, help="GB read to measure the disk first")
    p.add_argument("--stock", choices=("auto", "yes", "no"), default="yes",
                   help="stock mlx-lm beside (yes: every step's logits compared; default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a streaming setting for every variant")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the bench process")
    add_cap_args(p, "the streamed side")
    p.set_defaults(func=main, trace=None, synth="", synth_out=None)


def bench_argv(args, ck: Path, budget: str, cap: float | None) -> list[str]:
    argv = [*CLI, "bench", str(ck), "--budget-gib", budget, "--prompt-tokens", str(args.prompt_tokens),
            "--gen-tokens", str(args.gen_tokens), "--rounds", str(args.rounds), "--disk-gb", str(args.disk_gb),
            "--warmup-steps", str(args.warmup_steps),
            "--stock", args.stock, "--json"]
    for c in args.corpus:
        argv += ["--corpus", str(Path(c).resolve())]
    # bench prints a series (what this reads) only for variants: one run is the variant "default"
    for v in args.variant or ["default:"]:
        argv += ["--variant", v]
    for s in args.set:
        argv += ["--set", s]
    if cap is not None:
        argv += ["--memory-cap", str(cap)]
    return argv


HEADER = ["corpus", "variant", "decode tok/s", "rounds", "to first", "miss/tok", "MB/tok", "guessed right",
          "by prediction", "hidden", "lru/belady (sim)", "exact steps", "peak RSS GB"]


def rows(series: dict) -> list[list]:
    out = []
    for s in series:
        for v in s["variants"]:
            m, r = v["summary"], v["summary"]["ratio_to_first"]
            e = m.get("exactness") or {}
            pct = lambda x: None if x is None else f"{100 * x:.1f}%"  # noqa: E731
            out.append([Path(s["corpus"]).name if s.get("corpus") else "-", v["name"], m["decode_tok_s"],
                        " ".join(fmt(x) for x in m["decode_tok_s_rounds"]), r.get("decode_tok_s"),
                        m["misses_per_token"], m["bytes_per_token"] / 1e6 if m["bytes_per_token"] is not None else None,
                        pct(m["guess_hit_rate"]), pct(m["by_prediction_share"]), pct(m["hidden_share"]),
                        f"{fmt(m['lru_misses_per_token'], 1)} / {fmt(m['belady_misses_per_token'], 1)}",
                        f"{e['steps_equal']}/{e['steps_compared']}" if e.get("checked") else "-", m["peak_rss_gb"]])
    return out


def main(args) -> int:
    for c in args.corpus:
        if not Path(c).is_file():
            raise SystemExit(f"--corpus {c}: no such file")
    if not (args.checkpoint / "config.json").is_file():
        raise SystemExit(f"--checkpoint {args.checkpoint}: no config.json there; give an MLX checkpoint folder")
    ck = checkpoint_here(args, args.out)
    if args.share is not None:
        budget_gib, _ = budget_for_share(ck, args.share)
        budget = str(budget_gib)
    else:
        budget = args.budget_gib or "auto"
        budget_gib = None if budget == "auto" else float(budget)
    cap, cap_note = cap_for(budget_gib, args)
    argv = bench_argv(args, ck, budget, cap)
    t0 = time.perf_counter()
    rc, stdout = run_logged(argv, args.out / "bench.log", timeout=args.timeout)
    try:
        doc = json.loads(stdout)
    except json.JSONDecodeError:
        tail = (args.out / "bench.log").read_text().strip().splitlines()[-3:]
        raise SystemExit(f"expert-stream bench gave no report (rc {rc}): " + " | ".join(tail))
    series = doc["series"]
    for s, c in zip(series, args.corpus):
        s.setdefault("corpus", str(c))
    head = (f"checkpoint {ck}; budget {budget}; {args.prompt_tokens} prompt + {args.gen_tokens} teacher-forced "
            f"tokens, {args.rounds} round(s); {cap_note}; bench {time.perf_counter() - t0:.0f} s\n"
            "workload: the checkpoint's own (trained) router, teacher-forced on each corpus file\n")
    write_outputs(args.out, "corpus", {"checkpoint": str(ck), "budget": budget, "cap_gib": cap, "cap": cap_note,
                                       "argv": argv, "rc": rc, "series": series}, head + table(HEADER, rows(series)))
    return rc
