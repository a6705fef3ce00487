"""Speculative decoding with a draft model (mlx-lm's speculative_generate_step): the main model
checks num_draft + 1 tokens in one forward and the KV caches are trimmed back after a rejection.
With a streamed main model every token, log-probability vector and accept/reject decision is
bitwise what stock mlx-lm gives with the same draft, under constant eviction (the verify pass
through the layer-by-layer path and, where it needs more experts than slots, the sweep)."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import speculative_generate_step
from mlx_lm.utils import load_model

from exactness import load_pair, prompt_ids
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.lab.synthetic.draft import make_dense_draft, make_truncated_draft

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
TINY = Path(os.environ.get("EXPERT_STREAM_MODELS", SHARED / "models")) / "tiny-code-moe"


def speculate(model, draft, prompt: mx.array, tokens: int, num_draft: int) -> list:
    return [(int(t), lp, bool(from_draft)) for t, lp, from_draft in
            speculative_generate_step(prompt, model, draft, num_draft_tokens=num_draft, max_tokens=tokens,
                                      prefill_step_size=16)]


def assert_same_speculation(stock_run: list, streamed_run: list) -> None:
    assert len(stock_run) == len(streamed_run)
    for i, ((t1, lp1, d1), (t2, lp2, d2)) in enumerate(zip(stock_run, streamed_run)):
        assert (t1, d1) == (t2, d2), f"token {i}: stock {t1} (draft {d1}), streamed {t2} (draft {d2})"
        assert mx.array_equal(lp1, lp2).item(), f"token {i}: log-probabilities differ"


@pytest.mark.parametrize("slots", [None, 20], ids=["one-token-of-slots", "a-verify-pass-of-slots"])
def test_speculative_decode_equals_stock(checkpoints, tmp_path, slots):
    path = checkpoints("qwen3_moe", layers=3, experts=32)
    stock, streamed, handle = load_pair(path, slots=slots)
    dense = load_model(make_dense_draft(path, tmp_path / "draft"))[0]
    prompt = prompt_ids(21)[0]
    before = handle.stats()["totals"]
    # A random dense draft: its tokens are rejected (one token per verify pass). The stock main
    # model as its own draft: accepted (num_draft + 1 tokens per pass).
    for draft, label in ((dense, "dense draft"), (stock, "self draft")):
        stock_run = speculate(stock, draft, prompt, 12, 3)
        streamed_run = speculate(streamed, draft, prompt, 12, 3)
        assert_same_speculation(stock_run, streamed_run)
        accepted = sum(d for _, _, d in streamed_run)
        if label == "self draft":
            assert accepted >= 6, f"{label}: {accepted} of 12 tokens accepted"
    totals = handle.stats()["totals"]
    assert totals["resident_calls"] == 0 and totals["misses"] > before["misses"]
    if slots is None:  # a pass of 4 tokens needs more experts than one token's slots
        assert totals["sweep_calls"] > 0
    else:  # 4 tokens x top-4 fit 20 slots: the verify passes go layer by layer
        assert totals["calls"] > totals["sweep_calls"]


@pytest.mark.skipif(not TINY.is_dir(), reason=f"trained fixture absent ({TINY}); set EXPERT_STREAM_MODELS")
def test_trained_fixture_with_truncated_draft(tmp_path):
    """A trained model with an early-exit draft of its own first layers: some drafts accepted,
    some rejected, every bit equal."""
    from mlx_lm.utils import load_tokenizer

    stock, streamed, handle = load_pair(TINY, slots=checkpoint_footprint(TINY).top_k * 2)
    draft = load_model(make_truncated_draft(TINY, tmp_path / "draft", 3))[0]
    text = (Path(__file__).resolve().parents[2] / "streaming" / "cache.py").read_text()
    prompt = mx.array(np.asarray(load_tokenizer(TINY).encode(text)[:48], dtype=np.int32))
    stock_run = speculate(stock, draft, prompt, 16, 3)
    streamed_run = speculate(streamed, draft, prompt, 16, 3)
    assert_same_speculation(stock_run, streamed_run)
    accepted = sum(d for _, _, d in streamed_run)
    assert 0 < accepted < 16, f"{accepted} of 16 tokens from the draft: expected a mix"
    assert handle.stats()["totals"]["misses"] > 0
