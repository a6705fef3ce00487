"""The streamed layer's contracts beyond equal bits: it takes stock's kernel path (the bits
cannot tell on CPU/CUDA, see MEASURED.md), pins slots a pending graph reads, reads each expert
once per prefill chunk, adopts the chunk's hottest experts, and the lookahead reports itself."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from exactness import assert_same_logits, load_pair, prompt_ids
from expert_stream.streaming.streamed_switch import StreamedSwitch


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records `sorted_indices` of every gather_qmm / gather_mm call."""
    calls = []
    for name in ("gather_qmm", "gather_mm"):
        original = getattr(mx, name)

        def spy(*args, _original=original, **kwargs):
            calls.append(bool(kwargs.get("sorted_indices", False)))
            return _original(*args, **kwargs)

        monkeypatch.setattr(mx, name, spy)
    return calls


def _streamed_layers(model):
    """In model order (named_modules lists the deepest last layer first)."""
    return [m for _, m in model.named_modules() if isinstance(m, StreamedSwitch)][::-1]


@pytest.mark.parametrize("bits, slot_write", [(4, "direct"), (0, "direct"), (4, "copy")])
def test_same_kernel_path_as_stock(checkpoints, kernel_calls, bits, slot_write):
    path = checkpoints("qwen3_moe", bits=bits)
    stock, streamed, handle = load_pair(path, prefetch=False, slot_write=slot_write)
    for tokens, expect_sorted in ((48, True), (1, False)):  # prefill (sweep), decode
        x = prompt_ids(tokens)
        kernel_calls.clear()
        mx.eval(stock(x))
        stock_flags = set(kernel_calls)
        kernel_calls.clear()
        mx.eval(streamed(x))
        assert stock_flags == {expect_sorted}
        assert set(kernel_calls) == stock_flags, f"{tokens} tokens: streamed took another kernel path"
    handle.close()


@pytest.mark.parametrize("slot_write", ["direct", "staged", "copy"])
def test_decode_overlaps_hits_with_reads(checkpoints, slot_write):
    path = checkpoints("qwen3_moe")
    stock, streamed, handle = load_pair(path, slots=6, prefetch=False, slot_write=slot_write)
    layers = _streamed_layers(streamed)
    paths = []
    c1, c2 = make_prompt_cache(stock), make_prompt_cache(streamed)
    token = prompt_ids(1)
    for _ in range(12):
        a, b = stock(token, cache=c1), streamed(token, cache=c2)
        mx.eval(a, b)
        assert mx.array_equal(a, b).item()
        paths += [layer.path_taken.name for layer in layers]
        token = mx.argmax(a[:, -1:], axis=-1)
    assert set(paths) == {"layer_by_layer"}  # 6 slots of 16 experts: never all resident
    # Some steps had both hits and misses, and computed the hits while the misses were read.
    assert handle.stats()["totals"]["overlap_calls"] > 0
    handle.close()


def test_pending_graph_pins_its_slots(checkpoints):
    """A lazy output whose slots a later call needs is evaluated before they are overwritten."""
    path = checkpoints("qwen3_moe", bits=0)
    stock, streamed, handle = load_pair(path, prefetch=False)
    layer = _streamed_layers(streamed)[0]
    stock_layer = stock.model.layers[0].mlp.switch_mlp
    x = mx.random.normal((1, 1, stock.args.hidden_size), key=mx.random.key(1))
    experts = stock.args.num_experts
    first = mx.array([[[0, 1, 2, 3]]], dtype=mx.uint32)
    second = mx.array([[[4, 5, 6, 7]]], dtype=mx.uint32)  # evicts every slot `first` used
    y_first = layer(x, first)  # not evaluated
    y_second = layer(x, second)
    assert experts >= 8
    assert mx.array_equal(y_first, stock_layer(x, first)).item()
    assert mx.array_equal(y_second, stock_layer(x, second)).item()
    handle.close()


def test_prefill_reads_each_expert_once_and_adopts_hottest(checkpoints):
    path = checkpoints("qwen3_moe", experts=32, top_k=4)
    stock, streamed, handle = load_pair(path, slots=6, prefetch=False)
    x = prompt_ids(64, seed=5)
    y = streamed(x)
    mx.eval(y)
    plan_bytes = {p.path: p.expert_bytes for p in handle.plans}
    for layer in _streamed_layers(streamed):
        stats = layer.store.cache.stats
        assert stats.sweep_calls == 1 and layer.path_taken is layer.sweep
        # A cold cache: every needed expert missed, and was read exactly once.
        assert stats.bytes_read == stats.misses * plan_bytes[layer.store.name]
    # The pool holds the chunk's most used experts of the first layer.
    stock_block = stock.model.layers[0].mlp
    h = stock.model.embed_tokens(x)
    layer0 = stock.model.layers[0]
    h = h + layer0.self_attn(layer0.input_layernorm(h), mask="causal", cache=None)
    gates = mx.softmax(stock_block.gate(layer0.post_attention_layernorm(h)), axis=-1)
    ids = np.array(mx.argpartition(gates, kth=-4, axis=-1)[..., -4:]).reshape(-1)
    uses = np.bincount(ids, minlength=32)
    cache = _streamed_layers(streamed)[0].store.cache
    held = set(cache.expert_in[cache.expert_in >= 0].tolist())
    threshold = np.sort(uses)[-cache.num_slots]
    assert {int(e) for e in np.flatnonzero(uses > threshold)} <= held
    assert all(uses[e] >= threshold for e in held)
    handle.close()


