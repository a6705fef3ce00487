"""Streamed logits are bitwise equal to stock mlx-lm, for every synthetic architecture and
quantization, with a budget of one token's experts per layer (constant eviction), for a batched
prefill long enough to take stock's sorted path and for greedy decode."""

from __future__ import annotations

import pytest

import mlx.core as mx

from exactness import assert_same_logits, load_pair, prompt_ids
from expert_stream.streaming.lab.synthetic import PRESETS

# (arch, synth options), every preset: a family the installed mlx-lm lacks is skipped, naming
# the version it needs. Default quantization is each family's usual export (4-bit affine;
# mxfp4 with expert biases for gpt_oss).
CASES = [(arch, {}) for arch in PRESETS] + [
    ("qwen3_moe", {"bits": 8}),
    ("qwen3_moe", {"bits": 0}),
    ("qwen3_moe", {"layers": 4, "mixed_bits": "1:8,3:8"}),
    ("qwen3_moe", {"dtype": "bfloat16"}),
    ("qwen3_moe", {"bits": 3, "group_size": 32}),
    ("qwen3_5_moe", {"vlm_layout": True}),
    ("kimi_k3", {"vlm_layout": True}),
    ("minimax_m3_vl", {"vlm_layout": True}),
    ("gemma4_text", {"vlm_layout": True}),  # Gemma 4's multimodal export (model_type gemma4)
    ("prism_hadamard_qwen35", {"vlm_layout": True}),  # Bonsai 2's packs carry the vision tower
    ("deepseek_v41", {"bits": 8}),
]


def skip_unless_runs_here(arch: str) -> None:
    """Skip, with the reason, a family this mlx-lm or this backend cannot run."""
    preset = PRESETS[arch]
    reason = preset.unavailable_reason()
    if reason:
        pytest.skip(reason)
    if preset.metal_only and not mx.metal.is_available():
        pytest.skip(f"{arch}: stock mlx-lm runs its attention through Metal-only kernels; no Metal here")


def _id(case):
    arch, opts = case
    return arch + "".join(f"-{k}={v}" for k, v in opts.items())


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_streamed_logits_equal_stock(checkpoints, case):
    arch, opts = case
    skip_unless_runs_here(arch)
    path = checkpoints(arch, **opts)
    stock, streamed, handle = load_pair(path)
    # 48 tokens x top_k >= 64 pairs: stock sorts; more experts than slots: the prefill sweep runs.
    assert_same_logits(stock, streamed, prompt_ids(48), decode_steps=6)
    totals = handle.stats()["totals"]
    assert totals["evictions"] > 0 and totals["sweep_calls"] > 0
    handle.close()


def test_chunked_prefill_and_more_slots(checkpoints):
    """Prefill in chunks (as mlx_lm.generate does) with a cache of a few tokens' experts."""
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, slots=10)
    assert_same_logits(stock, streamed, prompt_ids(70, seed=3), decode_steps=10, chunk=32)
    handle.close()


def test_greedy_generation_identical(checkpoints):
    import mlx_lm

    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path)
    _, tokenizer = mlx_lm.load(str(path), lazy=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    a = mlx_lm.generate(stock, tokenizer, prompt, max_tokens=24)
    b = mlx_lm.generate(streamed, tokenizer, prompt, max_tokens=24)
    assert a == b and len(a) > 0
    handle.close()


@pytest.mark.parametrize("slot_write", ["staged", "copy"])
def test_staged_slot_writes_are_exact(checkpoints, slot_write):
    """The staging paths (CUDA's default, and the portable MLX scatter)."""
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, slots=6, slot_write=slot_write)
    assert_same_logits(stock, streamed, prompt_ids(48, seed=7), decode_steps=10)
    handle.close()
