"""Routing prediction (the lookahead): guessed experts read into a side buffer outside the cache
or into slots, one or more layers ahead. Whatever it guesses, right, wrong or injected, the
logits stay stock's bit for bit; with the side buffer a guess costs bytes and nothing else (the
cache moves exactly as with the lookahead off); the counters say what happened."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from conftest import REPO, SHARED
import expert_stream
from exactness import assert_same_logits, load_pair, prompt_ids
from expert_stream.streaming.errors import SettingsError
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.settings import StreamSettings

TINY = Path(os.environ.get("EXPERT_STREAM_MODELS", SHARED / "models")) / "tiny-code-moe"
needs_tiny = pytest.mark.skipif(not TINY.is_dir(), reason=f"the trained fixture {TINY} is not present")

EXPERTS, TOP_K, LAYERS = 32, 4, 4


@pytest.fixture
def model_path(checkpoints):
    return checkpoints("qwen3_moe", experts=EXPERTS, top_k=TOP_K, layers=LAYERS)


def _decode(model, prompt: mx.array, steps: int) -> list[mx.array]:
    """Prefill, then `steps` greedy decode steps; the logits of each."""
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)
    out = [logits]
    for _ in range(steps):
        token = mx.argmax(logits[:, -1:], axis=-1)
        logits = model(token, cache=cache)
        mx.eval(logits)
        out.append(logits)
    return out


def _inject(handle, guess):
    """Every lookahead's probe guesses `guess(depth)` instead of the router's top-k."""
    for layer in handle.layers:
        for look in layer.lookaheads:
            look.probe.guess = lambda x, d=look.depth: mx.array(guess(d), dtype=mx.int32)


@pytest.mark.parametrize("settings", [
    {"prefetch_into": "buffer"},
    {"prefetch_into": "buffer", "prefetch_depth": 2},
    {"prefetch_into": "slots", "prefetch_depth": 2},
    {"prefetch_into": "buffer", "prefetch_depth": 3, "prefetch_per_layer": 8, "slot_write": "staged"},
    {"prefetch_into": "buffer", "prefetch_guesses": 2},
])
def test_prediction_modes_are_exact(model_path, settings):
    stock, streamed, handle = load_pair(model_path, slots=6, prefetch=True, **settings)
    depth = settings.get("prefetch_depth", 1)
    assert {look.probe.count for layer in handle.layers for look in layer.lookaheads} == {
        settings.get("prefetch_guesses", TOP_K)}
    assert [len(layer.lookaheads) for layer in handle.layers] == [min(depth, LAYERS - 1 - i) for i in range(LAYERS)]
    assert_same_logits(stock, streamed, prompt_ids(16), decode_steps=12)
    totals = handle.stats()["totals"]
    assert totals["guesses"] > 0 and totals["prefetch_reads"] > 0
    assert (totals["far_guesses"] > 0) is (depth > 1)
    if settings["prefetch_into"] == "slots":
        assert totals["guess_buffer_hits"] == 0
    handle.close()


@pytest.mark.parametrize("depth", [1, 2])
def test_side_buffer_is_the_cache_of_lookahead_off_plus_bytes(model_path, depth):
    """Guesses read into the side buffer, right or wrong, leave the cache as the lookahead-off
    engine leaves it: same hits, misses, evictions and slot tables; the bytes differ by exactly
    the guessed reads that no miss used."""
    stock, off, h_off = load_pair(model_path, slots=6, prefetch=False)
    _, on, h_on = load_pair(model_path, slots=6, prefetch=True, prefetch_into="buffer", prefetch_depth=depth)
    rng = np.random.default_rng(depth)
    # Half the tokens' guesses are arbitrary experts (mostly wrong), half the router's.
    real = {id(look): look.probe.guess for layer in h_on.layers for look in layer.lookaheads}
    calls = {"n": 0}

    def mixed(look):
        def guess(x):
            calls["n"] += 1
            if calls["n"] % 2:
                return mx.array(rng.choice(EXPERTS, TOP_K, replace=False), dtype=mx.int32)
            return real[id(look)](x)
        return guess

    for layer in h_on.layers:
        for look in layer.lookaheads:
            look.probe.guess = mixed(look)
    prompt = prompt_ids(12, seed=3)
    ref, a, b = _decode(stock, prompt, 16), _decode(off, prompt, 16), _decode(on, prompt, 16)
    for step, (x, y, z) in enumerate(zip(ref, a, b)):
        assert mx.array_equal(x, y).item() and mx.array_equal(x, z).item(), f"step {step}: logits differ"
    expert_bytes = checkpoint_footprint(model_path).layer_expert_bytes[0]
    used = wasted = 0
    for s_off, s_on in zip(h_off.streams, h_on.streams):
        a, b = s_off.cache, s_on.cache
        for key in ("calls", "hits", "misses", "evictions"):
            assert getattr(a.stats, key) == getattr(b.stats, key), f"{s_on.name}: {key}"
        assert np.array_equal(a.expert_in, b.expert_in), s_on.name
        st = b.stats
        assert st.prefetch_hits == st.guess_buffer_hits <= st.misses
        assert st.bytes_read == a.stats.bytes_read + (st.prefetch_reads - st.guess_buffer_hits) * expert_bytes
        used, wasted = used + st.guess_buffer_hits, wasted + st.prefetch_reads - st.guess_buffer_hits
    assert used > 0 and wasted > 0, "the run should have both right and wrong guesses"
    h_off.close()
    h_on.close()


@pytest.mark.parametrize("into", ["buffer", "slots"])
def test_forced_wrong_guesses_stay_exact(model_path, into):
    """Guesses of experts the next layers never use (injected): still stock's bits. Into slots
    they evict; into the buffer they only cost reads."""
    stock, streamed, handle = load_pair(model_path, slots=6, prefetch=True, prefetch_into=into, prefetch_depth=2)
    # Experts routed to nowhere in this prompt would do; a fixed set of the last ids is wrong
    # often enough, and rotates so that windows keep judging.
    _inject(handle, lambda d: np.arange(EXPERTS - TOP_K * d, EXPERTS - TOP_K * (d - 1)))
    for layer in handle.layers:
        for look in layer.lookaheads:
            look.active = True
    assert_same_logits(stock, streamed, prompt_ids(10, seed=5), decode_steps=10)
    totals = handle.stats()["totals"]
    assert totals["prefetch_reads"] > 0
    if into == "buffer":
        assert totals["guess_buffer_hits"] == totals["prefetch_hits"]
    handle.close()


def test_right_guesses_are_served_from_the_buffer(model_path, monkeypatch):
    """A lookahead that guesses every expert (cap = all) serves each miss of the guessed layers
    from the side buffer: no demand read there; the first layer, unguessed, still reads."""
    from expert_stream.streaming import lookahead

    monkeypatch.setattr(lookahead, "MIN_GUESS_HIT_SHARE", 0.0)  # 4 right of 32 guessed: keep it on
    monkeypatch.setattr(lookahead, "MIN_READ_PRECISION", 0.0)
    stock, streamed, handle = load_pair(model_path, slots=6, prefetch=True, prefetch_per_layer=EXPERTS)
    _inject(handle, lambda d: np.arange(EXPERTS))
    c1, c2 = make_prompt_cache(stock), make_prompt_cache(streamed)
    prompt = prompt_ids(8, seed=7)
    a, b = stock(prompt, cache=c1), streamed(prompt, cache=c2)
    handle.reset_stats()  # decode only: prefill chunks are not guessed
    token = mx.argmax(a[:, -1:], axis=-1)
    for _ in range(6):
        a, b = stock(token, cache=c1), streamed(token, cache=c2)
        mx.eval(a, b)
        assert mx.array_equal(a, b).item()
        token = mx.argmax(a[:, -1:], axis=-1)
    layers = handle.stats()["layers"]
    first, *guessed = [layers[s.name] for s in handle.streams]
    assert first["guess_buffer_hits"] == 0 and first["misses"] > 0 and first["demand_calls"] > 0
    assert sum(g["misses"] for g in guessed) > 0
    for g in guessed:
        assert g["guess_buffer_hits"] == g["misses"] and g["demand_calls"] == 0
        assert g["overlap_calls"] == 0  # no read left to hide: stock's one call, not parts
    handle.close()


def test_failed_guess_reads_fall_back_to_demand_reads(model_path, monkeypatch):
    """A guessed read that fails serves nothing: the layer reads those experts on demand and
    the logits stay stock's."""
    from expert_stream.streaming import guess_buffer
    from expert_stream.streaming.errors import ReadError

    class Failed:
        def done(self):
            return True

        def result(self, timeout=None):
            raise ReadError("injected: guessed read failed")

    real_start = guess_buffer.Guessed.start

    def failing_start(self, reader, experts):
        real_start(self, reader, experts)
        got, rows, future = self.reads[-1]
        future.result()  # the real read is over: no thread writes the rows after this
        self.reads[-1] = (got, rows, Failed())

    monkeypatch.setattr(guess_buffer.Guessed, "start", failing_start)
    stock, streamed, handle = load_pair(model_path, slots=6, prefetch=True)
    assert_same_logits(stock, streamed, prompt_ids(8, seed=2), decode_steps=8)
    totals = handle.stats()["totals"]
    assert totals["prefetch_reads"] > 0 and totals["guess_buffer_hits"] == 0
    assert totals["reads_landed"] + totals["reads_waited"] == totals["misses"]  # every miss read on demand
    handle.close()


