"""Speculative decode steps (streaming/speculation.py): a decode step runs as one graph and is
checked afterwards; a pass that met a miss is rewound, its misses read, and run again. Every
outcome must give stock's logits bitwise, over every kind of cache that can be rewound."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import cache as kinds
from mlx_lm.models.cache import make_prompt_cache

from exactness import assert_same_logits, load_pair, prompt_ids
from expert_stream.streaming import layer_replay, speculation
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.pass_checks import MissFound, PassChecks
from expert_stream.streaming.rewind import rewind_point


def decode_side_by_side(stock, streamed, prompt_len=20, steps=40, seed=1):
    """Prefill, then greedy decode; every step's logits must be bitwise equal."""
    return assert_same_logits(stock, streamed, prompt_ids(prompt_len, seed=seed), decode_steps=steps)


def slots_for(path, share):
    fp = checkpoint_footprint(path)
    return max(fp.top_k, int(share * fp.num_experts[0]))


# (arch, synth overrides, share of experts in the cache): caches of every kind the rewind knows.
CASES = [
    ("qwen3_moe", {}, 0.75),  # KVCache
    ("lfm2_moe", {}, 0.6),  # ArraysCache (short convolutions) and KVCache
    ("llama4", {"attention_chunk_size": 16}, 0.6),  # ChunkedKVCache, starting new chunks
    ("deepseek_v3", {}, 0.75),  # MLA's KVCache
]


@pytest.mark.parametrize("check_every", [1, 0], ids=["checked-per-layer", "checked-at-end"])
@pytest.mark.parametrize("arch,overrides,share", CASES, ids=[c[0] for c in CASES])
def test_kept_and_failed_steps_equal_stock(checkpoints, arch, overrides, share, check_every):
    """Passes checked after every streamed layer end at the first group that missed (cut
    short, before later layers are built: five layers, so that some are never reached);
    passes checked at their end run whole."""
    path = checkpoints(arch, layers=5, overrides=overrides) if overrides else checkpoints(arch, layers=5)
    stock, streamed, handle = load_pair(path, slots=slots_for(path, share), speculate=True)
    handle.speculation.adaptive = False  # speculate every step, whatever it costs here
    handle.speculation.checks.every = check_every
    decode_side_by_side(stock, streamed)
    spec = handle.stats()["speculation"]
    assert spec["steps"] > 0, spec  # steps that ended with a kept speculative pass
    assert spec["passes_thrown"] > 0, spec  # passes rewound after a miss and rerun
    assert spec["layers_replayed"] > 0, spec  # reruns that started above the first layer
    if check_every:
        assert spec["passes_cut"] > 0, spec
    else:
        assert spec["passes_cut"] == 0, spec
    handle.close()


def test_misses_found_by_a_thrown_away_pass_count_as_misses(checkpoints):
    """Speculation changes how misses are found, not what the counters say: the same run layer
    by layer reads the same experts for the first steps (same policy, same routing)."""
    path = checkpoints("qwen3_moe")
    totals = []
    for speculate in (True, False):
        stock, streamed, handle = load_pair(path, slots=slots_for(path, 0.75), speculate=speculate)
        if speculate:
            handle.speculation.adaptive = False
        decode_side_by_side(stock, streamed, steps=1)
        t = handle.stats()["totals"]
        totals.append((t["hits"] + t["misses"], t["misses"]))
        handle.close()
    assert totals[0] == totals[1]
    assert totals[0][1] > 0


def test_kept_step_takes_no_layer_sync(checkpoints):
    """After a kept step every streamed layer ran the speculative path and counted its hits."""
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, slots=slots_for(path, 0.75), speculate=True)
    handle.speculation.adaptive = False
    decode_side_by_side(stock, streamed, steps=24)
    before = handle.stats()
    kept = before["speculation"]["steps"]
    # Repeat the last routing until a step is kept (decode of a random model settles fast).
    cache = make_prompt_cache(streamed)
    streamed(prompt_ids(8, seed=2), cache=cache)
    token = mx.array([[5]])
    for _ in range(12):
        streamed(token, cache=cache)
    after = handle.stats()
    assert after["speculation"]["steps"] > kept
    assert {s.last_path for s in handle.streams} == {"speculated"}
    assert after["totals"]["hits"] > before["totals"]["hits"]
    handle.close()


