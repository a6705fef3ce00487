"""`expert-stream bench --draft-model DIR` (or `--routing TRACE --acceptance A`): bytes and
misses per generated token of speculative decoding beside single-token decode, and the
acceptance (streaming/lab/draft_bench.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from expert_stream.streaming.errors import SettingsError


def wanted(args) -> bool:
    return args.draft_model is not None or args.acceptance is not None


def check(args) -> None:
    if args.routing and args.draft_model:
        raise SettingsError("--routing replays a trace's routing by position, which a draft's tokens cannot change: "
                            "give --acceptance A (e.g. measured with --draft-model on a trained model) instead of "
                            "--draft-model")
    if args.routing and args.acceptance is None:
        raise SettingsError("--routing with speculative decoding needs --acceptance A (0 to 1)")
    if args.acceptance is not None and not args.routing:
        raise SettingsError("--acceptance is for --routing; with --draft-model the draft's acceptance is measured")
    for flag in ("variant", "sweep", "ranks", "memory_cap", "plot"):
        if getattr(args, flag):
            raise SettingsError(f"--{flag.replace('_', '-')} does not combine with --draft-model / --acceptance")
    if len(args.corpus) > 1:
        raise SettingsError("--draft-model takes one --corpus (its prompt)")


def num_drafts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 or v > 64 for v in values):
        raise SettingsError(f"--num-draft {text!r}: comma-separated draft counts, 1 to 64 (e.g. 2,4)")
    return [0] + values


def run(args, settings: dict) -> int:
    import numpy as np

    from expert_stream.streaming.lab.draft_bench import DraftRun, run_replayed, run_with_draft

    check(args)
    model_dir = Path(args.model_dir)
    prompt = _prompt(args, model_dir)
    draft_run = DraftRun(model_dir, args.budget_gib, prompt, args.gen_tokens, num_drafts(args.num_draft), settings,
                         prefill_step=int(settings.get("prefill_step", 512)))
    if args.routing:
        from expert_stream.streaming.lab.bench import replay_start
        from expert_stream.streaming.traces import load_trace

        start = args.trace_start if args.trace_start is not None else replay_start(load_trace(args.routing), len(prompt))
        report = run_replayed(draft_run, Path(args.routing), start, args.acceptance, args.rejected_routing)
    else:
        from expert_stream.streaming.footprint import checkpoint_footprint
        from expert_stream.streaming.lab.bench import stock_wanted

        stock = stock_wanted(SimpleNamespace(stock=args.stock), checkpoint_footprint(model_dir))  # auto: when it fits
        report = run_with_draft(draft_run, Path(args.draft_model), stock=stock)
    report.update(model_dir=str(model_dir), budget_gib=args.budget_gib, prompt_tokens=int(np.asarray(prompt).size),
                  gen_tokens=args.gen_tokens)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print_report(report)
    return 0


def _prompt(args, model_dir: Path):
    import numpy as np

    if args.corpus:
        from mlx_lm.utils import load_tokenizer

        from expert_stream.streaming.lab.teacher_forced import corpus_tokens

        return corpus_tokens(Path(args.corpus[0]), load_tokenizer(model_dir), args.prompt_tokens, 0)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config.get("text_config", config).get("vocab_size", 1024))
    return np.random.default_rng(0).integers(3, vocab - 1, args.prompt_tokens).astype(np.int32)


def print_report(r: dict) -> None:
    print(f"{r['workload']}: {r['model_dir']}, budget {r['budget_gib']}, {r['prompt_tokens']} prompt tokens")
    if "acceptance_given" in r:
        print(f"acceptance given {r['acceptance_given']}, rejected drafts routed as {r['rejected_routing']} tokens")
    else:
        print(f"draft: {r['draft_model']}")
    head = f"{'drafts':>6} {'tokens':>6} {'passes':>6} {'tok/pass':>8} {'MB/token':>9} {'misses/tok':>10} " \
           f"{'accept':>7} {'tok/s':>7}"
    print(head)
    base = r["runs"][0]["bytes_per_token"]
    for row in r["runs"]:
        accept = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        label = "single" if row["num_draft"] == 0 else str(row["num_draft"])
        ratio = f"  ({row['bytes_per_token'] / base:.2f}x)" if base and row["num_draft"] else ""
        exact = ""
        if "bitwise_equal_to_stock" in row:
            exact = "  stock-equal" if row["bitwise_equal_to_stock"] else "  DIFFERS FROM STOCK"
        print(f"{label:>6} {row['generated']:>6} {row['forwards']:>6} {row['tokens_per_forward']:>8.2f} "
              f"{row['bytes_per_token'] / 1e6:>9.3f} {row['misses_per_token']:>10.2f} {accept:>7} "
              f"{row['tok_s'] or 0:>7.2f}{ratio}{exact}")
