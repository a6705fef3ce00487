"""`expert-stream bench`: decode and prefill speed against the disk+compute bound, beside stock
mlx-lm; with --ranks, mlx-lm's pipeline mode beside one process (bench_ranks.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from expert_stream.streaming.errors import SettingsError
from expert_stream.streaming.lab.setting_values import parse_settings
from expert_stream.streaming.settings import budget_from_text
from expert_stream.plugin.cli.lab.bench_series import budget_text, exactness_text


def register(sub) -> None:
    b = sub.add_parser("bench", help="decode/prefill speed vs the disk+compute bound and stock mlx-lm")
    b.add_argument("model_dir")
    b.add_argument("--budget-gib", type=budget_from_text, default="auto",
                   help="GiB of expert slots, or auto (the default: fit to memory, e.g. under --memory-cap)")
    b.add_argument("--prompt-tokens", type=int, default=512)
    b.add_argument("--gen-tokens", type=int, default=64)
    b.add_argument("--corpus", action="append", default=[], metavar="FILE",
                   help="decode teacher-forced over this text file (repeatable): its first --prompt-tokens "
                   "tokens are the prompt, each next one is fed as the next decode token; the model's own router "
                   "decides; every step's logits are compared bitwise with stock's")
    b.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="a variant of the streaming settings to run side by side with the others in one series "
                   "(repeatable), e.g. --variant off:prefetch=false --variant on:prefetch=true; ratios are to the first")
    b.add_argument("--warmup-steps", type=int, default=8, metavar="N",
                   help="decode steps of the warm-up generation before each timed run (it compiles kernels and "
                   "leaves the expert cache as a previous request would)")
    b.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run the variants N times each, alternately (the order reverses each round)")
    b.add_argument("--stock", choices=("auto", "yes", "no"), default="auto",
                   help="run stock mlx-lm side by side (auto: when the checkpoint fits in memory)")
    b.add_argument("--sweep", default=None, metavar="B1,B2,...",
                   help="run these budgets (GiB) instead of one and report tok/s and miss rate per budget")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a streaming setting (repeatable), e.g. --set prefetch=false --set policy=lru")
    b.add_argument("--disk-gb", type=float, default=1.0, help="GB read to measure the disk's bandwidth")
    b.add_argument("--routing", default=None, metavar="TRACE.npz",
                   help="replay this routing trace of a trained model through every MoE layer (stock and streamed)")
    b.add_argument("--trace-start", type=int, default=None, metavar="N",
                   help="trace row of the first prompt token (default: the timed decode starts at the trace's "
                   "first decode row)")
    b.add_argument("--memory-cap", type=float, default=None, metavar="GIB",
                   help="run the streamed side in a cgroup v2 memory.max of GIB, page cache included "
                   "(Linux, root); refused where the OS cannot")
    b.add_argument("--ranks", type=int, default=None, metavar="N",
                   help="also run mlx-lm's pipeline mode with N ranks on 127.0.0.1 (ring backend, through "
                   "mlx.launch), the budget per rank: tok/s and bytes per token of each rank beside one process")
    b.add_argument("--draft-model", default=None, metavar="DIR",
                   help="speculative decoding with this draft model (same tokenizer) beside single-token decode: "
                   "bytes and misses per generated token, acceptance, stock-equal tokens (--corpus FILE: the prompt)")
    b.add_argument("--num-draft", default="2,4", metavar="N,...",
                   help="draft tokens per verify pass to run (default 2,4)")
    b.add_argument("--acceptance", type=float, default=None, metavar="A",
                   help="with --routing: speculative decoding where each draft is accepted with probability A")
    b.add_argument("--rejected-routing", choices=("unrelated", "same"), default="unrelated",
                   help="with --acceptance: rejected drafts route as unrelated tokens (default) or as the tokens "
                   "later accepted at their positions")
    b.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    b.add_argument("--plot", default=None, metavar="OUT.png", help="plot tok/s and miss rate against budget")
    b.set_defaults(func=run_bench_command)


def parse_variant(text: str):
    """NAME:KEY=VALUE,KEY=VALUE (lower-case keys: streaming settings) -> series.Variant."""
    from expert_stream.streaming.lab.series import Variant

    name, _, pairs = text.partition(":")
    if not name.strip():
        raise SettingsError(f"--variant {text!r}: expected NAME:KEY=VALUE,... (e.g. off:prefetch=false)")
    settings = parse_settings([p for p in pairs.split(",") if p.strip()])
    upper = [k for k in settings if k != k.lower()]
    if upper:
        raise SettingsError(f"--variant {name}: {', '.join(upper)}: variant keys are streaming settings (lower-case)")
    return Variant(name.strip(), settings)


def run_bench_command(args) -> int:
    from expert_stream.plugin.cli.lab import bench_draft
    from expert_stream.streaming.lab.bench import BenchConfig, run_bench

    settings = parse_settings(args.set)
    if bench_draft.wanted(args):
        return bench_draft.run(args, settings)
    if args.ranks is not None:
        return _bench_ranks(args, settings)
    _check_combinations(args)
    if args.variant or args.rounds > 1:
        return _bench_series(args, settings)
    run = run_bench
    if args.memory_cap is not None:
        from expert_stream.streaming.lab.capped_bench import run_bench_capped
        from expert_stream.streaming.lab.memory_cap import MemoryCapError, unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise MemoryCapError(f"--memory-cap {args.memory_cap}: {reason}")
        run = lambda cfg: run_bench_capped(cfg, args.memory_cap)  # noqa: E731
    budgets = [float(b) for b in args.sweep.split(",")] if args.sweep else [args.budget_gib]
    if args.plot:
        pyplot()  # fail before the runs, not after
    reports = []
    stock, known = args.stock, None
    for budget in budgets:
        for corpus in args.corpus or [None]:
            cfg = _config(args, settings, budget, corpus, BenchConfig)
            cfg.stock, cfg.known_t_compute = stock, known
            reports.append(run(cfg))
            # The compute floor and stock do not depend on the budget: measure them once (but
            # teacher-forced, stock runs on each corpus and budget for its logits).
            if "t_compute_s" in reports[-1] and corpus is None:
                known, stock = (reports[-1]["t_compute_s"], reports[-1]["t_compute_source"]), "no"
    if args.plot:
        plot_sweep(reports, args.plot)
    if args.json:
        json.dump(reports[0] if len(reports) == 1 else {"sweep": reports}, sys.stdout, indent=2)
        print()
    else:
        for r in reports:
            print_report(r)
    return 0


def _config(args, settings: dict, budget, corpus, config_class):
    return config_class(
        model_dir=Path(args.model_dir), budget_gib=budget, prompt_tokens=args.prompt_tokens,
        gen_tokens=args.gen_tokens, settings=settings, stock=args.stock, disk_bytes=int(args.disk_gb * 1e9),
        routing=Path(args.routing) if args.routing else None, trace_start=args.trace_start,
        corpus=Path(corpus) if corpus else None, warmup_steps=args.warmup_steps,
    )


def _check_combinations(args) -> None:
    """Refuse flags that do not combine, and corpora too short, before anything runs."""
    if args.corpus and args.routing:
        raise SettingsError("--corpus decodes with the model's own routing and --routing replays a trace's: choose one")
    if args.rounds < 1:
        raise SettingsError(f"--rounds {args.rounds}: at least 1")
    if args.warmup_steps < 0:
        raise SettingsError(f"--warmup-steps {args.warmup_steps}: at least 0")
    if (args.variant or args.rounds > 1) and (args.sweep or args.plot):
        raise SettingsError("--variant / --rounds run a series at one budget: instead of --sweep, give variants "
                            "a budget_gib each (e.g. --variant q:budget_gib=2 --variant h:budget_gib=4); --plot needs --sweep")
    if args.corpus:
        from expert_stream.streaming.footprint import checkpoint_footprint
        from expert_stream.streaming.lab.teacher_forced import check_corpora

        checkpoint_footprint(Path(args.model_dir))  # a checkpoint at all, before its tokenizer
        check_corpora(Path(args.model_dir), [Path(c) for c in args.corpus], args.prompt_tokens, args.gen_tokens)


def _bench_series(args, settings) -> int:
    from expert_stream.plugin.cli.lab.bench_series import print_series
    from expert_stream.streaming.lab.bench import BenchConfig, run_streamed
    from expert_stream.streaming.lab.series import Variant, run_series

    variants = [parse_variant(v) for v in args.variant] or [Variant("default", {})]
    if args.memory_cap is not None:
        from expert_stream.streaming.lab.capped_bench import run_streamed_capped
        from expert_stream.streaming.lab.memory_cap import MemoryCapError, unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise MemoryCapError(f"--memory-cap {args.memory_cap}: {reason}")
        run_one = lambda cfg: run_streamed_capped(cfg, args.memory_cap)  # noqa: E731
    else:
        run_one = lambda cfg: run_streamed(cfg)[0]  # noqa: E731
    series = [run_series(_config(args, settings, args.budget_gib, corpus, BenchConfig), variants, args.rounds, run_one)
              for corpus in args.corpus or [None]]
    if args.json:
        json.dump({"series": series}, sys.stdout, indent=2)
        print()
    else:
        for s in series:
            print_series(s)
    return 0


def _bench_ranks(args, settings) -> int:
    from expert_stream.plugin.cli.lab.bench_ranks import print_ranks, run_ranks

    if args.ranks < 2:
        raise SettingsError(f"--ranks {args.ranks}: a pipeline needs at least 2 ranks")
    for flag in ("sweep", "routing", "memory_cap", "plot"):
        if getattr(args, flag) is not None:
            raise SettingsError(f"--ranks does not combine with --{flag.replace('_', '-')}")
    for flag in ("corpus", "variant"):
        if getattr(args, flag):
            raise SettingsError(f"--ranks does not combine with --{flag}")
    if args.rounds > 1 or args.warmup_steps != 8:
        raise SettingsError("--ranks does not combine with --rounds or --warmup-steps")
    report = run_ranks(str(Path(args.model_dir).expanduser()), args.budget_gib, args.ranks, args.prompt_tokens,
                       args.gen_tokens, settings)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print_ranks(report)
    return 0


def print_report(r: dict) -> None:
    if r.get("result") == "killed":
        print(f"budget {budget_text(r['budget_gib'])}: {r['killed_under_cap']} (rc {r['returncode']}, "
              f"oom_kill events {r['memory_cap']['oom_kills']})\n")
        return
    rows = [
        ("checkpoint", f"{r['checkpoint_gb']:.2f} GB ({r['expert_gb']:.2f} GB experts, {r['trunk_gb']:.2f} GB trunk), {r['model_type']}"),
        ("budget", f"{budget_text(r['budget_gib'])} -> {r['slot_gb']:.2f} GB of slots, {min(r['slots_per_layer'])}-{max(r['slots_per_layer'])} per layer"),
        ("device", f"{r['device']}; reader {r['reader']}, page cache {r['cache_bypass']}"),
        ("decode", f"{r['decode_tok_s']:.2f} tok/s"),
        ("prefill", f"{r['prefill_tok_s']:.1f} tok/s ({r['prompt_tokens']} tokens)"),
        ("workload", _workload(r)),
        ("miss rate", f"{r['miss_rate']:.1%}, {r['misses_per_token']:.1f} misses per decode token"),
        ("bytes/token", f"{r['bytes_per_token'] / 1e6:.1f} MB decode, {r['bytes_per_prompt_token'] / 1e6:.2f} MB per prompt token"),
        ("prefill reads", f"{r['prefill_reads_per_missed_expert']:.3f} x the missed experts' bytes"),
        ("disk", f"{r['disk_gbps']:.2f} GB/s (engine reader on these shards)"),
        ("t_compute", f"{r['t_compute_s'] * 1e3:.1f} ms/token ({r['t_compute_source']})"),
        ("t_disk", f"{r['t_disk_s'] * 1e3:.1f} ms/token"),
        ("bound", f"{r['bound_tok_s']:.2f} tok/s -> ratio to bound {r['ratio_to_bound']:.2f}"),
    ]
    if r.get("disk_bound_tok_s") is not None:
        rows.append(("disk bound", f"{r['disk_bound_tok_s']:.2f} tok/s at the reader's {r['read_gbps_run']:.2f} GB/s "
                                   f"during decode -> ratio {r['ratio_to_disk_bound']:.2f}; with t_compute "
                                   f"{r['bound_run_tok_s']:.2f} tok/s -> ratio {r['ratio_to_bound_run']:.2f}"))
    if r.get("reads_hidden_share") is not None:
        rows.append(("reads", f"{r['read_busy_per_token_s'] * 1e3:.1f} ms/token in flight, "
                              f"{r['read_wait_per_token_s'] * 1e3:.1f} ms waited for: "
                              f"{r['reads_hidden_share']:.0%} hidden behind compute"))
    reads = r.get("reads")
    if reads and reads["experts_read"]:
        rows.append(("experts read", f"{reads['experts_read_per_token']:.1f} per decode token: {reads['hidden_share']:.0%} "
                                     f"were in when their layer came for them (hidden), {reads['waited']} of "
                                     f"{reads['experts_read']} waited for"))
    if reads and reads.get("syncs_per_token"):
        rows.append(("syncs", f"{reads['syncs_per_token']:.1f} per decode token, {reads['sync_per_token_s'] * 1e3:.1f} ms "
                              f"waiting in them; {reads['demand_layers_per_token']:.1f} layers a token read on demand"))
    sim = r.get("routing", {}).get("sim_misses_per_token")
    if sim:
        rows.append(("simulated", ", ".join(f"{k} {v:.1f}" for k, v in sim.items() if v is not None)
                     + " misses per decode token (same rows, same slots)"))
    recorded = r.get("recorded")
    if recorded:
        rows.append(("simulated", ", ".join(f"{k} {v:.1f}" for k, v in recorded["sim_misses_per_token"].items()
                                            if v is not None)
                     + " misses per decode token on the routing recorded in this run, from its caches as the "
                     "decode began" + ("; the online budget moved slots since" if recorded["slots_moved"] else "")))
    exactness = r.get("exactness")
    if exactness:
        rows.append(("exactness", exactness_text(exactness)))
    pc = r.get("page_cache") or {}
    if pc:
        share = pc.get("resident_share_after")
        rows.append(("page cache", f"dropped before each timed run ({pc['method']}; "
                                   + (f"{share:.1%} still cached after" if share is not None else "residency unknown") + ")"))
    cap = r.get("memory_cap")
    rows.append(("memory cap", f"{cap['gib']} GiB ({cap['mechanism']}), streamed side only; "
                               + (f"group peak {cap['peak_gb']:.2f} GB" if cap.get("peak_gb") else "peak not reported")
                 if cap else "none"))
    if "stock_tok_s" in r:
        agreement = r.get("token_agreement_with_stock")
        rows.append(("stock", f"{r['stock_tok_s']:.2f} tok/s -> ratio to stock {r['ratio_to_stock']:.2f}"
                              + (f", token agreement {agreement:.2f}" if agreement is not None else "")))
    if "token_agreement_with_exact" in r:
        rows.append(("lossy", f"token agreement with exact output {r['token_agreement_with_exact']:.2f} "
                              f"(exact run {r['exact_decode_tok_s']:.2f} tok/s)"))
    look = r["lookahead"]
    if look["guess_hit_rate"] is not None:
        rows.append(("lookahead", f"guesses right {look['guess_hit_rate']:.1%} ({look['guess_hits']}/{look['guesses']}), "
                                  f"{look['prefetch_used']}/{look['prefetch_reads']} prefetch reads used, "
                                  f"{look['layers_off']} layers switched off"
                                  + (f" ({look['note']})" if look.get("note") else "")))
        rows.append(("by prediction", f"{look['by_prediction_share']:.1%} of the expert uses that needed a read "
                                      f"({look['by_prediction_share_of_uses']:.1%} of all expert uses)"))
    rows.append(("peak RSS", f"{r['peak_rss_gb']:.2f} GB"))
    load = r.get("load_average")
    if load:
        rows.append(("load average", f"{load['before'][0]:.2f} before, {load['after'][0]:.2f} after (1 min)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print()


def _workload(r: dict) -> str:
    routing = r.get("routing")
    if not routing:
        return r.get("workload", "own routing")
    share = routing["decode_rows_from_trace_decode"]
    return (f"replay: real routing replayed: {routing['trace_name']} from row {routing['trace_start']} "
            f"({routing['trace_layers']} trace layers over {routing['model_moe_layers']} MoE layers"
            + (f"; {share:.0%} of the timed decode rows are decode rows of the trace" if share is not None else "") + ")")


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SettingsError("--plot needs matplotlib: pip install 'mlx-expert-stream[plot]'") from None
    return plt


def plot_sweep(reports: list[dict], out: str) -> None:
    plt = pyplot()
    reports = [r for r in reports if r.get("result") != "killed"]
    budgets = [r["budget_gib"] for r in reports]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(budgets, [r["decode_tok_s"] for r in reports], "o-", label="decode tok/s")
    ax.plot(budgets, [r["bound_tok_s"] for r in reports], "--", label="bound tok/s")
    ax.set_xlabel("budget (GiB)")
    ax.set_ylabel("tokens / s")
    ax2 = ax.twinx()
    ax2.plot(budgets, [100 * r["miss_rate"] for r in reports], "s:", color="tab:red", label="miss rate %")
    ax2.set_ylabel("miss rate (%)")
    fig.legend(loc="upper center")
    fig.tight_layout()
    fig.savefig(out, dpi=120)

