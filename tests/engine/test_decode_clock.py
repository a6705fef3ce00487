"""The decode clock (issue 27): the first streamed layer counts decode steps, their time and the
bytes read meanwhile; prefill and idle time between requests are not decode time."""

from __future__ import annotations

import time

import mlx_lm

import expert_stream
from expert_stream.streaming import decode_clock
from expert_stream.streaming.decode_clock import DecodeClock
from plugin_fixtures import MOE


def test_a_served_model_counts_each_generated_token(checkpoints):
    path = checkpoints(**MOE)
    model, tokenizer, handle = expert_stream.load(str(path), budget_gib=0.00005)  # 3 of 8 slots: reads
    t0 = time.perf_counter()
    mlx_lm.generate(model, tokenizer, "Tell me about solid state drives.", max_tokens=16)
    first_s = time.perf_counter() - t0
    decode = handle.stats()["decode"]
    assert decode["tokens"] == 16
    assert 0 < decode["seconds"] < first_s
    assert 0 < decode["bytes_read"] <= handle.stats()["totals"]["bytes_read"]
    # the prompt's tokens but its last (the first decode step) went through in one chunk
    assert handle.stats()["prompt_tokens_prefilled"] == len(tokenizer.encode("Tell me about solid state drives.")) - 1
    time.sleep(1.0)  # idle: the next request's prefill ends the run, the pause is not decode time
    t0 = time.perf_counter()
    mlx_lm.generate(model, tokenizer, "And about hard disks, in a few more words?", max_tokens=8)
    second_s = time.perf_counter() - t0
    after = handle.stats()["decode"]
    assert after["tokens"] == 24
    assert after["seconds"] - decode["seconds"] < second_s
    # The same prompt again, answered from a prompt cache down to its last token: the generation
    # starts with a single-token call after an idle second, which is not a decode step.
    from mlx_lm.models.cache import make_prompt_cache

    ids = tokenizer.encode("Tell me about solid state drives.")
    cache = make_prompt_cache(model)
    mlx_lm.generate(model, tokenizer, ids, max_tokens=4, prompt_cache=cache)
    before = handle.stats()["decode"]
    time.sleep(1.0)
    t0 = time.perf_counter()
    mlx_lm.generate(model, tokenizer, ids[-1:], max_tokens=4, prompt_cache=cache)
    cached = handle.stats()["decode"]
    assert cached["tokens"] - before["tokens"] == 4 and cached["seconds"] - before["seconds"] < time.perf_counter() - t0
    prefilled = handle.stats()["prompt_tokens_prefilled"]
    mlx_lm.generate(model, tokenizer, ids[-1:], max_tokens=4, prompt_cache=cache)
    assert handle.stats()["prompt_tokens_prefilled"] == prefilled  # the prompt cache held all but the last token
    handle.reset_stats()
    assert handle.stats()["decode"] == {"tokens": 0, "seconds": 0.0, "bytes_read": 0}
    assert handle.stats()["prompt_tokens_prefilled"] == 0


def test_speculative_decoding_counts_the_tokens_it_yields(checkpoints, tmp_path):
    """A draft model's verify passes each check several tokens (never a single-token call): the
    clock counts the tokens the generation yields, from the first one out."""
    from mlx_lm.utils import load_model

    from expert_stream.streaming.lab.synthetic.draft import make_dense_draft

    path = checkpoints(**MOE)
    model, tokenizer, handle = expert_stream.load(str(path), budget_gib=0.00005)
    draft = load_model(make_dense_draft(path, tmp_path / "draft"))[0]
    t0 = time.perf_counter()
    out = list(mlx_lm.stream_generate(model, tokenizer, "Tell me about solid state drives.", max_tokens=12,
                                      draft_model=draft, num_draft_tokens=3))
    elapsed = time.perf_counter() - t0
    decode = handle.stats()["decode"]
    assert len(out) == 12 and decode["tokens"] == 11
    # the prompt but its last token, once: the verify passes, as long as chunks, are not prompt
    assert handle.stats()["prompt_tokens_prefilled"] == len(tokenizer.encode("Tell me about solid state drives.")) - 1
    assert 0 < decode["seconds"] < elapsed and decode["bytes_read"] > 0
    mlx_lm.generate(model, tokenizer, "And without a draft?", max_tokens=4)  # single-token calls count again
    assert handle.stats()["decode"]["tokens"] == 11 + 4


def test_runs_end_at_a_multi_token_call_and_at_a_long_gap(monkeypatch):
    now, read = [0.0], [0]
    monkeypatch.setattr(decode_clock.time, "perf_counter", lambda: now[0])
    clock = DecodeClock(lambda: read[0])

    def step(tokens, seconds, nbytes=0):
        clock.tick(tokens)
        now[0] += seconds
        read[0] += nbytes

    step(7, 1.0, 500)  # prefill: not decode
    step(1, 0.1, 10)  # the first decode call starts the run
    step(1, 0.2, 20)
    step(1, 0.1)
    assert (clock.tokens, round(clock.seconds, 6), clock.bytes_read) == (2, 0.3, 30)
    step(4, 1.0)  # a batch or the next prompt ends the run
    step(1, decode_clock.GAP_S + 1)
    step(1, 0.1)  # after a gap longer than GAP_S: a new run
    assert clock.tokens == 2
    step(1, 0.1)
    assert clock.tokens == 3
