"""What LRU and Belady would have missed on the routing a run recorded (benchmark lab code).

The engine's routing during the timed decode is recorded (`handle.recording()`); each streamed
layer's cache is captured when the timed decode begins (its slot count, the experts it holds,
its policy's state). The trace simulator (streaming/lab/policy_sim.py) then replays the
recorded decode rows from that state with the same slots per layer:
- lru: LRU with the engine's recency order at that moment (every policy keeps the same
  recency stamps, so this is the LRU that would have held these experts in this order);
- belady: the offline optimum over the same rows, from the same experts;
- the engine's own policy (when it is another one): a copy of its state.
Slots the online budget moves during the run are not followed: the slot counts are those at
the start (the report says when they moved).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from ..policy import POLICIES, EvictionPolicy, make_policy
from .policy_sim import BeladyPolicy, simulate_layer


@dataclass
class CacheState:
    """One streamed layer's cache as the timed decode began."""

    slots: int
    resident: np.ndarray  # experts in a slot
    policy: EvictionPolicy  # a copy of the engine's policy (its history)


def capture(handle) -> list[CacheState]:
    """Each streamed layer's cache now, in the handle's (and the recorder's) layer order."""
    states = []
    for s in handle.streams:
        cache = s.cache
        held = cache.expert_in[cache.expert_in >= 0].astype(np.int64)
        states.append(CacheState(cache.num_slots, held, copy.deepcopy(cache.policy.policy)))
    return states


def _start(name: str, state: CacheState, ids: np.ndarray) -> EvictionPolicy:
    engine = state.policy
    if name == "belady":
        return BeladyPolicy(engine.num_experts, state.slots, ids)
    if type(engine) is POLICIES.get(name):
        return copy.deepcopy(engine)
    if name != "lru":
        raise ValueError(f"policy {name!r} has no state to start from here (lru, belady or the engine's own)")
    lru = make_policy("lru", engine.num_experts, state.slots)
    lru.stamp[:] = engine.stamp
    lru.clock = engine.clock
    return lru


def simulated_misses(rows: np.ndarray, states: list[CacheState], policies=("lru", "belady")) -> dict:
    """{policy: misses per row, all layers summed} over `rows` (tokens, layers, top_k)."""
    out = {}
    for name in policies:
        misses = 0
        for layer, state in enumerate(states):
            ids = np.asarray(rows[:, layer, :], dtype=np.int64)
            result = simulate_layer(ids, _start(name, state, ids), state.slots, initial=state.resident)
            misses += result.accesses - result.hits
        out[name] = misses / len(rows) if len(rows) else None
    return out
