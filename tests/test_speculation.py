"""Speculative decode steps (streaming/speculation.py): a decode step runs as one graph and is
checked afterwards; a pass that met a miss is rewound, its misses read, and run again. Every
outcome must give stock's logits bitwise, over every kind of cache that can be rewound."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as kinds
from mlx_lm.models.cache import make_prompt_cache

from exactness import assert_same_logits, load_pair, prompt_ids
from expert_stream.streaming.footprint import checkpoint_footprint
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


@pytest.mark.parametrize("arch,overrides,share", CASES, ids=[c[0] for c in CASES])
def test_kept_and_failed_steps_equal_stock(checkpoints, arch, overrides, share):
    path = checkpoints(arch, overrides=overrides) if overrides else checkpoints(arch)
    stock, streamed, handle = load_pair(path, slots=slots_for(path, share))
    handle.speculation.adaptive = False  # speculate every step, whatever it costs here
    decode_side_by_side(stock, streamed)
    spec = handle.stats()["speculation"]
    assert spec["steps"] > 0, spec  # steps that ended with a kept speculative pass
    assert spec["passes_thrown"] > 0, spec  # passes rewound after a miss and rerun
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
    stock, streamed, handle = load_pair(path, slots=slots_for(path, 0.75))
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
    stock, streamed, handle = load_pair(path, slots=slots_for(path, 0.75))
    handle.speculation.adaptive = False
    caches = decode_side_by_side(stock, streamed, prompt_len=6, steps=30)
    assert any(type(c) is kinds.RotatingKVCache and c.offset > c.max_size for c in caches)
    spec = handle.stats()["speculation"]
    assert spec["not_rewindable"] > 0, spec
    handle.close()


def test_off_leaves_the_model_class_alone(checkpoints):
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, slots=slots_for(path, 0.75), speculate=False)
    assert type(streamed) is type(stock)
    assert handle.stats()["speculation"] is None
    decode_side_by_side(stock, streamed, steps=8)
    handle.close()


def test_speculating_model_looks_like_stock(checkpoints):
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, slots=slots_for(path, 0.75))
    assert isinstance(streamed, type(stock)) and type(streamed) is not type(stock)
    assert type(streamed).__name__ == type(stock).__name__
    assert type(streamed).__module__ == type(stock).__module__
    assert streamed.layers is streamed.model.layers  # attributes pass through
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
    rewind = rewind_point([kv, state], 1)
    kv.update_and_fetch(mx.full((1, 1, 1, 2), 7.0), mx.full((1, 1, 1, 2), 7.0))
    state[0] = mx.ones((1, 3))
    rewind()
    assert kv.offset == 5 and state[0] is before
    keys, _ = kv.update_and_fetch(mx.full((1, 1, 1, 2), 3.0), mx.full((1, 1, 1, 2), 3.0))
    assert keys.shape[2] == 6 and keys[0, 0, 5, 0].item() == 3.0


def test_pauses_when_it_loses(checkpoints):
    """With one token's experts per layer nearly every pass misses: speculative steps cost
    several passes plus reads, more than the layer-by-layer step timed first, so it pauses."""
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path)
    decode_side_by_side(stock, streamed, steps=10)
    spec = handle.stats()["speculation"]
    assert spec["layered"] >= 1 and spec["t_layer_by_layer"] is not None  # the first step explores
    assert spec["paused"] >= 1, spec
    handle.close()
