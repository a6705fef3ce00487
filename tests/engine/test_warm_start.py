"""Routing traces recorded from a running model, warm start from them, and per-layer budgets
spread by measured hit curves."""

from __future__ import annotations

import numpy as np
import pytest

import expert_stream
from exactness import assert_same_logits, load_pair, prompt_ids
from expert_stream.streaming.cache import ExpertCache
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.traces import RoutingTrace, load_trace, save_trace
from expert_stream.streaming.warm_start import lru_hit_curve, slots_from_curves


def test_hit_curve_matches_the_lru_cache(tmp_path):
    rng = np.random.default_rng(0)
    weights = 1.0 / np.arange(1, 65)  # skewed popularity, as real routing is
    ids = np.stack([rng.choice(64, 4, replace=False, p=weights / weights.sum()) for _ in range(600)])
    curve = lru_hit_curve(ids, 64)
    for capacity in (4, 8, 16, 32):
        cache = ExpertCache(64, capacity, policy="lru")
        hits = 0
        for experts in ids:
            needed = np.unique(experts)
            missing = cache.access(needed)
            hits += needed.size - missing.size
            if missing.size:
                cache.claim(cache.place(missing, protected=needed))
        assert curve[capacity] == pytest.approx(hits, rel=0.01), capacity


def test_slots_follow_the_curves():
    flat = np.arange(9)  # no gain from any slot
    steep = np.array([0, 10, 20, 30, 40, 50, 60, 70, 80])  # every slot pays
    assert slots_from_curves([flat, steep], [1, 1], budget_bytes=8, floor=2) == [2, 6]
    # A layer whose experts cost twice as much gets slots only where they pay twice as well.
    assert slots_from_curves([steep, steep * 3], [1, 2], budget_bytes=12, floor=1) == [2, 5]


def test_record_then_warm_start(checkpoints, tmp_path):
    path = checkpoints("qwen3_moe", layers=3, experts=32, top_k=4)
    fp = checkpoint_footprint(path)
    model, tokenizer, handle = expert_stream.load(path, budget_gib=fp.budget_gib_for_slots(8))
    import mlx_lm

    with handle.recording() as recorder:
        mlx_lm.generate(model, tokenizer, "one two three four five six seven", max_tokens=20)
        recorder.new_sequence()
        mlx_lm.generate(model, tokenizer, "alpha beta gamma delta", max_tokens=20)
    trace = recorder.trace(meta={"model": str(path)})
    handle.close()
    assert trace.ids.shape[1:] == (3, 4)
    assert list(trace.layer_ids) == [0, 1, 2]
    assert set(np.unique(trace.phase)) == {0, 1} and len(trace.seq_start) == 2
    trace_path = save_trace(tmp_path / "routing.npz", trace)
    assert load_trace(trace_path).ids.shape == trace.ids.shape

    stock, streamed, warm = load_pair(path, slots=8, warm_start=str(trace_path))
    assert warm.warm_start_bytes > 0
    for s, column in zip(warm.streams, range(3)):
        uses = np.bincount(trace.ids[:, column].reshape(-1), minlength=32)
        held = s.cache.expert_in[s.cache.expert_in >= 0]
        assert uses[held].sum() >= np.sort(uses)[-held.size:].sum() * 0.99  # the most used ones
    slots = [s.cache.num_slots for s in warm.streams]
    assert sum(slots) <= 3 * 8 + 1 and min(slots) >= 4
    assert_same_logits(stock, streamed, prompt_ids(30), decode_steps=8)
    warm.close()


def test_warm_start_from_another_model_is_ignored(checkpoints, tmp_path):
    path = checkpoints("qwen3_moe", layers=3, experts=32, top_k=4)
    ids = np.arange(4 * 2 * 4, dtype=np.int16).reshape(4, 2, 4) % 32
    other = save_trace(
        tmp_path / "other.npz",
        RoutingTrace(ids=ids, layer_ids=np.array([10, 11], dtype=np.int16), num_experts=32),
    )
    fp = checkpoint_footprint(path)
    _, _, handle = expert_stream.load(path, budget_gib=fp.budget_gib_for_slots(8), warm_start=str(other))
    assert handle.warm_start_bytes == 0
    handle.close()
