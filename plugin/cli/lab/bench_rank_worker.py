"""One process of `expert-stream bench --ranks N` (started by mlx.launch, one per rank, or alone
for the one-process run beside it): load streamed, prefill a fixed prompt, time a greedy decode,
print this process's figures as one JSON line."""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx
import numpy as np


def run(args: dict) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    import expert_stream
    from expert_stream.streaming.lab.page_cache import drop_checkpoint

    group = mx.distributed.init(backend="ring") if args["ranks"] > 1 else None
    model, _, handle = expert_stream.load(args["model_dir"], pipeline_group=group, budget_gib=args["budget_gib"],
                                          **args["settings"])
    vocab = model.args.vocab_size if hasattr(model, "args") else 256
    prompt = np.random.default_rng(0).integers(3, min(vocab, 30000), args["prompt_tokens"]).astype(np.int32)
    drop_checkpoint(handle.index.files)  # read from the disk, not the page cache
    cache = make_prompt_cache(model)
    t0 = time.perf_counter()
    out = model(mx.array(prompt[None]), cache=cache)
    mx.eval(out)
    prefill_s = time.perf_counter() - t0
    token = mx.argmax(out[:, -1:], axis=-1)
    before = handle.stats()["totals"]
    t0 = time.perf_counter()
    for _ in range(args["gen_tokens"]):
        out = model(token, cache=cache)
        token = mx.argmax(out[:, -1:], axis=-1)
        mx.eval(token)
    decode_s = time.perf_counter() - t0
    after = handle.stats()["totals"]
    tokens = args["gen_tokens"]
    inner = model.model
    first = getattr(inner, "start_idx", 0) or 0
    end = getattr(inner, "end_idx", None) or len(inner.layers)
    handle.close()
    return {
        "rank": group.rank() if group is not None else None, "layers": [first, end],
        "streamed_layers": len(handle.streams), "slot_bytes": handle.budget_bytes,
        "prefill_tok_s": args["prompt_tokens"] / prefill_s, "decode_tok_s": tokens / decode_s,
        "bytes_per_token": (after["bytes_read"] - before["bytes_read"]) / tokens,
        "misses_per_token": (after["misses"] - before["misses"]) / tokens,
        "read_wait_ms_per_token": (after["read_seconds"] - before["read_seconds"]) / tokens * 1e3,
    }


if __name__ == "__main__":
    print("BENCH " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
