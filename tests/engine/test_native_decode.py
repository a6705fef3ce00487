"""decode_path native (streaming/native_decode.py, native/resolve.cpp): decode tokens resolved
inside the graph, in mlx-lm's own loop (`generate_step` builds token t+1 before reading token
t), bitwise stock's with eviction on every token; the table handed to and from the Python path
(prompts, budget moves) with nothing lost; a failed read or a changed shard an error from the
evaluation that names it, and every later call too; and the Python path, saying why, where the
native part cannot build."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import expert_stream
from exactness import load_pair, prompt_ids
from expert_stream.streaming import native_check, native_decode
from expert_stream.streaming.checkpoint import CheckpointIndex
from expert_stream.streaming.errors import SettingsError
from expert_stream.streaming.expert_store import PIN_BOUND
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.slots import expert_bytes

NATIVE = dict(decode_path="native", policy="lru", online_budget=False)


def logprobs(model, prompt, tokens: int) -> list[np.ndarray]:
    """mlx-lm's greedy generation loop, each step's log-probabilities."""
    return [np.array(lp) for (_, lp), _ in zip(generate_step(prompt, model, max_tokens=tokens), range(tokens))]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    steps = [i for i, (x, y) in enumerate(zip(a, b)) if not np.array_equal(x, y)]
    assert len(a) == len(b) and not steps, f"log-probabilities differ at steps {steps}"


def native_served(handle) -> bool:
    return all(layer.path_taken is layer.native for layer in handle.layers)


@pytest.mark.parametrize("arch, policy", [("qwen3_moe", "lru"), ("gpt_oss", "lru"), ("qwen3_moe", "default")])
def test_native_decode_is_stock_bitwise_with_eviction_every_token(checkpoints, arch, policy):
    path = checkpoints(arch, layers=2)
    stock, streamed, handle = load_pair(path, **NATIVE | dict(policy=policy))
    assert handle.stats()["decode_path"] == "native"
    syncs = []
    for seed in (0, 1):  # each request's prompt takes the table back to the Python path
        prompt = prompt_ids(9 + seed, seed=seed)[0]
        assert_same(logprobs(stock, prompt, 24), logprobs(streamed, prompt, 24))
        assert native_served(handle)
        syncs.append(handle.stats()["totals"]["syncs"])
    one_token = logprobs(streamed, prompt, 1)  # the same prompt, no decode: its syncs alone
    assert handle.stats()["totals"]["syncs"] - syncs[1] == syncs[1] - syncs[0]  # decode made none
    assert_same(one_token, logprobs(stock, prompt, 1))
    totals = handle.stats()["totals"]
    assert totals["misses"] > 0 and totals["evictions"] > 0
    one_expert = expert_bytes(handle.layers[0].store.slots.tensors)
    assert totals["bytes_read"] == totals["misses"] * one_expert  # every miss read, from the shards
    for layer in handle.layers:
        assert len(layer.store.pending) <= PIN_BOUND + 1
        cache = layer.store.cache
        held = cache.expert_in[cache.expert_in >= 0]
        assert (cache.slot_of[held] == np.flatnonzero(cache.expert_in >= 0)).all()
    handle.close()


def test_budget_moves_and_prompts_between_tokens_stay_exact(checkpoints):
    path = checkpoints("qwen3_moe", layers=2)
    fp = checkpoint_footprint(path)
    stock, streamed, handle = load_pair(path, slots=fp.top_k * 2, **NATIVE)
    prompt = prompt_ids(7)[0]
    want = logprobs(stock, prompt, 12)
    got = []
    budgets = iter([fp.budget_gib_for_slots(fp.top_k), fp.budget_gib_for_slots(fp.top_k + 3)])
    for i, ((_, lp), _) in enumerate(zip(generate_step(prompt, streamed, max_tokens=12), range(12))):
        got.append(np.array(lp))
        if i in (3, 7):  # the layers resize at their next call, mid-generation
            handle.set_budget(int(next(budgets) * (1 << 30)))
    assert_same(want, got)
    assert [layer.store.cache.num_slots for layer in handle.layers] == [fp.top_k + 3] * len(handle.layers)
    assert native_served(handle)
    handle.close()


def test_online_rebalancing_moves_the_slots_the_python_path_moves(checkpoints):
    """online_budget under the native path: the primitive records each layer's hit curve, the
    rebalance (every 64 calls) waits for the queued resolutions and reads the curves the Python
    path would, so both move the same slots, bitwise stock's either way."""
    path = checkpoints("qwen3_moe", layers=4)
    fp = checkpoint_footprint(path)
    prompt = prompt_ids(5, seed=4)[0]
    want = logprobs(load_pair(path)[0], prompt, 140)
    runs = []
    for settings in (NATIVE | dict(policy="default", online_budget=True),
                     dict(policy="default", online_budget=True, prefetch=False)):
        _, streamed, handle = load_pair(path, slots=fp.top_k + 4, **settings)
        assert_same(want, logprobs(streamed, prompt, 140))
        assert native_served(handle) == ("decode_path" in settings)
        runs.append(([layer.store.cache.num_slots for layer in handle.layers], handle.online_budget.moves,
                     handle.stats()["totals"]["misses"]))
        handle.close()
    assert runs[0] == runs[1] and runs[0][1] > 0, runs