def test_sync_counters(model_path):
    """Each routed call's readback is a counted sync; time is measured."""
    stock, streamed, handle = load_pair(model_path, slots=6, prefetch=True)
    assert_same_logits(stock, streamed, prompt_ids(6), decode_steps=5)
    for name, layer in handle.stats()["layers"].items():
        assert layer["syncs"] >= layer["calls"] - layer["resident_calls"] > 0, name
        assert layer["sync_seconds"] > 0, name
    handle.close()


def test_side_buffers_are_few_and_returned(model_path):
    """The model's side buffers: one per guessed layer in flight at most, all back after a token."""
    stock, streamed, handle = load_pair(model_path, slots=6, prefetch=True, prefetch_depth=2)
    assert_same_logits(stock, streamed, prompt_ids(6), decode_steps=6)
    pool = handle.streams[1].guess_pool
    assert pool is not None and 1 <= pool.made <= 3
    assert all(s.guessed is None for s in handle.streams)
    assert pool.nbytes == pool.made * 2 * 4 * checkpoint_footprint(model_path).layer_expert_bytes[0]
    handle.close()


def test_prediction_settings_are_checked():
    with pytest.raises(SettingsError, match="prefetch_into must be one of buffer, slots"):
        StreamSettings(budget_gib=1, prefetch_into="ram")
    with pytest.raises(SettingsError, match="prefetch_depth must be >= 1"):
        StreamSettings(budget_gib=1, prefetch_depth=0)


