"""What `expert-stream plan` predicts a budget decodes at, from measurements on this machine:

    t_token = t_compute + miss_rate(budget) * bytes_of_one_token's_experts / disk_bandwidth

t_compute is timed: with a budget that holds every expert when they are small enough to read
in seconds (the engine's own path when nothing can miss), else with the smallest budget and
every expert lookup forced to hit (the same kernels, no reads; what `bench` does when stock
does not fit). The forced path runs layer by layer, a sync per layer, so it errs slow.
miss_rate comes from a routing trace when one is given (expert-stream trace; the default policy
and LRU replayed at each budget), else from two labelled assumptions: uniform routing (the
conservative end: each expert equally likely, so a layer holding s of E experts misses 1 - s/E)
and routing that repeats what is resident (the optimistic end: compute only)."""

from __future__ import annotations

import time
from pathlib import Path

# Decode steps timed for t_compute, after a warm-up (kernels compile on the first calls).
COMPUTE_PROMPT_TOKENS = 16
COMPUTE_DECODE_STEPS = 16
# Experts up to this size are all loaded for the timing (a few seconds of reads at SSD speeds).
ALL_RESIDENT_MAX_BYTES = 4 << 30


def measure_compute(model_dir: Path, budget_gib: float, forced: bool, trust_remote_code: bool = False) -> float:
    """Seconds per decode token with every expert resident (forced: every lookup made a hit)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    import expert_stream
    from expert_stream.streaming.lab.bench import vocab_size

    model, _, handle = expert_stream.load(model_dir, budget_gib=budget_gib, prefetch=False,
                                          trust_remote_code=trust_remote_code)
    try:
        for layer in handle.layers:
            layer.time_compute_only(forced)
        rng = np.random.default_rng(0)
        prompt = mx.array(rng.integers(3, vocab_size(model) - 1, COMPUTE_PROMPT_TOKENS), dtype=mx.int32)
        for _ in generate_step(prompt[::-1], model, max_tokens=2):
            pass
        # The median step: on a shared machine a few steps take twice as long as the rest.
        steps, last = [], None
        for _ in generate_step(prompt, model, max_tokens=COMPUTE_DECODE_STEPS + 1):
            now = time.perf_counter()
            if last is not None:
                steps.append(now - last)
            last = now
        return float(np.median(steps))
    finally:
        handle.close()


def trace_miss_rates(trace_path: Path, shares: list[float]) -> dict[float, tuple[float, float]]:
    """share of experts held -> (miss rate of the default policy, of LRU) on the trace's decode."""
    from expert_stream.streaming.lab.policy_sim import simulate
    from expert_stream.streaming.traces import load_trace

    trace = load_trace(Path(trace_path).expanduser())
    return {share: (1 - simulate(trace, "default", share)["hit_rate"] / 100,
                    1 - simulate(trace, "lru", share)["hit_rate"] / 100) for share in shares}


def predict(t_compute: float, token_expert_bytes: int, bandwidth_gbps: float, miss_low: float,
            miss_high: float) -> tuple[float, float]:
    """(slowest, fastest) tok/s for a miss rate between miss_low and miss_high."""
    def rate(miss):
        return 1 / (t_compute + miss * token_expert_bytes / (bandwidth_gbps * 1e9))

    return rate(miss_high), rate(miss_low)