def _first_miss_shard(handle, index: CheckpointIndex):
    """The shard holding the rows of an expert layer 0 does not hold now."""
    layer = handle.layers[0]
    expert = int(np.flatnonzero(layer.store.cache.slot_of < 0)[0])
    return index.files[layer.store.slots.tensors[0].info.file], expert


def test_a_failed_read_fails_the_evaluation_naming_it_and_keeps_failing(ckpt):
    stock, streamed, handle = load_pair(ckpt, **NATIVE)
    prompt = prompt_ids(6)[0]
    steps = generate_step(prompt, streamed, max_tokens=64)
    for _ in range(3):
        next(steps)
    index = CheckpointIndex(ckpt)
    for shard in index.files:  # every read from here on ends early
        with open(shard, "r+b") as f:
            f.truncate(min(t.start for t in index.tensors.values() if index.files[t.file] == shard))
    with pytest.raises(RuntimeError) as first:  # the same generation: decode tokens only
        for _ in range(61):
            next(steps)
    message = str(first.value)
    assert "model.layers." in message and ": reading expert " in message and ".safetensors at offset " in message
    assert ", length " in message and "the shard ends early" in message
    for _ in range(2):  # a new request, and again: until the model is reloaded
        with pytest.raises(Exception, match="the shard ends early"):
            logprobs(streamed, prompt, 2)
    handle.close()


def test_closing_the_model_waits_for_the_token_mlx_lm_evaluates_ahead(ckpt, monkeypatch):
    """mlx-lm queues token n+1 before it yields token n: closing the model then must wait for
    that token's resolutions, which write into the layer's arrays."""
    left = []
    close = native_decode.NativeDecode.close

    def spied(self):
        close(self)
        left.append(self.table.queued)

    monkeypatch.setattr(native_decode.NativeDecode, "close", spied)
    _, streamed, handle = load_pair(ckpt, **NATIVE)
    steps = generate_step(prompt_ids(6)[0], streamed, max_tokens=64)
    for _ in range(4):
        next(steps)
    handle.close()
    assert left == [0] * len(handle.layers)


def test_a_changed_shard_stops_the_model_naming_it(ckpt):
    stock, streamed, handle = load_pair(ckpt, **NATIVE)
    prompt = prompt_ids(6)[0]
    want = logprobs(stock, prompt, 3)
    assert_same(want, logprobs(streamed, prompt, 3))
    index = CheckpointIndex(ckpt)
    for shard in index.files:
        st = os.stat(shard)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(Exception, match="changed on disk since the model was loaded") as raised:
        logprobs(streamed, prompt_ids(6, seed=3)[0], 16)
    # resolve.cpp words it as checkpoint.ShardIdentity does (it cannot call it without the GIL)
    assert any(str(i.error("it was modified")) in str(raised.value) for i in index.identities)
    handle.close()