@needs_tiny
@pytest.mark.parametrize("settings", [{"prefetch_into": "buffer"}, {"prefetch_into": "buffer", "prefetch_depth": 2},
                                      {"prefetch_into": "slots"}])
def test_trained_fixture_exact_with_prediction(settings):
    """The trained router's own guesses on Python source it never saw: stock's bits at every
    step; the side buffer serves misses."""
    from mlx_lm.utils import load_model, load_tokenizer

    tokens = load_tokenizer(TINY).encode((REPO / "streaming" / "cache.py").read_text())[:40]
    stock, _ = load_model(TINY)
    budget = checkpoint_footprint(TINY).budget_gib_for_slots(12)
    streamed, _, handle = expert_stream.load(TINY, budget_gib=budget, prefetch=True, **settings)
    c1, c2 = make_prompt_cache(stock), make_prompt_cache(streamed)
    prompt = mx.array([tokens[:16]])
    a, b = stock(prompt, cache=c1), streamed(prompt, cache=c2)
    mx.eval(a, b)
    assert mx.array_equal(a, b).item()
    for step, t in enumerate(tokens[16:]):
        a, b = stock(mx.array([[t]]), cache=c1), streamed(mx.array([[t]]), cache=c2)
        mx.eval(a, b)
        assert mx.array_equal(a, b).item(), f"step {step}"
    totals = handle.stats()["totals"]
    assert totals["guess_hits"] > totals["guesses"] / 2
    if settings["prefetch_into"] == "buffer":
        assert totals["guess_buffer_hits"] > 0
        assert (totals["far_guess_hits"] > 0) is (settings.get("prefetch_depth", 1) > 1)
    handle.close()
