"""Layer-major prefill (streaming/prompt_pass.py) through mlx-lm's own generate_step: for every
synthetic preset, the prompt's last-step logits and the decode after it are bitwise stock
generate_step's with the same prefill step (a prompt of four chunks, the last one short), and
each streamed layer read each expert the prompt routes to at most once (<= 1.15x one pass).
A family prompt_pass.PER_CHUNK_FAMILIES names must prefill chunk by chunk, exactly too."""

from __future__ import annotations

import importlib
import json

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm.models.cache import make_prompt_cache

from exactness import load_pair, prompt_ids
from expert_stream.streaming.prompt_pass import PER_CHUNK_FAMILIES, chunk_sizes, windows
from test_engine_exact import CASES, _id, skip_unless_runs_here

STEP = 40
TOKENS = 142  # chunks of 40, 40, 40, 21 (and the last token): longer than a 128-token sliding window
DECODE = 8
WINDOW_KEYS = ("sliding_window", "sliding_window_size")


def prompt_tokens(path) -> int:
    """TOKENS, or more where the preset's sliding window is longer: the last chunks must need a
    mask that depends on the cache's offset, so a mask built from a stale offset shows."""
    config = json.loads((path / "config.json").read_text())
    windows_ = [c.get(k) for c in (config, config.get("text_config") or {}) for k in WINDOW_KEYS]
    return max([TOKENS] + [w + 30 for w in windows_ if isinstance(w, int) and w <= 1024])


def generated(model, prompt, on_progress=None, **kwargs):
    """(token, logprobs) of each of DECODE steps of stock's generate_step (wrapped or not)."""
    generate = importlib.import_module("mlx_lm.generate")
    steps = generate.generate_step(prompt, model, max_tokens=DECODE, prefill_step_size=STEP,
                                   prompt_progress_callback=on_progress, **kwargs)
    return [(int(token), np.array(logprobs.astype(mx.float32))) for token, logprobs in steps]


def assert_same(stock_steps, streamed_steps):
    assert len(stock_steps) == len(streamed_steps) == DECODE
    for i, ((a, la), (b, lb)) in enumerate(zip(stock_steps, streamed_steps)):
        assert a == b and np.array_equal(la, lb), f"step {i}: logits differ"


def one_pass_bytes(handle, trace, prefill_tokens: int) -> int:
    """Bytes of every expert the prompt's prefill tokens route to, once per streamed layer."""
    size = {p.path: p.expert_bytes for p in handle.plans}
    ids = trace.ids[:prefill_tokens]
    return sum(np.unique(ids[:, i]).size * size[s.name] for i, s in enumerate(handle.streams))


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_layer_major_prefill_is_stock_generate_step(checkpoints, case):
    arch, opts = case
    skip_unless_runs_here(arch)
    path = checkpoints(arch, **opts)
    stock, streamed, handle = load_pair(path, prefill_step=STEP)
    tokens = prompt_tokens(path)
    prompt = prompt_ids(tokens, seed=11)[0]
    expected = generated(stock, prompt)
    calls, at_prefill_end = [], {}

    def progress(done, total):
        calls.append((done, total))
        if done == total - 1 and not at_prefill_end:
            at_prefill_end["bytes"] = handle.stats()["totals"]["bytes_read"]

    with handle.recording() as rec:
        got = generated(streamed, prompt, progress)
    assert_same(expected, got)
    assert calls[0] == (0, tokens) and calls[-1] == (tokens, tokens)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    layer_major = handle.prefill.refusal() is None
    assert layer_major == (handle.index.model_type not in PER_CHUNK_FAMILIES)
    if layer_major:
        # Each streamed layer swept its experts once for the prompt: one pass of bytes at most.
        assert at_prefill_end["bytes"] <= 1.15 * one_pass_bytes(handle, rec.trace(), tokens - 1)
        totals = handle.stats()["totals"]
        assert totals["sweep_calls"] <= len(handle.layers)  # one sweep per layer, not per chunk
        # The chunks' experts were read as their routing arrived, and the sweeps took them from there.
        assert totals["readahead_hits"] >= totals["readahead_reads"] > 0
    handle.close()


def test_readahead_reads_nothing_more_and_stays_exact(checkpoints):
    """With the readahead off, the same bytes are read, each in the layer's sweep; with it on,
    most of them while later chunks' attention computed; both stock's, bitwise."""
    path = checkpoints("qwen3_moe")
    prompt = prompt_ids(TOKENS, seed=15)[0]
    stock, on, on_handle = load_pair(path, prefill_step=STEP)
    _, off, off_handle = load_pair(path, prefill_step=STEP, prefill_readahead_gib=0)
    expected = generated(stock, prompt)
    totals = {}
    for name, model, handle in (("on", on, on_handle), ("off", off, off_handle)):
        handle.prefill.prefill(model, prompt, make_prompt_cache(model), STEP)
        totals[name] = handle.stats()["totals"]
        assert_same(expected, generated(model, prompt))
        handle.close()
    assert totals["on"]["bytes_read"] == totals["off"]["bytes_read"] > 0
    assert totals["on"]["readahead_hits"] > 0 == totals["off"]["readahead_reads"]


