"""The native decode path's eviction (native/resolve.cpp) decides as the Python path's cache does
(streaming/cache.py with the policy objects of streaming/policy.py), call by call: the same
experts resident, the same misses and evictions, and the policy's own arrays bitwise equal
after the run, for LRU and for the default panel, and the hit curve online budgets read (every miss admitted: the native path has no
scratch for a declined one). The routing drifts between a recency phase and a popularity
phase so that the default's leading member changes."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from expert_stream.streaming import native_check, native_decode
from expert_stream.streaming.budget import HitCurve
from expert_stream.streaming.cache import EMPTY, ExpertCache
from expert_stream.streaming.policy import AccessOrder, AdaptivePolicy, LRUPolicy

EXPERTS, SLOTS, TOP_K, ROW = 32, 8, 4, 16  # ROW bytes of one expert (four float32)


class AdmitAll(AdaptivePolicy):
    """The default panel deciding as the native path does: every miss takes a slot."""

    def admission(self, candidates, victims):
        return candidates, victims


def drifting_routing(calls: int, seed: int = 0) -> list[np.ndarray]:
    """Top-k ids a call: stretches reusing the last call's experts, then stretches of draws from
    a skewed popularity, so recency and counts each lead for a while."""
    rng = np.random.default_rng(seed)
    popular = rng.permutation(EXPERTS)
    weights = 1.0 / np.arange(1, EXPERTS + 1) ** 1.2
    out, last = [], rng.choice(EXPERTS, TOP_K, replace=False)
    for t in range(calls):
        if (t // 150) % 2 == 0:  # recency: keep most of the last call's experts
            keep = last[: TOP_K - 1]
            fresh = rng.choice(np.setdiff1d(np.arange(EXPERTS), keep), 1)
            ids = np.concatenate([fresh, keep])
        else:
            ids = popular[rng.choice(EXPERTS, TOP_K, replace=False, p=weights / weights.sum())]
        out.append(ids.astype(np.uint32))
        last = ids
    return out


def python_path(cache: ExpertCache, ids: np.ndarray) -> None:
    """What the Python decode path does with a call's routing (decode_paths.LayerByLayer)."""
    needed = np.unique(ids).astype(np.int64)
    missing = cache.access(needed)
    placed = cache.admitted(missing, needed)
    if placed.size:
        cache.claim(cache.place(placed, needed))


@pytest.fixture
def rows(tmp_path):
    """A shard of EXPERTS rows, expert e's row holding the value e."""
    path = tmp_path / "rows"
    np.repeat(np.arange(EXPERTS, dtype=np.float32), ROW // 4).tofile(path)
    return path


@pytest.mark.parametrize("policy_class", [LRUPolicy, AdmitAll])
def test_native_eviction_decides_as_the_python_path(rows, policy_class):
    module, why = native_check.native_module()
    assert module is not None, why
    st = os.stat(rows)
    shards = module.Shards([str(rows)], [[st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]], False)

    reference = ExpertCache(EXPERTS, SLOTS)
    reference.policy = AccessOrder(policy_class(EXPERTS, SLOTS))
    native = ExpertCache(EXPERTS, SLOTS)
    policy = (LRUPolicy if policy_class is LRUPolicy else AdaptivePolicy)(EXPERTS, SLOTS)
    native.policy = AccessOrder(policy)
    warm = np.array([3, 5, 30])  # placed before any call, as a warm start does
    for cache in (reference, native):
        cache.claim(cache.place(warm, warm[:0]))
        cache.curve = HitCurve(EXPERTS, half_life=64)  # halved several times in the run
    state = np.zeros(4)
    counts = np.zeros(module.NUM_COUNTS, dtype=np.uint64)
    panel = native_decode.panel_of(policy, state, native.policy.take_pending(), native.curve)
    table = module.LayerTable("layer 0", native.slot_of, native.expert_in, **panel, counts=counts, row_bytes=[ROW],
                              file_of=[0] * EXPERTS, offset_of=[e * ROW for e in range(EXPERTS)], shards=shards)
    first = np.zeros((SLOTS, ROW // 4), dtype=np.float32)
    first[native.slot_of[warm]] = warm[:, None]
    slot_rows = mx.array(first)

    leaders = set()
    for ids in drifting_routing(900):
        python_path(reference, ids)
        leaders.add(getattr(reference.policy.policy, "leader", 0))
        slots, slot_rows = module.resolve(mx.array(ids), [slot_rows], table)
        got = np.array(slot_rows)[np.array(slots)][:, 0]
        assert np.array_equal(got, ids.astype(np.float32))  # each id's slot holds that expert's row
        assert np.array_equal(reference.slot_of != EMPTY, native.slot_of != EMPTY)

    native_decode._restore(policy, state, native.curve)
    ref = reference.policy.policy
    assert ref.clock == policy.clock
    curve = reference.curve
    assert np.array_equal(curve.hist, native.curve.hist) and np.array_equal(curve._stamp, native.curve._stamp)
    assert curve._calls == native.curve._calls == 900
    stats = reference.stats
    assert counts.tolist()[:4] == [stats.calls, stats.hits, stats.misses, stats.evictions]
    if policy_class is LRUPolicy:
        assert np.array_equal(ref.stamp, policy.stamp)
        return
    assert len(leaders) > 1, "the routing never moved the default's leader: the test proves nothing"
    assert np.array_equal(ref.key, policy.key) and np.array_equal(ref.points, policy.points)
    assert (ref.leader, ref._calls) == (policy.leader, policy._calls)
