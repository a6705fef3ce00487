"""Each quantized expert call of a streamed layer takes the kernel that stock's call takes, under
the kernel-choice rules of Metal and CUDA (streaming/kernel_match.py).

The CPU computes every row the same way whatever the call's shape, so bits alone cannot show a
wrong kernel here (on CUDA they did: `git show d62b5b5:tests/gpu/probe_rows.py`). These tests run on the CPU with
the streamed layers told they are on Metal or CUDA, record every gather_qmm call's shape, and
check that for each forward call the set of kernels the streamed model's calls take is the one
stock's calls take; logits stay bitwise equal on the CPU meanwhile."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from exactness import load_pair, prompt_ids
from expert_stream.streaming import kernel_match
from expert_stream.streaming.kernel_match import RowPlan, kernel, plan_rows

EXPERTS, TOP_K = 32, 8
CHUNKS = (3, 10, 24, 40)  # prompt tokens per prefill call: 24 .. 320 (token, expert) pairs


def test_rules():
    assert kernel("cuda", 7, 128, True) == "vector" and kernel("cuda", 8, 8, False) == "matmul"
    assert kernel("metal", 512, 128, True) == "rhs"
    assert kernel("metal", 511, 128, True) == "vector" and kernel("metal", 512, 128, False) == "vector"
    assert kernel("metal", 15, 2, True) == "vector" and kernel("cpu", 1, 1, True) == "any"


def test_plans():
    # CUDA: stock's 16-token chunk runs the matmul kernel; a group of 3 rows must be padded.
    assert plan_rows("cuda", 128, 128, 8, True) == RowPlan(min_rows=8)
    assert plan_rows("cuda", 4, 128, 8, False) == RowPlan(max_rows=7)
    # Metal: stock (512 rows, 128 experts) runs rhs; against an 8-expert scratch buffer a call
    # needs 32 rows to run it too.
    assert plan_rows("metal", 512, 128, 8, True) == RowPlan(min_rows=32)
    # Stock (128 rows, 128 experts) runs the vector kernel; against 16 slots 64 rows would
    # already run rhs, so calls stay below 64 rows.
    plan = plan_rows("metal", 128, 128, 16, True)
    assert plan == RowPlan(max_rows=63) and not plan.whole(128) and plan.whole(63)
    assert plan_rows("metal", 128, 128, 16, False) == RowPlan()  # unsorted: never rhs
    assert plan_rows("cuda", 128, 128, 8, True, quantized=False) == RowPlan()
    assert plan_rows("cpu", 128, 128, 8, True) == RowPlan()


class KernelSpy:
    """Records the kernel family each gather_qmm call would take on `backend`."""

    def __init__(self, backend: str):
        self.backend = backend
        self.seen: set[str] = set()
        self.calls = 0
        self._real = mx.gather_qmm

    def __call__(self, x, w, *args, rhs_indices=None, sorted_indices=False, **kwargs):
        self.calls += 1
        self.seen.add(kernel(self.backend, int(rhs_indices.size), int(w.shape[0]), bool(sorted_indices)))
        return self._real(x, w, *args, rhs_indices=rhs_indices, sorted_indices=sorted_indices, **kwargs)

    def take(self) -> set[str]:
        seen, self.seen = self.seen, set()
        return seen


def _kernels_per_call(checkpoints, monkeypatch, backend, slots):
    """[(what, stock kernels, streamed kernels)] over chunked prefill then decode."""
    monkeypatch.setattr(kernel_match, "current_backend", lambda: backend)
    path = checkpoints("qwen3_moe", experts=EXPERTS, top_k=TOP_K, layers=2)
    stock, streamed, handle = load_pair(path, slots=slots, prefetch=False)
    spy = KernelSpy(backend)
    monkeypatch.setattr(mx, "gather_qmm", spy)
    c1, c2 = make_prompt_cache(stock), make_prompt_cache(streamed)
    prompt = prompt_ids(sum(CHUNKS) + 1, seed=3)
    found, a = [], None
    ends = np.cumsum(CHUNKS)
    calls = [prompt[:, end - n : end] for n, end in zip(CHUNKS, ends)]
    for i, part in enumerate(calls + [None] * 6):
        if part is None:  # greedy decode
            part = mx.argmax(a[:, -1:], axis=-1)
        a = stock(part, cache=c1)
        mx.eval(a)
        want = spy.take()
        b = streamed(part, cache=c2)
        mx.eval(b)
        got = spy.take()
        assert mx.array_equal(a, b).item(), f"call {i}: logits differ"
        found.append((f"call {i} ({part.shape[1]} tokens)", want, got))
    paths = handle.stats()["totals"]
    handle.close()
    return found, paths


@pytest.mark.parametrize("backend, slots", [("cuda", TOP_K), ("metal", TOP_K), ("metal", 16)])
def test_streamed_calls_take_stocks_kernel(checkpoints, monkeypatch, backend, slots):
    found, totals = _kernels_per_call(checkpoints, monkeypatch, backend, slots)
    assert totals["sweep_calls"] > 0 and totals["misses"] > 0
    for what, want, got in found:
        assert got == want, f"{backend}, {slots} slots, {what}: stock ran {want}, streamed {got}"


@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_unshaped_calls_would_take_other_kernels(checkpoints, monkeypatch, backend):
    """The control: with every call left as it comes, some forward call takes a kernel stock
    does not (so the test above can fail)."""
    monkeypatch.setattr(kernel_match, "plan_rows", lambda *a, **k: RowPlan())
    found, _ = _kernels_per_call(checkpoints, monkeypatch, backend, TOP_K)
    assert any(got != want for _, want, got in found)


def test_padding_and_splitting_keep_bits(checkpoints):
    """Rows computed in padded or split calls equal the same rows of one call (CPU)."""
    from mlx_lm.utils import load_model

    from expert_stream.streaming.expert_calls import call_pairs, token_rows

    model, _ = load_model(checkpoints("qwen3_moe", experts=EXPERTS, top_k=TOP_K, layers=2))
    block = model.layers[0].mlp
    x = mx.array(np.random.default_rng(0).standard_normal((1, 12, model.args.hidden_size)).astype(np.float32))
    ids = np.array(mx.argpartition(-block.gate(x), kth=TOP_K - 1, axis=-1)[..., :TOP_K])
    flat = ids.reshape(-1)
    pos = np.arange(flat.size)
    rows = token_rows(x)
    whole, order = call_pairs(block.switch_mlp, rows, pos, flat, TOP_K, True, RowPlan())
    for plan in (RowPlan(max_rows=5), RowPlan(max_rows=7, min_rows=16), RowPlan(min_rows=200)):
        ys, ps = call_pairs(block.switch_mlp, rows, pos, flat, TOP_K, True, plan)
        assert np.array_equal(np.concatenate(ps), order[0])
        assert mx.array_equal(mx.concatenate(ys), whole[0]).item(), plan


def test_whole_call_on_fewer_slots_is_split_on_metal(checkpoints, monkeypatch):
    """12 tokens routed among 8 experts: 96 sorted pairs, all in the layer's 16 slots. Stock (32
    experts: 3 pairs per expert) runs Metal's vector kernel; one call on 16 slots would run rhs,
    so the layer splits it into calls below 64 pairs."""
    from expert_stream.streaming.streamed_switch import StreamedSwitch

    monkeypatch.setattr(kernel_match, "current_backend", lambda: "metal")
    path = checkpoints("qwen3_moe", experts=EXPERTS, top_k=TOP_K, layers=2)
    stock, streamed, handle = load_pair(path, slots=16, prefetch=False)
    layer = next(m for _, m in streamed.named_modules() if isinstance(m, StreamedSwitch))
    stock_block = stock.layers[int(layer.store.name.split(".")[-3])].mlp.switch_mlp
    rng = np.random.default_rng(1)
    x = mx.array(rng.standard_normal((1, 12, stock.args.hidden_size)).astype(np.float32))
    indices = mx.array(np.stack([rng.permutation(TOP_K) for _ in range(12)])[None].astype(np.uint32))
    spy = KernelSpy("metal")
    monkeypatch.setattr(mx, "gather_qmm", spy)
    want = stock_block(x, indices)
    mx.eval(want)
    assert spy.take() == {"vector"}
    for _ in range(2):  # the first call reads the experts, the second finds them resident
        got = layer(x, indices)
        mx.eval(got)
        assert spy.take() == {"vector"} and layer.path_taken is layer.layered
        assert mx.array_equal(got, want).item()
    handle.close()