@pytest.mark.parametrize("setting", [dict(policy="lfu"), dict(prefetch=True),
                                     dict(skip_miss_below=0.1)])
def test_what_needs_host_routing_is_refused_by_name(ckpt, setting):
    values = NATIVE | setting
    name = next(iter(setting))
    with pytest.raises(SettingsError, match=f"decode_path native: {name}"):
        expert_stream.load(ckpt, budget_gib=0.01, **values)


def test_with_every_expert_layer_resident_the_note_says_so(ckpt):
    _, handle = expert_stream.load(ckpt, budget_gib=100, **NATIVE)[1:]
    assert not handle.layers and handle.stats()["decode_path"] == "python"
    assert "no expert layer is streamed" in handle.stats()["decode_path_note"]
    handle.close()


def test_without_a_compiler_the_python_path_serves_and_says_why(ckpt, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("EXPERT_STREAM_NATIVE_CACHE", str(tmp_path / "native"))
    monkeypatch.setattr(native_check, "_why_not", {})
    with caplog.at_level(logging.WARNING, logger="expert_stream"):
        stock, streamed, handle = load_pair(ckpt, **NATIVE)
    path, why = handle.decode_path
    assert path == "python" and "building resolve.cpp with false failed" in why
    assert handle.stats()["decode_path_note"] == why
    assert any("the Python decode path serves" in r.getMessage() for r in caplog.records)
    prompt = prompt_ids(6)[0]
    assert_same(logprobs(stock, prompt, 6), logprobs(streamed, prompt, 6))
    assert all(layer.native is None for layer in handle.layers)
    handle.close()


def test_without_the_cuda_toolkit_the_gpu_half_says_what_it_needs(monkeypatch, tmp_path):
    from expert_stream.native import resolve_build

    monkeypatch.setenv("EXPERT_STREAM_NATIVE_CACHE", str(tmp_path / "native"))
    monkeypatch.setattr(resolve_build, "cuda_home", lambda: None)
    module, why = resolve_build.load(cuda=True)
    assert module is None and "needs the CUDA toolkit" in why and "CUDA_HOME" in why
    assert not (tmp_path / "native").exists()  # nothing built


def test_the_build_proves_itself_at_load():
    module, why = native_check.native_module()
    assert module is not None, why
    assert native_check.self_check(module) == ""
    assert mx.default_device() == mx.cpu


def test_the_proof_a_gpu_runs_fails_a_read_both_ways_in_a_child(tmp_path):
    """What a CUDA process runs before serving (native_check._proven_in_child), here on the CPU:
    a failed read raises from an async and from a synchronous evaluation, in a child process
    whose pass is kept beside the build; nothing of it leaks into the evaluations after."""
    module, why = native_check.native_module()
    assert module is not None, why
    assert native_check.self_check(module, failures=True) == ""
    assert np.array(mx.arange(3) + 1).tolist() == [1, 2, 3]  # no failure left to surface
    proven = Path(module.__file__).with_suffix(".proven")
    proven.unlink(missing_ok=True)
    try:
        assert native_check._proven_in_child(module) == ""
        assert proven.read_text().strip() == "proven"
    finally:
        proven.unlink(missing_ok=True)


def test_routing_recorded_under_the_native_path_is_the_python_paths(checkpoints):
    """A recording (bench --corpus, expert-stream trace) keeps the native path: its ids stay on
    the device until the recorder reads them, two tokens later, and they are the routing the
    Python path records."""
    path = checkpoints("qwen3_moe", layers=2)
    prompt = prompt_ids(8)[0]
    traces = []
    for settings in (NATIVE, dict(policy="lru", online_budget=False, prefetch=False)):
        _, streamed, handle = load_pair(path, **settings)
        with handle.recording() as recorder:
            logprobs(streamed, prompt, 12)
        assert native_served(handle) == (settings is NATIVE)
        traces.append(recorder.trace())
        handle.close()
    assert np.array_equal(traces[0].ids, traces[1].ids) and np.array_equal(traces[0].phase, traces[1].phase)
    assert int(traces[0].phase.sum()) >= 10  # the decode tokens are in it
