"""`expert-stream bench` (speed and its bound, beside stock) and `expert-stream trace` (record
routing on a text corpus, for warm start and per-layer budgets)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from expert_stream.streaming.errors import SettingsError
from expert_stream.streaming.settings import budget_from_text


def register(sub) -> None:
    b = sub.add_parser("bench", help="decode/prefill speed vs the disk+compute bound and stock mlx-lm")
    b.add_argument("model_dir")
    b.add_argument("--budget-gib", type=budget_from_text, default="auto",
                   help="GiB of expert slots, or auto (the default: fit to memory, e.g. under --memory-cap)")
    b.add_argument("--prompt-tokens", type=int, default=512)
    b.add_argument("--gen-tokens", type=int, default=64)
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
    b.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    b.add_argument("--plot", default=None, metavar="OUT.png", help="plot tok/s and miss rate against budget")
    b.set_defaults(func=run_bench_command)

    t = sub.add_parser("trace", help="record routing on a text corpus into a trace file")
    t.add_argument("model_dir")
    t.add_argument("--out", required=True, help="trace file to write (.npz, the shared trace format)")
    t.add_argument("--budget-gib", type=budget_from_text, default="auto")
    t.add_argument("--corpus", default=None, help="text file; documents separated by blank lines "
                   "(default: the project's embedded English text)")
    t.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens generated after each document")
    t.add_argument("--max-docs", type=int, default=64)
    t.set_defaults(func=run_trace_command)


def parse_settings(pairs: list[str]) -> dict:
    """KEY=VALUE strings -> typed settings (bool, int, float, None or string)."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SettingsError(f"--set {pair!r}: expected KEY=VALUE")
        key, raw = pair.split("=", 1)
        low = raw.lower()
        if low in ("true", "false"):
            value = low == "true"
        elif low in ("none", "null"):
            value = None
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key.strip()] = value
    return out


def run_bench_command(args) -> int:
    from expert_stream.streaming.lab.bench import BenchConfig, run_bench

    settings = parse_settings(args.set)
    if args.ranks is not None:
        return _bench_ranks(args, settings)
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
        cfg = BenchConfig(
            model_dir=Path(args.model_dir), budget_gib=budget, prompt_tokens=args.prompt_tokens,
            gen_tokens=args.gen_tokens, settings=settings, stock=stock,
            disk_bytes=int(args.disk_gb * 1e9), known_t_compute=known,
            routing=Path(args.routing) if args.routing else None, trace_start=args.trace_start,
        )
        reports.append(run(cfg))
        # The compute floor and stock do not depend on the budget: measure them once.
        if "t_compute_s" in reports[-1]:
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


def _bench_ranks(args, settings) -> int:
    from expert_stream.plugin.cli.bench_ranks import print_ranks, run_ranks

    if args.ranks < 2:
        raise SettingsError(f"--ranks {args.ranks}: a pipeline needs at least 2 ranks")
    for flag in ("sweep", "routing", "memory_cap", "plot"):
        if getattr(args, flag) is not None:
            raise SettingsError(f"--ranks does not combine with --{flag.replace('_', '-')}")
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
        print(f"budget {r['budget_gib']} GiB: {r['killed_under_cap']} (rc {r['returncode']}, "
              f"oom_kill events {r['memory_cap']['oom_kills']})\n")
        return
    rows = [
        ("checkpoint", f"{r['checkpoint_gb']:.2f} GB ({r['expert_gb']:.2f} GB experts, {r['trunk_gb']:.2f} GB trunk), {r['model_type']}"),
        ("budget", f"{r['budget_gib']} GiB -> {r['slot_gb']:.2f} GB of slots, {min(r['slots_per_layer'])}-{max(r['slots_per_layer'])} per layer"),
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
    sim = r.get("routing", {}).get("sim_misses_per_token")
    if sim:
        rows.append(("simulated", ", ".join(f"{k} {v:.1f}" for k, v in sim.items() if v is not None)
                     + " misses per decode token (same rows, same slots)"))
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
        rows.append(("stock", f"{r['stock_tok_s']:.2f} tok/s -> ratio to stock {r['ratio_to_stock']:.2f}, "
                              f"token agreement {r['token_agreement_with_stock']:.2f}"))
    if "token_agreement_with_exact" in r:
        rows.append(("lossy", f"token agreement with exact output {r['token_agreement_with_exact']:.2f} "
                              f"(exact run {r['exact_decode_tok_s']:.2f} tok/s)"))
    look = r["lookahead"]
    if look["guess_hit_rate"] is not None:
        rows.append(("lookahead", f"guesses right {look['guess_hit_rate']:.1%}, {look['prefetch_used']}/{look['prefetch_reads']} "
                                  f"prefetch reads used, {look['layers_off']} layers switched off"
                                  + (f" ({look['note']})" if look.get("note") else "")))
    rows.append(("peak RSS", f"{r['peak_rss_gb']:.2f} GB"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print()


def _workload(r: dict) -> str:
    routing = r.get("routing")
    if not routing:
        return r.get("workload", "own routing")
    share = routing["decode_rows_from_trace_decode"]
    return (f"real routing replayed: {routing['trace_name']} from row {routing['trace_start']} "
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


def run_trace_command(args) -> int:
    from mlx_lm.generate import generate_step
    from tqdm import tqdm

    import expert_stream
    from expert_stream.streaming.traces import save_trace

    if args.corpus:
        text = Path(args.corpus).read_text()
    else:
        from expert_stream.streaming.lab.synthetic.corpus import CORPUS as text
    docs = [d.strip() for d in text.split("\n\n") if d.strip()][: args.max_docs]
    model, tokenizer, handle = expert_stream.load(args.model_dir, budget_gib=args.budget_gib)
    with handle.recording() as recorder:
        for doc in tqdm(docs, desc="trace", file=sys.stderr):
            prompt = __import__("mlx.core", fromlist=["array"]).array(tokenizer.encode(doc))
            for _ in generate_step(prompt, model, max_tokens=args.gen_tokens):
                pass
            recorder.new_sequence()
    trace = recorder.trace(name=Path(args.out).stem, meta={"model_dir": str(args.model_dir), "documents": len(docs)})
    path = save_trace(args.out, trace)
    handle.close()
    print(f"{path}: {trace.num_tokens} tokens x {trace.num_layers} layers x top-{trace.top_k}")
    return 0
