"""Eviction policies (their contract, LRU's exact order), the engine's cache against the trace
simulator, hit curves and per-layer rebalancing, and the routing-trace format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expert_stream.streaming.policy import DEFAULT, POLICIES, EvictionPolicy, LRUPolicy, make_policy
from expert_stream.streaming.lab.policy_sim import simulate, simulate_layer
from expert_stream.streaming.traces import RoutingTrace, TraceError, load_trace, save_trace
from trace_samples import SHARED_TRACES, random_rows as _random_rows, small_trace as _small_trace


# -- interface contract --------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(POLICIES))
def test_contract_direct_calls(name):
    rng = np.random.default_rng(0)
    E, C = 40, 12
    pol = make_policy(name, E, C)
    resident = rng.choice(E, C, replace=False).astype(np.int64)
    for e in resident:
        pol.on_insert(int(e))
    for step in range(300):
        ex = rng.choice(E, rng.integers(1, 5), replace=False).astype(np.int64)
        pol.on_access(ex, step)
        protected = np.isin(resident, ex) | (rng.random(C) < 0.2)
        free = int((~protected).sum())
        if free == 0:
            continue
        count = int(rng.integers(1, free + 1))
        before = resident.copy()
        v = np.asarray(pol.choose_victims(resident, count, protected))
        assert np.array_equal(resident, before), "choose_victims must not modify its input"
        assert v.shape == (count,)
        assert len(set(v.tolist())) == count
        assert set(v.tolist()) <= set(resident[~protected].tolist())
        # evict them and bring in others (some prefetched)
        outside = np.setdiff1d(np.arange(E), resident)
        new = rng.choice(outside, count, replace=False)
        for old, nw in zip(v.tolist(), new.tolist()):
            pol.on_evict(old)
            resident[resident == old] = nw
            pol.on_insert(nw, prefetched=bool(rng.random() < 0.3))


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("E,K,C", [(16, 1, 4), (24, 4, 6), (32, 8, 8), (32, 8, 13), (10, 2, 10)])
def test_contract_in_simulator(name, E, K, C):
    rows = _random_rows(np.random.default_rng(E * 7 + K), 400, E, K)
    res = simulate_layer(rows, make_policy(name, E, C), C, check=True)
    assert 0 <= res.hits <= res.accesses == 400 * K


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_deterministic(name):
    rows = _random_rows(np.random.default_rng(3), 500, 30, 3)
    a = simulate_layer(rows, make_policy(name, 30, 8), 8)
    b = simulate_layer(rows, make_policy(name, 30, 8), 8)
    assert (a.hits, a.misses_all) == (b.hits, b.misses_all)


def test_registry():
    assert "lru" in POLICIES and "default" in POLICIES
    assert POLICIES["default"] is POLICIES[DEFAULT]
    assert isinstance(make_policy("lru", 8, 2), LRUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("nope", 8, 2)


# -- LRU exact behaviour -------------------------------------------------------------------

def _replay_victims(rows, name, E, C):
    """Simulate and record (step, victims) of every eviction."""
    pol = make_policy(name, E, C)
    log = []
    inner = pol.choose_victims

    def spy(resident, count, protected):
        v = inner(resident, count, protected)
        log.append((pol.clock, sorted(np.asarray(v).tolist())))
        return v

    pol.choose_victims = spy
    res = simulate_layer(np.asarray(rows, dtype=np.int64), pol, C, check=True)
    return res, [v for _, v in log]


def test_lru_hand_trace_top1():
    rows = [[0], [1], [2], [0], [3], [1], [4], [0], [3]]
    res, victims = _replay_victims(rows, "lru", 5, 3)
    # cache after each step: 0 | 0 1 | 0 1 2 | hit 0 | 3 evicts 1 | 1 evicts 2 | 4 evicts 0 |
    # 0 evicts 3 | 3 evicts 1
    assert victims == [[1], [2], [0], [3], [1]]
    assert res.hits == 1 and res.misses_all == 8


def test_lru_hand_trace_top2_pins_and_ties():
    # C=4, top-2. Within a call the first-listed expert is the most recent, and the call's
    # misses are more recent than its hits.
    rows = [[0, 1], [2, 3], [4, 0], [5, 6], [1, 4]]
    res, victims = _replay_victims(rows, "lru", 8, 4)
    # step 2: needs 1 slot; 0 is pinned; LRU order 1 < 3 < 2 -> evict 1
    # step 3: needs 2; cache {0,2,3,4}, recency 3 < 2 < 0 < 4 -> evict 3, 2
    # step 4: cache {0,4,5,6}; 4 hits (pinned), 1 misses and needs a slot;
    #         recency 0 < 6 < 5 -> evict 0
    assert victims == [[1], [2, 3], [0]]
    assert res.hits == 2           # 0 at step 2, 4 at step 4


# -- trace format --------------------------------------------------------------------------

def test_trace_round_trip(tmp_path):
    tr = _small_trace(step_start=np.array([0, 4, 5, 6], dtype=np.int64))
    path = save_trace(tmp_path / "tiny.npz", tr)
    back = load_trace(path)
    assert back.ids.dtype == np.int16 and np.array_equal(back.ids, tr.ids)
    assert np.array_equal(back.layer_ids, tr.layer_ids)
    assert np.array_equal(back.seq_start, tr.seq_start)
    assert np.array_equal(back.phase, tr.phase) and back.phase.dtype == np.uint8
    assert np.array_equal(back.step_start, tr.step_start)
    assert back.num_experts == 16 and back.name == "tiny" and back.meta["model"] == "test"
    side = json.loads((tmp_path / "tiny.json").read_text())
    assert side["top_k"] == 2 and side["num_layers"] == 3 and side["num_tokens"] == 30
    # same hit rates before and after
    assert simulate(tr, "lru", 0.25)["hit_rate"] == simulate(back, "lru", 0.25)["hit_rate"]
    # optional keys may be absent
    bare = RoutingTrace(ids=tr.ids)
    back2 = load_trace(save_trace(tmp_path / "bare", bare, sidecar=False))
    assert back2.phase is None and back2.seq_start is None and back2.num_experts == bare.num_experts
    assert back2.decode_mask().all()


def test_trace_request_split():
    tr = _small_trace()
    a = tr.select_requests([1])
    assert a.num_tokens == 18 and np.array_equal(a.ids, tr.ids[12:])
    assert list(a.seq_start) == [0]


@pytest.mark.parametrize("key,value,match", [
    ("ids", np.zeros((5, 2), np.int16), "3 dimensions"),
    ("ids", np.full((5, 1, 2), -1, np.int16), "negative"),
    ("ids", np.full((5, 1, 2), 0.5), "integer"),
    ("phase", np.array([0, 1, 2, 1, 1], np.uint8), "0 \\(prefill\\) or 1"),
    ("phase", np.array([0, 1], np.uint8), "one per token"),
    ("seq_start", np.array([0, 3, 2], np.int64), "strictly increasing"),
    ("seq_start", np.array([1, 3], np.int64), "start at token 0"),
    ("seq_start", np.array([0, 9], np.int64), "out of range"),
    ("layer_ids", np.array([0, 1, 2], np.int16), "one per ids column"),
])
def test_trace_validation_names_file_and_key(tmp_path, key, value, match):
    good = {"ids": np.arange(10, dtype=np.int16).reshape(5, 1, 2),
            "phase": np.ones(5, np.uint8), "seq_start": np.array([0], np.int64),
            "layer_ids": np.array([7], np.int16)}
    good[key] = value
    if key == "ids" and value.ndim == 3:
        good["phase"] = np.ones(value.shape[0], np.uint8)
    path = tmp_path / "bad.npz"
    np.savez(path, **good)
    with pytest.raises(TraceError, match=match) as err:
        load_trace(path)
    assert str(path) in str(err.value) and f"'{key}'" in str(err.value)


def test_trace_missing_ids_and_unreadable(tmp_path):
    p = tmp_path / "noids.npz"
    np.savez(p, phase=np.ones(3, np.uint8))
    with pytest.raises(TraceError, match="'ids'.*missing") as err:
        load_trace(p)
    assert str(p) in str(err.value)
    q = tmp_path / "junk.npz"
    q.write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="junk.npz"):
        load_trace(q)
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "absent.npz")
    # an id beyond num_experts from the sidecar
    r = tmp_path / "big.npz"
    np.savez(r, ids=np.full((3, 1, 1), 9, np.int16))
    (tmp_path / "big.json").write_text(json.dumps({"num_experts": 8}))
    with pytest.raises(TraceError, match="'ids'.*num_experts 8"):
        load_trace(r)


# -- the engine's cache misses what the simulator misses -------------------------------------

def _engine_misses(rows, name, E, C, order):
    """Replay rows through the engine's ExpertCache. "layer": the decode paths' order (record
    the access, then place the misses the policy admits); "placed first": every miss is placed
    before its access is recorded, as a warm start's preload does (ExpertCache's AccessOrder)."""
    from expert_stream.streaming.cache import ExpertCache

    cache, misses = ExpertCache(E, C, name), 0
    for row in rows:
        needed = np.unique(row)
        if order == "layer":
            missing = cache.access(needed)
            placed = cache.admitted(missing, protected=needed)
        else:
            missing = placed = needed[~cache.resident(needed)]
        if placed.size:
            cache.claim(cache.place(placed, protected=needed))
        if order != "layer":
            cache.access(needed)
        misses += missing.size
    return misses


def _replay_cases():
    rng = np.random.default_rng(5)
    yield "skewed random", _random_rows(rng, 1500, 32, 4), 32, 8
    path = SHARED_TRACES / "qwen15_moe_gsm8k_vllm_batched.npz"
    if path.is_file():
        tr = load_trace(path)
        yield "qwen15 layer 0", tr.ids[tr.decode_mask(), 0].astype(np.int64), 60, 15


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_engine_cache_misses_what_the_simulator_misses(name):
    for label, rows, E, C in _replay_cases():
        sim = simulate_layer(rows, make_policy(name, E, C), C).misses_all
        assert _engine_misses(rows, name, E, C, "layer") == sim, label
        if make_policy(name, E, C).admission.__func__ is not EvictionPolicy.admission:
            continue  # admission needs the access first; a preload admits every expert it places
        early = _engine_misses(rows, name, E, C, "placed first")
        # Victims chosen before the policy saw the access: only policies whose ranking of the
        # unpinned experts that access can change differ at all.
        assert abs(early - sim) <= 0.01 * sim, (label, early, sim)


# -- online per-layer budgets --------------------------------------------------------------

def test_hit_curve_is_lru_at_every_size():
    from expert_stream.streaming.budget import HitCurve

    rows = _random_rows(np.random.default_rng(8), 2000, 24, 1)
    curve = HitCurve(24, half_life=1 << 30)
    for row in rows:
        curve.record(row)
    for c in (1, 3, 6, 12, 24):
        lru = simulate_layer(rows, make_policy("lru", 24, c), c).hits
        assert curve.hist[1:c + 1].sum() == lru, c


def test_rebalance_moves_slots_to_the_steeper_curve_and_keeps_the_total():
    from expert_stream.streaming.budget import HitCurve, rebalance

    rng = np.random.default_rng(2)
    small, wide = HitCurve(32), HitCurve(32)
    for _ in range(3000):
        small.record(rng.choice(4, 1))              # 4 experts: 4 slots hold them all
        wide.record(rng.choice(32, 1))              # uniform over 32: every slot pays
    # the small layer's slots beyond its 4 experts gain nothing; it keeps exactly those 4
    assert rebalance([small, wide], [8, 8], floor=1) == [4, 12]
    same = HitCurve(32)
    same.hist[:] = wide.hist
    assert rebalance([wide, same], [8, 8], floor=1) == [8, 8], "equal curves move nothing"
    assert rebalance([small, wide], [1, 15], floor=1)[0] >= 1
