"""Helpers to run a stock and a streamed model side by side and compare logits bitwise."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

import expert_stream
from expert_stream.streaming.footprint import checkpoint_footprint


def load_pair(path: Path, slots: int | None = None, **settings):
    """(stock model, streamed model, handle). `slots`: per-layer slots (default: top_k, the
    smallest budget, so experts are evicted constantly)."""
    stock, _ = load_model(Path(path))
    fp = checkpoint_footprint(path)
    budget = fp.budget_gib_for_slots(slots or fp.top_k)
    settings.setdefault("policy", "lru")
    streamed, _, handle = expert_stream.load(path, budget_gib=budget, **settings)
    return stock, streamed, handle



def load_replayed_pair(path: Path, trace, row: int, **settings):
    """`load_pair`, with every MoE layer of both models routing as `trace` says from `row` on
    (streaming/lab/replay.py). Returns (stock, streamed, handle, the streamed model's replay)."""
    from expert_stream.streaming.lab.replay import install

    stock, streamed, handle = load_pair(path, **settings)
    fp = checkpoint_footprint(path)
    replays = [install(m, trace, fp.model_type, fp.num_experts[0], fp.top_k) for m in (stock, streamed)]
    for replay in replays:
        replay.begin(row)
    return stock, streamed, handle, replays[1]

def prompt_ids(n: int, vocab: int = 500, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(3, vocab, (1, n)), dtype=mx.int32)


def assert_same_logits(stock, streamed, prompt: mx.array, decode_steps: int = 8, chunk: int | None = None):
    """Prefill `prompt` (in chunks if given) then decode greedily; every logit bitwise equal.
    Returns the streamed model's caches."""
    c1, c2 = make_prompt_cache(stock), make_prompt_cache(streamed)
    n = prompt.shape[1]
    step = chunk or n
    for start in range(0, n, step):
        part = prompt[:, start : start + step]
        a, b = stock(part, cache=c1), streamed(part, cache=c2)
        mx.eval(a, b)
        assert mx.array_equal(a, b).item(), f"prefill logits differ (tokens {start}..{start + part.shape[1]})"
    token = mx.argmax(a[:, -1:], axis=-1)
    for i in range(decode_steps):
        a, b = stock(token, cache=c1), streamed(token, cache=c2)
        mx.eval(a, b)
        assert mx.array_equal(a, b).item(), f"decode step {i}: logits differ"
        token = mx.argmax(a[:, -1:], axis=-1)
    return c2
