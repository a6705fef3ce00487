"""A read that fails leaves no slot claiming bytes it did not receive: after any failed read, on
every path that reads (layer-by-layer decode with overlap, lookahead prefetch, prefill sweep
with adoption, warm start), the next request's logits are stock's, bitwise.

The faults come from a reader that, from its Nth batch on, scribbles over the destinations (as a
short or corrupt read would) and raises ReadError, until it is healed: the way a truncated shard
that is restored afterwards behaves."""

from __future__ import annotations

import concurrent.futures

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from exactness import assert_same_logits, load_pair, prompt_ids
from expert_stream.streaming.errors import ReadError
from expert_stream.streaming.traces import RoutingTrace
from expert_stream.streaming.warm_start import preload


class FailingReader:
    """Wraps the model's ExpertReader; batch number `fail_from` and later ones fail."""

    def __init__(self, inner):
        self.inner = inner
        self.batches = 0
        self.fail_from = None
        self.only_one = False  # only batch `fail_from` fails: a transient fault
        self.failed = 0  # batches failed so far

    def submit(self, requests):
        self.batches += 1
        if self.fail_from is None or self.batches < self.fail_from or self.only_one and self.batches > self.fail_from:
            return self.inner.submit(requests)
        self.failed += 1
        future = concurrent.futures.Future()
        for _file, _offset, _length, dest in requests:  # what a short read of a changed file leaves
            np.frombuffer(memoryview(dest).cast("B"), dtype=np.uint8)[:] = 0xA5
        future.set_exception(ReadError(f"injected failure of batch {self.batches}"))
        return future

    def __getattr__(self, name):
        return getattr(self.inner, name)


def with_failing_reader(handle) -> FailingReader:
    faulty = FailingReader(handle.reader)
    for s in handle.streams:
        s.reader = faulty
    return faulty


def run_until_failure(model, faulty, fail_from, prompt_len, decode_steps, seed):
    """One request (prefill, then greedy decode) with reads failing from batch `fail_from` on."""
    faulty.batches, faulty.fail_from = 0, fail_from
    cache = make_prompt_cache(model)
    try:
        logits = model(prompt_ids(prompt_len, seed=seed), cache=cache)
        for _ in range(decode_steps):
            token = mx.argmax(logits[:, -1:], axis=-1)
            logits = model(token, cache=cache)
            mx.eval(logits)
        mx.eval(logits)
    except ReadError:
        return True
    finally:
        faulty.fail_from = None
    return False


# (settings, prompt length, share of experts in the cache): each reaches another reading path.
PATHS = {
    "decode-overlap": (dict(prefetch=False), 4, None),
    "decode-half-budget": (dict(prefetch=False), 4, 0.5),
    "prefetch": (dict(prefetch=True), 4, None),
    "sweep-adoption": (dict(prefetch=False), 48, None),
    "staged-writes": (dict(prefetch=True, slot_write="staged"), 48, None),
}


@pytest.mark.parametrize("path_name", list(PATHS))
def test_failed_reads_leave_no_wrong_slot(checkpoints, path_name):
    settings, prompt_len, share = PATHS[path_name]
    path = checkpoints("qwen3_moe", layers=3)
    slots = None if share is None else int(share * 16)
    stock, streamed, handle = load_pair(path, slots=slots, **settings)
    faulty = with_failing_reader(handle)
    failures = 0
    for i, fail_from in enumerate((1, 2, 3, 5, 8, 13)):
        failures += run_until_failure(streamed, faulty, fail_from, prompt_len, decode_steps=6, seed=10 + i)
        assert_same_logits(stock, streamed, prompt_ids(prompt_len + 3, seed=i), decode_steps=6)
    assert failures >= 3, f"only {failures} requests met a failing read: the test reads too little"
    if path_name == "prefetch":
        assert handle.stats()["totals"]["prefetch_reads"] > 0
    if path_name.startswith("decode"):
        assert handle.stats()["totals"]["overlap_calls"] > 0
    if path_name.startswith("sweep") or prompt_len > 16:
        assert handle.stats()["totals"]["sweep_calls"] > 0
    handle.close()


def test_failed_warm_start_reads_leave_no_wrong_slot(checkpoints):
    path = checkpoints("qwen3_moe", layers=3)
    stock, streamed, handle = load_pair(path, slots=8, prefetch=False)
    faulty = with_failing_reader(handle)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 16, (64, len(handle.streams), 4)).astype(np.int16)
    trace = RoutingTrace(ids=ids, layer_ids=np.arange(len(handle.streams)), num_experts=16)
    for fail_from in (1, 2, 3):
        faulty.batches, faulty.fail_from = 0, fail_from
        with pytest.raises(ReadError):
            preload(handle.streams, trace, list(range(len(handle.streams))))
        faulty.fail_from = None
        assert_same_logits(stock, streamed, prompt_ids(9, seed=fail_from), decode_steps=4)
    handle.close()


def test_a_failed_readahead_is_read_again_in_the_sweep(checkpoints):
    """A layer-major pass reads a chunk's experts as its routing arrives; when such a read fails
    once, the layer's sweep reads those experts itself: the prompt prefills without an error,
    stock's bits. A failed read of the sweep's own raises; the next request is stock's."""
    import importlib

    generate = importlib.import_module("mlx_lm.generate")
    path = checkpoints("qwen3_moe", layers=3)
    stock, streamed, handle = load_pair(path, prefill_step=12, prefetch=False)
    faulty = with_failing_reader(handle)
    prompt = prompt_ids(49, seed=30)[0]

    def first_steps(model):
        steps = generate.generate_step(prompt, model, max_tokens=3, prefill_step_size=12)
        return [np.array(logprobs.astype(mx.float32)) for _, logprobs in steps]

    expected = first_steps(stock)
    recovered = raised = 0
    faulty.only_one = True
    for fail_from in range(1, 13):
        faulty.batches, faulty.fail_from, faulty.failed = 0, fail_from, 0
        try:
            got = first_steps(streamed)
        except ReadError:
            raised += 1
        else:
            assert all(np.array_equal(a, b) for a, b in zip(expected, got)), f"batch {fail_from} failed: logits differ"
            recovered += faulty.failed  # only a read ahead may fail without an error: its sweep read again
        finally:
            faulty.fail_from = None
        assert all(np.array_equal(a, b) for a, b in zip(expected, first_steps(streamed)))
    assert recovered >= 1 and raised >= 1, (recovered, raised)
    handle.close()