def test_sliding_window_past_its_size_is_not_speculated(checkpoints):
    """gpt_oss with a 16-token window: once a step would wrap the rotating cache it cannot be
    rewound, so it runs layer by layer; before that it may be speculated. Exact throughout."""
    path = checkpoints("gpt_oss", overrides={"sliding_window": 16})
    stock, streamed, handle = load_pair(path, slots=slots_for(path, 0.75), speculate=True)
    handle.speculation.adaptive = False
    caches = decode_side_by_side(stock, streamed, prompt_len=6, steps=30)
    assert any(type(c) is kinds.RotatingKVCache and c.offset > c.max_size for c in caches)
    spec = handle.stats()["speculation"]
    assert spec["not_rewindable"] > 0, spec
    handle.close()


def test_off_leaves_the_model_class_alone(checkpoints):
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, slots=slots_for(path, 0.75))  # off by default
    assert type(streamed) is type(stock)
    assert handle.stats()["speculation"] is None
    decode_side_by_side(stock, streamed, steps=8)
    handle.close()


def test_speculating_model_looks_like_stock(checkpoints):
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, slots=slots_for(path, 0.75), speculate=True)
    assert isinstance(streamed, type(stock)) and type(streamed) is not type(stock)
    assert type(streamed).__name__ == type(stock).__name__
    assert type(streamed).__module__ == type(stock).__module__
    assert streamed.model is streamed["model"]  # attributes pass through
    handle.close()


def test_rewind_refuses_what_it_cannot_restore():
    batched = kinds.BatchKVCache([0, 2])
    assert rewind_point([batched], 1) is None
    padded = kinds.ArraysCache(2, left_padding=[1, 0])
    assert rewind_point([padded], 1) is None
    rotating = kinds.RotatingKVCache(max_size=4)
    rotating.update_and_fetch(mx.zeros((1, 1, 3, 2)), mx.zeros((1, 1, 3, 2)))
    assert rewind_point([rotating], 1) is None  # the step would fill the window
    assert rewind_point([kinds.CacheList(kinds.KVCache(), padded)], 1) is None
    assert rewind_point(None, 1) is None


def test_rewind_restores_offsets_and_state():
    kv = kinds.KVCache()
    kv.update_and_fetch(mx.ones((1, 1, 5, 2)), mx.ones((1, 1, 5, 2)))
    state = kinds.ArraysCache(1)
    state[0] = mx.zeros((1, 3))
    before = state[0]
    not_reached = kinds.KVCache()  # the layer of a pass cut short before it
    not_reached.update_and_fetch(mx.ones((1, 1, 5, 2)), mx.ones((1, 1, 5, 2)))
    rewind = rewind_point([kv, state, not_reached], 1)
    kv.update_and_fetch(mx.full((1, 1, 1, 2), 7.0), mx.full((1, 1, 1, 2), 7.0))
    state[0] = mx.ones((1, 3))
    rewind()
    assert kv.offset == 5 and state[0] is before and not_reached.offset == 5
    keys, _ = kv.update_and_fetch(mx.full((1, 1, 1, 2), 3.0), mx.full((1, 1, 1, 2), 3.0))
    assert keys.shape[2] == 6 and keys[0, 0, 5, 0].item() == 3.0


@pytest.mark.parametrize("layered_seconds, pauses", [(0.0, True), (1e9, False)])
def test_pauses_only_when_it_loses(checkpoints, layered_seconds, pauses):
    """Judged over JUDGE_AFTER speculative steps against the layer-by-layer time (here made
    free, or endless), speculation pauses for PAUSE_STEPS steps, or keeps going."""
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, speculate=True)
    spec = handle.speculation
    timed = spec._time
    spec._time = lambda which, s: timed(which, layered_seconds if which == "layer_by_layer" else s)
    decode_side_by_side(stock, streamed, steps=1 + speculation.JUDGE_AFTER + 3)
    st = handle.stats()["speculation"]
    assert st["t_layer_by_layer"] == layered_seconds  # the first step explored
    if pauses:
        assert st["paused"] == 1 and st["layered"] == 1 + 3, st
    else:
        assert st["paused"] == 0 and st["layered"] == 1, st
    handle.close()


class _Layer(nn.Module):
    """A decoder layer that appends its input to its KV cache and adds its number."""

    def __init__(self, number):
        super().__init__()
        self.number = number

    def __call__(self, x, mask=None, cache=None):
        cache.update_and_fetch(x, x)
        return x + self.number


class _Stream:
    pass


def _replay_over(layers, streams_at):
    replay = layer_replay.StepReplay(layers, {s: i for i, s in streams_at.items()})
    for i, layer in enumerate(layers):
        layer_replay._wrap(layer, replay, i)
    return replay


