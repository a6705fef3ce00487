"""`expert-stream generate`: stream an MoE checkpoint and generate text (the engine on its own,
no server). Without MODEL_DIR it makes a synthetic checkpoint larger than the budget first."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from expert_stream.plugin.cli.output import print_stats
from expert_stream.streaming.settings import budget_from_text
from expert_stream.plugin.paths import cache_dir

# The embedded default: a small qwen3_moe whose experts are ~4x the default budget, float32 so
# that MLX's CPU backend runs it quickly (bf16 is ~10x slower there).
DEFAULT_BUDGET_GIB = 0.125
DEFAULT_MODEL = dict(arch="qwen3_moe", layers=8, experts=32, top_k=4, hidden=512, moe_hidden=512,
                     bits=4, dtype="float32", seed=0)


def register(sub) -> None:
    p = sub.add_parser("generate", help="stream an MoE checkpoint and generate text")
    p.add_argument("model_dir", nargs="?", help="MLX checkpoint folder (default: a synthetic MoE "
                   "checkpoint larger than the budget, made once in the cache folder)")
    p.add_argument("--budget-gib", type=budget_from_text, default=None,
                   help=f"expert cache budget in GiB, or auto (default: auto, fit to memory; {DEFAULT_BUDGET_GIB} "
                        "for the synthetic model, so that it streams)")
    p.add_argument("--prompt", default="Explain why the sky is blue.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--policy", default="default")
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--json", action="store_true", help="print the text and stats as JSON")
    p.set_defaults(func=run_generate)


def default_checkpoint() -> Path:
    from expert_stream.streaming.lab.synthetic import make_checkpoint

    out = cache_dir() / "generate-default"
    return make_checkpoint(out, progress=True, **DEFAULT_MODEL)


def run_generate(args) -> int:
    import mlx_lm

    import expert_stream

    model_dir = Path(args.model_dir) if args.model_dir else default_checkpoint()
    budget = args.budget_gib or ("auto" if args.model_dir else DEFAULT_BUDGET_GIB)
    t0 = time.perf_counter()
    model, tokenizer, handle = expert_stream.load(
        model_dir, budget_gib=budget, policy=args.policy, prefetch=not args.no_prefetch
    )
    load_s = time.perf_counter() - t0
    prompt = args.prompt
    if not args.no_chat_template and tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
    text, last = "", None
    for last in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens):
        text += last.text
        if not args.json:
            print(last.text, end="", flush=True)
    stats = handle.stats()
    handle.close()
    report = {
        "model_dir": str(model_dir),
        "budget_gib": budget,
        "load_seconds": round(load_s, 2),
        "prompt_tokens": last.prompt_tokens if last else 0,
        "prompt_tps": round(last.prompt_tps, 2) if last else 0.0,
        "generation_tokens": last.generation_tokens if last else 0,
        "generation_tps": round(last.generation_tps, 2) if last else 0.0,
        "peak_memory_gb": round(last.peak_memory, 3) if last else 0.0,
        "text": text,
        "stats": stats,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print()
        print_stats(report)
    return 0
