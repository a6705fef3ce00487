"""Prefill bytes, per-chunk sweep against layer-major prefill, side by side in one run: each
prompt length goes through mlx-lm's own `generate_step` after `expert_stream.load`, once with
`prefill_window: 0` (a sweep per `prefill_step` chunk, main's path before the layer-major one)
and once layer-major, and the bytes read by the prefill are printed over the bytes of the
experts the prompt routes to (each layer's distinct experts once: one pass). Each run is its own
process, so its peak RSS is its own: printed over its RSS after loading (the trunk; the slots
fill during the prefill), beside the terms the slots, the prompt's KV cache and the pass's
activations (`plan`'s activation term) take; `--stock` adds stock mlx-lm's prefill of the same
prompt (its peak over its loaded model: KV and its one chunk's temporaries).

    python -m expert_stream.streaming.lab.prefill_bytes [MODEL_DIR] --tokens 8192 16384

Without MODEL_DIR a float32 synthetic qwen3_moe checkpoint is written to a temporary folder
(random routing: each chunk touches nearly every expert, the worst case for the per-chunk path).
`--text FILE` takes the prompt from a text file (its first tokens by the model's tokenizer): a
trained checkpoint's own router on real text instead of random ids.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BUDGET_FRACTION = 0.25  # the figure: a budget of a quarter of the expert bytes


def prefill_figures(path: Path, tokens: int, window: int, step: int, fraction: float = BUDGET_FRACTION,
                    text: Path | None = None) -> dict:
    """One prefill of `tokens` prompt tokens (random, or `text`'s first): bytes read before the
    first decode step, the one-pass bytes of its routing, the seconds to the first token, and the
    memory it took: the process's peak RSS over its RSS after loading, beside the terms that
    bound it."""
    import expert_stream
    from expert_stream.streaming.footprint import checkpoint_footprint

    fp = checkpoint_footprint(path)
    budget = max(fp.budget_gib_for_slots(fp.top_k), fraction * fp.expert_bytes / 2**30)
    model, _, handle = expert_stream.load(path, budget_gib=budget, prefill_step=step, prefill_window=window,
                                          prefetch=False, online_budget=False)
    loaded = _rss()
    at_end = {}

    def progress(done, total):
        if done == total - 1 and not at_end:  # the prompt but its last token is in the cache
            at_end["bytes"] = handle.stats()["totals"]["bytes_read"]

    with handle.recording() as rec:
        seconds = _generate(model, _prompt(path, tokens, text), step, progress)
    size = {p.path: p.expert_bytes for p in handle.plans}
    ids = rec.trace().ids[: tokens - 1]
    one_pass = sum(np.unique(ids[:, i]).size * size[s.name] for i, s in enumerate(handle.streams))
    pass_tokens = handle.prefill.window_for(step, tokens) if window else step
    terms = {"slots": handle.budget_bytes, "kv": fp.kv.bytes_for(tokens),
             "activations": fp.prefill_token_bytes * min(pass_tokens, tokens)}
    handle.close()
    return {"tokens": tokens, "path": "per-chunk" if window == 0 else "layer-major", "bytes": at_end["bytes"],
            "one_pass_bytes": one_pass, "ratio": at_end["bytes"] / one_pass, "ttft_s": seconds,
            "loaded_rss": loaded, "peak_over_loaded": _peak_rss() - loaded, "terms": terms}


def stock_figures(path: Path, tokens: int, step: int, text: Path | None = None) -> dict:
    """Stock mlx-lm's prefill of the same prompt, every expert loaded: its seconds and its peak
    RSS over its RSS after loading (what its own prefill holds: KV, one chunk's temporaries)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    mx.eval(model.parameters())
    loaded = _rss()
    seconds = _generate(model, _prompt(path, tokens, text), step, lambda *_: None)
    return {"tokens": tokens, "path": "stock", "ttft_s": seconds, "loaded_rss": loaded,
            "peak_over_loaded": _peak_rss() - loaded}


def _prompt(path: Path, tokens: int, text: Path | None):
    """`tokens` prompt ids: random ones, or the text file's first ones by the model's tokenizer."""
    import mlx.core as mx

    if text is None:
        return mx.array(np.random.default_rng(tokens).integers(3, 500, tokens), dtype=mx.int32)
    from mlx_lm.utils import load_tokenizer

    from .teacher_forced import corpus_tokens

    return mx.array(corpus_tokens(text, load_tokenizer(Path(path)), tokens, 0))


def _generate(model, prompt, step: int, progress) -> float:
    import mlx.core as mx

    generate = importlib.import_module("mlx_lm.generate")
    t0 = time.perf_counter()
    for token, _ in generate.generate_step(prompt, model, max_tokens=1, prefill_step_size=step,
                                           prompt_progress_callback=progress):
        mx.eval(token)
    return time.perf_counter() - t0


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _in_child(fn, *args) -> dict:
    """`fn(*args)` in a fresh process: each run's peak RSS its own."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument("--window", type=int, default=32768, help="prefill_window of the layer-major runs")
    parser.add_argument("--stock", action="store_true", help="also stock mlx-lm's prefill (every expert loaded)")
    parser.add_argument("--text", type=Path, help="take the prompt from this text file (needs MODEL_DIR's tokenizer)")
    args = parser.parse_args(argv)
    if args.text and not args.model_dir:
        parser.error("--text needs MODEL_DIR: the prompt's tokens are the model's tokenizer's")
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model_dir) if args.model_dir else _synthetic(Path(tmp) / "model")
        print(f"{'tokens':>7} {'path':>12} {'bytes read':>14} {'one pass':>14} {'ratio':>6} {'ttft s':>8} "
              f"{'peak over loaded MiB':>21}  terms MiB (slots + KV + activations)")
        for tokens in args.tokens:
            if args.stock:
                r = _in_child(stock_figures, path, tokens, args.prefill_step, args.text)
                print(f"{tokens:>7} {'stock':>12} {'':>14} {'':>14} {'':>6} {r['ttft_s']:>8.1f} "
                      f"{r['peak_over_loaded'] / mib:>21.0f}")
            for window in (0, args.window):
                r = _in_child(prefill_figures, path, tokens, window, args.prefill_step, BUDGET_FRACTION, args.text)
                t = r["terms"]
                print(f"{r['tokens']:>7} {r['path']:>12} {r['bytes']:>14,} {r['one_pass_bytes']:>14,} "
                      f"{r['ratio']:>6.2f} {r['ttft_s']:>8.1f} {r['peak_over_loaded'] / mib:>21.0f}  "
                      f"{t['slots'] / mib:.0f} + {t['kv'] / mib:.0f} + {t['activations'] / mib:.0f}")


def _synthetic(out: Path) -> Path:
    from .synthetic import make_checkpoint

    return make_checkpoint(out, arch="qwen3_moe", layers=4, experts=64, top_k=8, dtype="float32", progress=False)


if __name__ == "__main__":
    main()
