"""Each setting of the README's table that no other test exercises changes what the engine
does: a test per setting that fails when the setting is ignored (prefill_step through the
Python API and through the load interception both hosts use)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import expert_stream
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.traces import RoutingTrace, save_trace
from plugin_fixtures import make_moe

PROMPT = " ".join(f"word{i}" for i in range(60))  # ~60 tokens: several prefill chunks of 8


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_moe(tmp_path_factory.mktemp("settings-effects"))  # 2 layers, 8 experts, top-2


def sweeps(handle) -> int:
    return handle.stats()["totals"]["sweep_calls"]


def prefill(model, tokenizer, step_size=None):
    import mlx_lm

    kwargs = {} if step_size is None else {"prefill_step_size": step_size}
    for _ in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=1, **kwargs):
        pass


def test_prefill_step_sets_the_chunks_of_mlx_lm_generate(moe):
    # 3 of 8 slots per layer: every chunk of 8+ tokens needs more experts than that. Chunk by
    # chunk (prefill_window 0) that is one sweep a chunk; layer-major, one sweep a layer.
    counts = {}
    for step, window in ((2048, 0), (8, 0), (8, 32768)):
        model, tokenizer, handle = expert_stream.load(moe, budget_gib=0.00005, prefill_step=step,
                                                      prefill_window=window)
        prefill(model, tokenizer)
        counts[step, window] = sweeps(handle)
        handle.close()
    assert counts[2048, 0] == 2  # one chunk, one sweep in each of the 2 layers
    assert counts[8, 0] >= 2 * 6, counts
    assert counts[8, 32768] == 2, counts


def test_prefill_step_overrides_the_hosts_step_size(moe):
    """What both hosts do: mlx_lm.load through the interception, then stream_generate with the
    host's own prefill_step_size (mlx_lm.server passes its --prefill-step-size)."""
    import mlx_lm

    from expert_stream.plugin.hosts import interception

    interception.install()
    settings = expert_stream.streaming.StreamSettings(budget_gib=0.00005, prefill_step=8, prefill_window=0).to_dict()  # chunk by chunk: a sweep each
    interception.set_targets({moe: interception.Target("m", settings)})
    try:
        model, tokenizer = mlx_lm.load(str(moe))
        prefill(model, tokenizer, step_size=2048)
        assert sweeps(interception.handles()["m"]) >= 2 * 6
    finally:
        interception.set_targets({})
        interception.forget("m")


def test_prefill_step_applies_to_speculative_decoding(moe, tmp_path):
    """With a draft model stream_generate prefills through speculative_generate_step (the draft
    in the same chunks): the streamed model's prefill_step wins there too."""
    import mlx_lm
    from mlx_lm.utils import load_model

    from expert_stream.streaming.lab.synthetic.draft import make_dense_draft

    draft = load_model(make_dense_draft(moe, tmp_path / "draft"))[0]
    model, tokenizer, handle = expert_stream.load(moe, budget_gib=0.00005, prefill_step=8)
    for _ in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=1, draft_model=draft, prefill_step_size=2048):
        pass
    assert sweeps(handle) >= 2 * 6
    handle.close()


def test_reader_picks_the_backend(moe):
    for backend in ("python", "native"):
        if backend == "native":
            from expert_stream.streaming.reader import native_available

            if not native_available():
                pytest.skip("the native reader is not built here")
        _, _, handle = expert_stream.load(moe, budget_gib=0.00005, reader=backend)
        assert handle.stats()["reader"] == backend
        handle.close()


def test_reader_threads_sizes_the_reader_pool(moe):
    for threads in (1, 3):
        _, _, handle = expert_stream.load(moe, budget_gib=0.00005, reader_threads=threads)
        assert handle.reader.threads == threads
        handle.close()


def test_mlx_cache_limit_is_applied(moe):
    previous = mx.set_cache_limit(1 << 40)
    try:
        _, _, handle = expert_stream.load(moe, budget_gib=0.00005, mlx_cache_limit_gib=0.25)
        assert mx.set_cache_limit(1 << 40) == 1 << 28
        handle.close()
    finally:
        mx.set_cache_limit(previous)


def test_prefetch_per_layer_caps_the_lookahead_reads(moe):
    import mlx_lm

    reads = {}
    for per_layer in (0, 4):
        model, tokenizer, handle = expert_stream.load(moe, budget_gib=0.00005, prefetch=True,
                                                      prefetch_per_layer=per_layer)
        mlx_lm.generate(model, tokenizer, "hello there, how are you", max_tokens=12)
        reads[per_layer] = handle.stats()["totals"]["prefetch_reads"]
        handle.close()
    assert reads[0] == 0 and reads[4] > 0, reads


def test_budget_by_trace_spreads_slots_by_the_trace(moe, tmp_path):
    # Layer 0 routes all over its 8 experts, layer 1 always to the same 2: by the trace, layer 0
    # should get the slots; evenly, both get the same.
    rng = np.random.default_rng(0)
    ids = np.zeros((300, 2, 2), dtype=np.int16)
    ids[:, 0] = np.stack([rng.choice(8, 2, replace=False) for _ in range(300)])
    ids[:, 1] = [0, 1]
    trace = save_trace(tmp_path / "trace.npz", RoutingTrace(ids=ids, layer_ids=np.array([0, 1], dtype=np.int16),
                                                           num_experts=8))
    budget = checkpoint_footprint(moe).budget_gib_for_slots(5)
    slots = {}
    for by_trace in (True, False):
        _, _, handle = expert_stream.load(moe, budget_gib=budget, warm_start=str(trace), budget_by_trace=by_trace,
                                          resident=False)
        slots[by_trace] = [s.cache.num_slots for s in handle.streams]
        handle.close()
    assert slots[False] == [5, 5]
    assert slots[True][0] > slots[True][1], slots


def test_policy_picks_the_eviction_policy(moe):
    from expert_stream.streaming.policy import make_policy

    kinds = {}
    for name in ("lru", "default"):
        _, _, handle = expert_stream.load(moe, budget_gib=0.00005, policy=name)
        kinds[name] = {type(getattr(s.cache.policy, "policy", s.cache.policy)) for s in handle.streams}
        handle.close()
    assert kinds["lru"] == {type(make_policy("lru", 8, 3))} != kinds["default"]


def test_prefetch_off_links_no_lookahead(moe):
    for prefetch in (True, False):
        _, _, handle = expert_stream.load(moe, budget_gib=0.00005, prefetch=prefetch)
        assert bool(handle.layers[0].lookaheads) is prefetch
        handle.close()


def test_cache_bypass_mode_reaches_the_reader(moe):
    used = {}
    for mode in ("none", "fadvise"):
        _, _, handle = expert_stream.load(moe, budget_gib=0.00005, cache_bypass=mode)
        used[mode] = handle.stats()["cache_bypass"]
        handle.close()
    assert used["none"] == "none" and used["fadvise"] in ("fadvise", "none"), used
