"""Admission: a decode token's miss that the default policy declines to keep (a one-off expert
against a popular victim) is read into a scratch buffer for that token and computed from there;
the logits stay bitwise stock's, and the engine misses what the simulator misses."""

from __future__ import annotations

import numpy as np
import pytest

from exactness import assert_same_logits, load_replayed_pair, prompt_ids
from expert_stream.streaming.cache import ExpertCache
from expert_stream.streaming.lab.policy_sim import simulate_layer
from expert_stream.streaming.policy import make_policy
from expert_stream.streaming.traces import RoutingTrace


def skewed_trace(num_experts: int, top_k: int, rows: int, layers: int = 2, seed: int = 3) -> RoutingTrace:
    """Each token: top_k - 1 experts from a small popular set, one from the long tail."""
    rng = np.random.default_rng(seed)
    popular = np.arange(top_k + 1)
    out = np.empty((rows, layers, top_k), dtype=np.int16)
    for r in range(rows):
        for layer in range(layers):
            head = rng.choice(popular, top_k - 1, replace=False)
            tail = rng.integers(top_k + 1, num_experts)
            out[r, layer] = np.append(head, tail)
    return RoutingTrace(ids=out, num_experts=num_experts, name="skewed")


@pytest.mark.parametrize("overlap", [True, False])
def test_declined_misses_compute_from_scratch_bitwise(checkpoints, overlap):
    path = checkpoints("qwen3_moe", layers=2, experts=16, top_k=4)
    trace = skewed_trace(16, 4, rows=400)
    stock, streamed, handle, _ = load_replayed_pair(path, trace, row=0, slots=6, policy="default", overlap=overlap)
    assert_same_logits(stock, streamed, prompt_ids(24), decode_steps=40, chunk=8)
    totals = handle.stats()["totals"]
    assert totals["bypassed"] > 0, totals
    assert totals["misses"] > totals["bypassed"]  # some misses were admitted too


def test_engine_cache_admits_what_the_simulator_admits():
    """ExpertCache.admitted + place over a trace: the same misses as simulate_layer."""
    trace = skewed_trace(32, 4, rows=3000, layers=1, seed=5)
    rows = np.sort(trace.ids[:, 0, :].astype(np.int64), axis=1)
    E, C = 32, 8
    sim = simulate_layer(rows, make_policy("default", E, C), C)
    cache, misses = ExpertCache(E, C, "default"), 0
    for row in rows:
        missing = cache.access(row)
        misses += missing.size
        placed = cache.admitted(missing, protected=row)
        if placed.size:
            cache.claim(cache.place(placed, protected=row))
    assert misses == sim.accesses - sim.hits
    lru = simulate_layer(rows, make_policy("lru", E, C), C)
    assert sim.hits > lru.hits  # declining one-off experts pays on this routing