def test_replay_gives_recorded_outputs_and_cache_states():
    layers = [_Layer(i) for i in range(3)]
    streams = {i: _Stream() for i in range(3)}
    replay = _replay_over(layers, streams)
    caches = [kinds.KVCache() for _ in layers]
    x = mx.ones((1, 1, 1, 2))

    def forward():
        h = x
        for layer, c in zip(layers, caches):
            h = layer(h, None, c)
        return h

    rewind = rewind_point(caches, 1)
    replay.start_step()
    replay.start_pass(0)
    replay.active = True
    first = forward()
    assert replay.first_missed_layer([streams[2], streams[1]], caches) == 1
    rewind()
    assert [c.offset for c in caches] == [0, 0, 0]
    replay.start_pass(2)
    layers[0].number = layers[1].number = 100  # replayed layers do not compute
    second = forward()
    replay.active = False
    assert mx.array_equal(first, second).item()
    assert [c.offset for c in caches] == [1, 1, 1]  # replayed layers' caches put forward again


def test_replay_refuses_models_of_another_shape():
    layers = [_Layer(i) for i in range(2)]
    streams = {i: _Stream() for i in range(2)}
    replay = _replay_over(layers, streams)
    shared = kinds.KVCache()
    x = mx.ones((1, 1, 1, 2))
    replay.start_step()
    replay.start_pass(0)
    replay.active = True
    for layer in layers:  # one cache given to both layers
        layer(x, None, shared)
    assert replay.first_missed_layer([streams[1]], [shared, shared]) == 0
    replay.start_pass(0)
    caches = [kinds.KVCache() for _ in layers]
    layers[0](x, None, caches[0])  # a layer skipped
    assert replay.first_missed_layer([streams[1]], caches) == 0
    replay.start_pass(0)
    for layer, c in zip(layers, caches):
        layer(x, None, c)
    assert replay.first_missed_layer([streams[1]], caches + [kinds.KVCache()]) == 0  # a cache no layer got
    assert replay.first_missed_layer([streams[1]], caches) == 1


def test_replay_after_a_pass_cut_short():
    """A pass that ended early is replayed as far as it got, once a complete pass showed the
    model has the shape replay needs."""
    layers = [_Layer(i) for i in range(3)]
    streams = {i: _Stream() for i in range(3)}
    replay = _replay_over(layers, streams)
    caches = [kinds.KVCache() for _ in layers]
    x = mx.ones((1, 1, 1, 2))
    replay.start_step()
    replay.active = True

    def cut_after(n):
        replay.start_pass(0)
        h = x
        for layer, c in zip(layers[:n], caches):
            h = layer(h, None, c)

    cut_after(2)
    assert replay.first_missed_layer([streams[1]], caches, complete=False) == 0  # shape unknown
    cut_after(3)
    assert replay.first_missed_layer([streams[1]], caches) == 1
    cut_after(2)
    assert replay.first_missed_layer([streams[1]], caches, complete=False) == 1
    assert replay.first_missed_layer([streams[1]], caches[:1], complete=False) == 0  # a cache not the model's


class _Cache:
    def __init__(self, resident):
        self._resident = np.array(resident)

    def resident(self, ids):
        return np.isin(ids, self._resident)


class _Routed:
    """A streamed layer as the checks see it: its cache and the routing it left."""

    def __init__(self, resident):
        self.cache = _Cache(resident)
        self.speculated_ids = None


def test_checks_cut_a_pass_at_the_group_after_a_miss():
    """Groups of one layer: layer 0 misses expert 3; the check at layer 1 ends the pass. Layer
    1, in flight when it ended, names expert 5 as a likely miss; layer 2 is never built."""
    checks = PassChecks(1)
    layers = [_Routed([1, 2]), _Routed([2]), _Routed([])]
    routes = [[1, 3], [2, 5], [7, 8]]
    checks.start()
    layers[0].speculated_ids = mx.array(routes[0])
    checks.computed(layers[0], mx.zeros(1))
    layers[1].speculated_ids = mx.array(routes[1])
    with pytest.raises(MissFound):
        checks.computed(layers[1], mx.zeros(1))
    likely = checks.likely_misses()
    assert list(likely) == [layers[1]] and likely[layers[1]][1].tolist() == [5]
    needed, absent = checks.finish()  # nothing more to read after a cut
    assert {s: n.tolist() for s, n in needed.items()} == {layers[0]: [1, 3]}
    assert {s: a.tolist() for s, a in absent.items()} == {layers[0]: [3]}
    assert checks.likely_misses() == {}  # read once


def test_checks_without_a_miss_read_everything_at_the_end():
    checks = PassChecks(2)
    layers = [_Routed([1, 2, 3]) for _ in range(5)]
    checks.start()
    for layer in layers:
        layer.speculated_ids = mx.array([1, 3])
        checks.computed(layer, mx.zeros(1))
    needed, absent = checks.finish()
    assert set(needed) == set(layers) and absent == {}
    assert checks.likely_misses() == {}
