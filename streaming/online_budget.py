"""Online per-layer budgets: slots move between streamed layers as their measured hit curves
say (budget.HitCurve, budget.rebalance), with no trace needed.

Every REBALANCE_EVERY calls of the first layer, new slot targets are set for all layers (same
total). A layer reaches its target at its own next call whose routing comes to the host: a
layer that shrinks evicts by its policy and gives its freed slots to a pool, and a layer that
grows takes from that pool only, so the slots of all layers never exceed the budget. A resize
copies the kept experts into new slot arrays (ExpertSlots.resize); graphs still pending keep
the old ones.
"""

from __future__ import annotations

from .budget import REBALANCE_EVERY, rebalance


class OnlineBudget:
    def __init__(self, streams, floor: int):
        self.streams = streams
        self.floor = floor  # slots a layer needs at least: one token's experts
        self.target = {s: s.cache.num_slots for s in streams}
        self.pool = 0  # slots freed by shrunk layers, not yet taken by growing ones
        self._next = REBALANCE_EVERY
        self.moves = 0  # slots moved (stats)

    @classmethod
    def for_streams(cls, streams, floor: int):
        """An online budget over `streams`, or None when there is nothing to move: fewer than
        two layers, or layers whose experts differ in size (a slot of one is not a slot of
        another)."""
        if len(streams) < 2:
            return None
        if len({s.slots.nbytes // s.slots.num_slots for s in streams}) > 1:
            return None
        return cls(streams, floor)

    def apply(self, stream, compute) -> None:
        """Before a streamed layer (its ExpertStore and ExpertCompute) computes a call whose
        routing is on the host."""
        if stream is self.streams[0] and stream.cache.step >= self._next:
            self._next = stream.cache.step + REBALANCE_EVERY
            caches = [s.cache for s in self.streams]
            new = rebalance([c.curve for c in caches], [self.target[s] for s in self.streams], self.floor)
            self.target = {s: min(n, s.cache.num_experts) for s, n in zip(self.streams, new)}
        have, want = stream.cache.num_slots, self.target[stream]
        if want < have:
            self._resize(stream, compute, want)
            self.pool += have - want
        elif want > have and self.pool:
            grow = min(want - have, self.pool)
            self._resize(stream, compute, have + grow)
            self.pool -= grow

    def _resize(self, stream, compute, slots: int) -> None:
        stream.await_prefetch()  # its bytes land in the current arrays
        stream.reap()
        self.moves += abs(slots - stream.cache.num_slots)
        rows = stream.cache.resize(slots)
        stream.slots.resize(rows)
        compute.use(stream.slots)

    def slots(self) -> list[int]:
        return [s.cache.num_slots for s in self.streams]