def test_lookahead_reports_and_switches_off(checkpoints):
    path = checkpoints("qwen3_moe", experts=32, top_k=4, layers=3)
    stock, streamed, handle = load_pair(path, slots=8)
    layers = _streamed_layers(streamed)
    look = layers[0].lookaheads[0]
    assert look is not None
    # Make layer 0's guesses useless: always experts layer 1 is never routed to here.
    real_guess = look.probe.guess
    never = mx.array(np.arange(32, dtype=np.int32))
    look.probe.guess = lambda x: never[28:32]
    c = make_prompt_cache(streamed)
    token = prompt_ids(1)
    for _ in range(40):
        logits = streamed(token, cache=c)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
        if not look.active:
            break
    stats = layers[1].store.cache.stats
    assert stats.guesses > 0
    assert not look.active, "useless guesses must switch the layer's lookahead off"
    look.probe.guess = real_guess
    # With the real probe, exactness is untouched by prefetching.
    stock2, streamed2, handle2 = load_pair(path, slots=8)
    assert_same_logits(stock2, streamed2, prompt_ids(20), decode_steps=12)
    per_layer = handle2.stats()["layers"]
    assert sum(v["guesses"] for v in per_layer.values()) > 0
    handle.close()
    handle2.close()


def test_layers_that_fit_stay_stock_layers(checkpoints):
    """`resident` (default on): a budget holding every expert leaves the stock blocks in place;
    off, the same budget streams them through slots. Either way the logits are stock's."""
    from expert_stream.streaming.footprint import checkpoint_footprint

    path = checkpoints("qwen3_moe", layers=2)
    experts = checkpoint_footprint(path).num_experts[0]
    for resident, streamed_layers in ((True, 0), (False, 2)):
        stock, streamed, handle = load_pair(path, slots=experts, resident=resident)
        assert len(_streamed_layers(streamed)) == streamed_layers
        assert handle.stats()["resident_layers"] == 2 - streamed_layers
        assert_same_logits(stock, streamed, prompt_ids(12), decode_steps=3)
        handle.close()


def test_each_call_takes_one_path_object(checkpoints):
    """A layer holding every expert computes on the device (the resident path), routing recorded
    or not (the recorder reads the ids later, with no sync); the benchmark's compute floor reads nothing while it is on; a layer with
    fewer slots than experts goes layer by layer, and a prefill chunk needing more, the sweep."""
    from expert_stream.streaming.footprint import checkpoint_footprint

    path = checkpoints("qwen3_moe", layers=2)
    experts = checkpoint_footprint(path).num_experts[0]
    stock, streamed, handle = load_pair(path, slots=experts, resident=False, prefetch=False)
    layers = _streamed_layers(streamed)
    assert_same_logits(stock, streamed, prompt_ids(12), decode_steps=3)
    assert {layer.path_taken.name for layer in layers} == {"resident"}
    assert handle.stats()["totals"]["resident_calls"] > 0
    syncs = handle.stats()["totals"]["syncs"]
    with handle.recording() as rec:
        for seed in range(4):  # more passes than the recorder leaves on the device
            mx.eval(streamed(prompt_ids(3, seed=seed)))
    # Recording keeps the resident path: the ids stay on the device until read, no sync.
    assert {layer.path_taken.name for layer in layers} == {"resident"}
    assert handle.stats()["totals"]["syncs"] == syncs
    recorded = rec.trace().ids
    assert recorded.shape[:2] == (12, len(layers))
    # The same routing the stock router gives those tokens (ids sorted: top-k order is free).
    _, streamed_rec, handle_rec = load_pair(path, slots=4, prefetch=False)
    with handle_rec.recording() as rec_host:
        for seed in range(4):
            mx.eval(streamed_rec(prompt_ids(3, seed=seed)))
    assert np.array_equal(np.sort(rec_host.trace().ids, axis=-1), np.sort(recorded, axis=-1))
    handle_rec.close()
    handle.close()

    stock, streamed, handle = load_pair(path, slots=4, prefetch=False)
    layers = _streamed_layers(streamed)
    mx.eval(streamed(prompt_ids(40)))
    assert {layer.path_taken.name for layer in layers} == {"prefill_sweep"}
    read = handle.reader.total_bytes
    with handle.compute_only():
        mx.eval(streamed(prompt_ids(1, seed=4)))
        assert {layer.path_taken.name for layer in layers} == {"compute_floor"}
    assert handle.reader.total_bytes == read  # no expert was read
    mx.eval(streamed(prompt_ids(1, seed=4)))
    assert {layer.path_taken.name for layer in layers} == {"layer_by_layer"}
    handle.close()
