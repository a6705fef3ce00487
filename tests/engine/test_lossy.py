"""The lossy knobs: off by default, and when on they do what they say."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from exactness import assert_same_logits, load_pair, prompt_ids
from expert_stream.streaming.lossy import override_top_k
from expert_stream.streaming.settings import StreamSettings


def test_exact_by_default():
    assert StreamSettings(budget_gib=1).exact
    assert not StreamSettings(budget_gib=1, top_k_override=2).exact


def test_top_k_override_equals_stock_with_the_same_top_k(checkpoints):
    path = checkpoints("qwen3_moe", experts=16, top_k=4)
    stock, streamed, handle = load_pair(path, slots=4, top_k_override=2)
    expert_paths = [s.name for s in handle.streams]
    override_top_k(stock, expert_paths, 4, 2)  # the same approximation applied to stock
    assert_same_logits(stock, streamed, prompt_ids(40), decode_steps=6)
    handle.close()


def test_skip_light_misses(checkpoints):
    path = checkpoints("qwen3_moe", experts=16, top_k=4)
    stock, exact, h_exact = load_pair(path, slots=4, prefetch=False)
    _, lossy, h_lossy = load_pair(path, slots=4, prefetch=False, skip_miss_below=0.3)
    caches = [make_prompt_cache(m) for m in (exact, lossy)]
    token = prompt_ids(1)
    agree = 0
    for _ in range(16):
        a, b = exact(token, cache=caches[0]), lossy(token, cache=caches[1])
        mx.eval(a, b)
        assert np.isfinite(np.array(b)).all()
        agree += int(mx.argmax(a[0, -1]).item() == mx.argmax(b[0, -1]).item())
        token = mx.argmax(a[:, -1:], axis=-1)
    lossy_stats = h_lossy.stats()["totals"]
    assert lossy_stats["skipped_misses"] > 0
    assert lossy_stats["bytes_read"] < h_exact.stats()["totals"]["bytes_read"]
    print(f"token agreement with exact output: {agree}/16")
    h_exact.close()
    h_lossy.close()
