"""What other eviction policies would have missed on a replayed run (benchmark lab code): the
project's trace simulator (streaming/lab/policy_sim.py) fed with exactly the trace rows the run
replayed, in the order it replayed them (warm-up and prefill included, uncounted), with each
streamed layer's own slot count. Only the counted rows (the timed decode) are scored."""

from __future__ import annotations

import numpy as np

from ..policy import make_policy
from .policy_sim import BeladyPolicy, simulate_layer
from .replay import RoutingReplay


def simulated_misses(replay: RoutingReplay, layers: list[tuple[int, int]], policies=("lru", "belady")) -> dict:
    """{policy: misses per counted token, summed over `layers`} for (MoE layer index, slots)
    pairs; "belady" is the offline optimum over the same rows."""
    rows, counted = replay.counted_rows()
    tokens = int(counted.sum())
    num_experts = int(replay.trace.num_experts)
    memo: dict[tuple, int] = {}
    out = {}
    for name in policies:
        misses = 0
        for layer, slots in layers:
            column = replay.columns[layer]
            key = (name, column, slots)
            if key not in memo:
                ids = replay.ids[rows, column, :]
                policy = (BeladyPolicy(num_experts, slots, ids) if name == "belady"
                          else make_policy(name, num_experts, slots))
                result = simulate_layer(ids, policy, slots, counted)
                memo[key] = result.accesses - result.hits
            misses += memo[key]
        out[name] = misses / tokens if tokens else None
    return out


def phase_share(replay: RoutingReplay) -> float | None:
    """Share of the counted rows that were decode tokens in the trace (None: no phase)."""
    phase = replay.trace.phase
    rows, counted = replay.counted_rows()
    if phase is None or not counted.any():
        return None
    return float(np.mean(phase[rows[counted]] == 1))
