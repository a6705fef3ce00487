"""Routing replay: every MoE layer routes as a recorded trace says, stock and streamed alike, so
the two stay bitwise equal (prefill and decode, under eviction);
a trace that does not fit the model is refused with both numbers."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from exactness import assert_same_logits, load_pair, load_replayed_pair, prompt_ids
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.lab.replay import ReplayError, install
from expert_stream.streaming.traces import RoutingTrace, load_trace

from conftest import SHARED

# The shared traces sit next to the repository; EXPERT_STREAM_TRACES points elsewhere (worktrees).
TRACES = Path(os.environ.get("EXPERT_STREAM_TRACES", SHARED / "moe_traces"))
QWEN15 = TRACES / "qwen15_moe_gsm8k_vllm_batched.npz"


def random_trace(num_experts: int, top_k: int, layers: int = 2, rows: int = 200, seed: int = 1) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.permutation(num_experts)[:top_k] for _ in range(layers)] for _ in range(rows)])
    return RoutingTrace(ids=ids.astype(np.int16), num_experts=num_experts, name="random")


def _assert_engine_used_trace(handle, replay, trace):
    """After the last decode step, every streamed layer's cache was asked for exactly the
    trace's experts of the last replayed row at that layer's column."""
    last = replay.log[-1]
    assert last.tokens == 1
    for s in handle.streams:
        column = replay.columns[replay.paths.index(s.name)]
        assert sorted(s.cache.last_needed.tolist()) == sorted(trace.ids[last.row, column].tolist()), s.name


@pytest.mark.skipif(not QWEN15.is_file(), reason="shared/moe_traces not present")
def test_real_trace_stock_and_streamed_bitwise(checkpoints):
    """Qwen1.5-MoE's trace (60 experts, top-4, 5 layers) on a 3-layer model of that shape, one
    slot row more than top-k: chunked prefill and decode bitwise equal, decode missing."""
    path = checkpoints("qwen3_moe", layers=3, experts=60, top_k=4)
    trace = load_trace(QWEN15)
    stock, streamed, handle, replay = load_replayed_pair(path, trace, row=1380, slots=5)
    assert_same_logits(stock, streamed, prompt_ids(40), decode_steps=10, chunk=16)
    assert handle.stats()["totals"]["misses"] > 0
    _assert_engine_used_trace(handle, replay, trace)
    assert [f.row for f in replay.log[:4]] == [1380, 1396, 1412, 1420]  # chunks of 16, 16, 8, then decode
    assert replay.columns == [0, 1, 2]


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss", "llama4", "nemotron_h", "mixtral", "qwen3_next"])
def test_families_stock_and_streamed_bitwise(checkpoints, arch):
    """Grouped DeepSeek gates, gpt-oss routers, Llama-4's top-1 every other layer, Nemotron's
    SwitchMLP, Mixtral, Qwen3-Next: the trace's experts reach the engine, bits equal stock's."""
    path = checkpoints(arch)
    fp = checkpoint_footprint(path)
    trace = random_trace(fp.num_experts[0], fp.top_k, layers=1)  # one column, cycled
    stock, streamed, handle, replay = load_replayed_pair(path, trace, row=7)
    assert_same_logits(stock, streamed, prompt_ids(24), decode_steps=6, chunk=10)
    _assert_engine_used_trace(handle, replay, trace)
    assert set(replay.columns) == {0}


def test_other_rows_give_other_logits(checkpoints):
    """The comparison can fail: the same trace from another row routes elsewhere."""
    import mlx.core as mx

    path = checkpoints("qwen3_moe", layers=2, experts=16, top_k=4)
    trace = random_trace(16, 4)
    stock, streamed, handle, replay = load_replayed_pair(path, trace, row=0)
    replay.begin(50)
    prompt = prompt_ids(12)
    a, b = stock(prompt), streamed(prompt)
    assert not mx.array_equal(a, b).item()


def test_misfit_trace_refused_with_both_numbers(checkpoints):
    path = checkpoints("qwen3_moe", layers=2, experts=16, top_k=4)
    stock, _, _ = load_pair(path)
    with pytest.raises(ReplayError, match=r"top-2 routing.*routes each token to 4 experts"):
        install(stock, random_trace(16, 2), "qwen3_moe", 16, 4)
    with pytest.raises(ReplayError, match=r"60 experts per layer.*has 16"):
        install(stock, random_trace(60, 4), "qwen3_moe", 16, 4)


def test_batched_input_refused(checkpoints):
    """Replay maps one routed row to one token of one sequence: a batch of two is refused."""
    path = checkpoints("qwen3_moe", layers=2, experts=16, top_k=4)
    stock, _, _ = load_pair(path)
    install(stock, random_trace(16, 4), "qwen3_moe", 16, 4)
    import mlx.core as mx

    with pytest.raises(ReplayError, match=r"shape \(1, T\)"):
        stock(mx.zeros((2, 3), dtype=mx.int32))


def test_replayed_ids_wait_for_the_router():
    """The ids a layer reads back depend on its router's output (a constant would let the engine
    start its reads before the device computed the router: a lookahead real routing never has)."""
    import io

    import mlx.core as mx

    trace = random_trace(16, 4, layers=1)
    from expert_stream.streaming.lab.replay import RoutingReplay

    replay = RoutingReplay(trace, moe_layers=2)
    replay.begin(3)
    replay.start_forward(5)
    router = mx.argpartition(mx.random.normal((1, 5, 16)), kth=-4, axis=-1)[..., -4:]
    ids = replay.experts(1, "model.layers.1.mlp.switch_mlp", router)
    dot = io.StringIO()
    mx.export_to_dot(dot, ids)
    assert "ArgPartition" in dot.getvalue()
    assert ids.dtype == router.dtype and ids.shape == (1, 5, 4)
    assert (np.array(ids)[0] == trace.ids[3:8, 0]).all()


def test_layer_major_prefill_replays_each_chunk_its_own_rows(checkpoints):
    """A layer-major prefill runs its chunks' forwards side by side (each parked at every
    streamed layer): each still takes the trace rows that follow the chunk before it, so the
    prompt routes as stock's chunk-by-chunk prefill does, bitwise."""
    import importlib

    import mlx.core as mx

    generate = importlib.import_module("mlx_lm.generate")
    path = checkpoints("qwen3_moe", layers=3, experts=16, top_k=2)
    trace = random_trace(16, 2, layers=3, rows=300)
    stock, streamed, handle, replay = load_replayed_pair(path, trace, row=7, slots=4,
                                                        prefill_step=16, prefill_window=64)
    prompt = prompt_ids(50, seed=3)[0]

    def steps(model):
        out = generate.generate_step(prompt, model, max_tokens=4, prefill_step_size=16)
        return [(int(t), np.array(lp.astype(mx.float32))) for t, lp in out]

    for (a, la), (b, lb) in zip(steps(stock), steps(streamed)):
        assert a == b and np.array_equal(la, lb)
    assert handle.prefill.refusal() is None  # the prompt really prefilled layer-major
    assert [(f.row, f.tokens) for f in replay.log[:4]] == [(7, 16), (23, 16), (39, 16), (55, 1)]