def test_readahead_rows_shrink_to_the_memory_left(checkpoints):
    """The rows are what the setting pays for, fewer where the memory left beside the window's
    activations is short, none where nothing is left."""
    path = checkpoints("qwen3_moe")
    _, _, roomy = load_pair(path, prefill_step=STEP)
    _, _, tight = load_pair(path, prefill_step=STEP, memory_gib=0.001)
    experts = roomy.streams[0].cache.num_experts
    assert roomy.prefill.readahead_for(STEP, TOKENS) == experts  # 0.5 GiB holds every expert here
    assert tight.prefill.readahead_for(STEP, TOKENS) == 0
    roomy.close()
    tight.close()


def test_chunk_plan_is_stock_loop():
    """The chunks are stock generate_step's loop's: min(step, remaining - 1) until one is left."""
    assert chunk_sizes(142, 40) == [40, 40, 40, 21]
    assert chunk_sizes(81, 40) == [40, 40]
    assert chunk_sizes(2, 40) == [1]
    assert windows([40, 40, 40, 21], 80) == [[40, 40], [40, 21]]
    assert windows([40, 40, 40, 21], 10) == [[40], [40], [40], [21]]


def test_a_window_of_two_chunks_is_two_passes_and_exact(checkpoints):
    """A prompt longer than prefill_window prefills in passes of whole chunks; still stock's."""
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, prefill_step=STEP, prefill_window=2 * STEP)
    _, whole, whole_handle = load_pair(path, prefill_step=STEP)
    prompt = prompt_ids(TOKENS, seed=12)[0]
    expected = generated(stock, prompt)
    assert_same(expected, generated(streamed, prompt))
    assert_same(expected, generated(whole, prompt))
    sweeps = handle.stats()["totals"]["sweep_calls"]
    assert sweeps == 2 * whole_handle.stats()["totals"]["sweep_calls"] > 0
    handle.close()
    whole_handle.close()


def test_little_memory_left_shrinks_the_passes_and_stays_exact(checkpoints, caplog):
    """Where the memory left under the limit holds no more than one chunk's activations, each
    chunk is its own pass (stock's peak), logged, exact; with room, one pass for the prompt."""
    path = checkpoints("qwen3_moe")
    stock, tight, tight_handle = load_pair(path, prefill_step=STEP, memory_gib=0.001)
    _, roomy, roomy_handle = load_pair(path, prefill_step=STEP)
    assert tight_handle.prefill.token_bytes > 0
    assert tight_handle.prefill.window_for(STEP, TOKENS) == STEP
    assert roomy_handle.prefill.window_for(STEP, TOKENS) == roomy_handle.settings.prefill_window
    prompt = prompt_ids(TOKENS, seed=14)[0]
    expected = generated(stock, prompt)
    with caplog.at_level("INFO", logger="expert_stream"):
        assert_same(expected, generated(tight, prompt))
    assert any(f"in passes of {STEP}" in r.getMessage() for r in caplog.records)
    assert_same(expected, generated(roomy, prompt))
    chunks = len(chunk_sizes(TOKENS, STEP))
    assert tight_handle.stats()["totals"]["sweep_calls"] == chunks * roomy_handle.stats()["totals"]["sweep_calls"] > 0
    tight_handle.close()
    roomy_handle.close()


def test_a_running_prefill_shows_in_stats_and_metrics(checkpoints):
    """While a layer-major prefill runs, the handle's stats (status, the page) and the metrics
    show its tokens done of total and the bytes it read; after it, nothing runs."""
    from expert_stream.plugin.metrics import exposition

    _, streamed, handle = load_pair(checkpoints("qwen3_moe"), prefill_step=STEP)
    seen, scrapes = [], []

    def progress(done, total):
        running = handle.stats()["prefill"]
        if running is not None:
            seen.append(running)
            status = {"models": {"m": {"state": "loaded", "streamed": True, "stats": handle.stats()}}}
            scrapes.append(exposition(status)[0].decode())

    generated(streamed, prompt_ids(TOKENS, seed=13)[0], progress)
    middle = [p for p in seen if 0 < p["tokens_done"] < p["tokens_total"] == TOKENS]
    assert middle and middle[-1]["bytes_read"] > 0 and middle[-1]["tokens_per_pass"] == handle.settings.prefill_window
    assert any(f'expert_stream_prefill_tokens_done{{model="m"}} {float(p["tokens_done"])}' in text
               for p, text in zip(seen, scrapes) if p in middle)
    assert handle.stats()["prefill"] is None
    handle.close()
