"""The slot targets of one model's streamed layers, and how slots move to meet them.

Two things move slots: online rebalancing (the `online_budget` setting: every REBALANCE_EVERY
calls of the first layer, slots move between layers of equal expert size by the hit curves they
measure, budget.rebalance, same total), and a change of the model's budget (`set_capacity`:
another model loaded or unloaded beside it, so the bytes all its slots may hold change, and the
targets are recomputed: fewer slots where one slot fewer costs least, more where one more gains
most, by the hit curves where every layer has one, else evenly).

A layer reaches its target at its own next call: a layer that shrinks evicts by its policy, and
a layer grows only into bytes that are free under the capacity, so the slots of all layers never
exceed it once the shrinking layers have run. `apply_all` moves every layer at once, for a
caller that knows no forward pass runs (between two requests). A resize copies the kept experts
into new slot arrays (ExpertSlots.resize); graphs still pending keep the old ones.
"""

from __future__ import annotations

import threading

import numpy as np

from .budget import REBALANCE_EVERY, rebalance
from .errors import BudgetError
from .settings import GIB
from .slots import expert_bytes


class OnlineBudget:
    def __init__(self, layers, floor: int, capacity: int, rebalancing: bool):
        self.layers = layers  # StreamedSwitch of every streamed layer, in model order
        self.streams = [layer.store for layer in layers]
        self.floor = floor  # slots a layer needs at least: one token's experts
        self.size = {s: expert_bytes(s.slots.tensors) for s in self.streams}
        self.target = {s: s.cache.num_slots for s in self.streams}
        self.capacity = capacity  # bytes all these slots may hold, as applied
        self._asked = capacity  # the latest set_capacity (any thread); applied on the compute thread
        self._lock = threading.Lock()  # apply_all (a host's thread) against a layer's own call
        # Rebalance only between layers of equal expert size (a slot of one is not a slot of
        # another) that measure a hit curve (those that did not hold every expert at load).
        self.curved = [s for s in self.streams if s.cache.curve is not None]
        self.rebalancing = rebalancing and len(self.curved) >= 2 and len({self.size[s] for s in self.curved}) == 1
        self._next = REBALANCE_EVERY
        self.moves = 0  # slots moved (stats)

    @property
    def smallest(self) -> int:
        """The least capacity these layers can run with: `floor` slots each."""
        return sum(min(self.floor, s.cache.num_experts) * self.size[s] for s in self.streams)

    def held(self) -> int:
        return sum(s.cache.num_slots * self.size[s] for s in self.streams)

    def set_capacity(self, nbytes: int) -> None:
        """Ask for a new capacity (any thread); the layers follow at their next calls."""
        if nbytes < self.smallest:
            raise BudgetError(f"{nbytes / GIB:.4f} GiB of slots is below the {self.smallest / GIB:.4f} GiB these "
                              f"{len(self.streams)} layers need ({self.floor} slots each)")
        self._asked = int(nbytes)

    def apply(self, layer) -> None:
        """Before `layer` (a StreamedSwitch) computes a call. Every call of every streamed layer
        comes here: the common case (nothing to do) is three comparisons."""
        stream = layer.store
        rebalance_due = self.rebalancing and stream is self.curved[0] and stream.cache.step >= self._next
        if self._asked == self.capacity and self.target[stream] == stream.cache.num_slots and not rebalance_due:
            return
        with self._lock:
            if self._asked != self.capacity or rebalance_due:
                self._hand_back()
            if self._asked != self.capacity:
                self._retarget(self._asked)
            if rebalance_due:
                self._next = stream.cache.step + REBALANCE_EVERY
                new = rebalance([s.cache.curve for s in self.curved], [self.target[s] for s in self.curved], self.floor)
                self.target.update({s: min(n, s.cache.num_experts) for s, n in zip(self.curved, new)})
            self._follow(layer)

    def apply_all(self) -> None:
        """Move every layer to its target now: shrinking ones first, so the bytes they free
        are there for the growing ones. Only while no forward pass of the model runs."""
        with self._lock:
            if self._asked != self.capacity:
                self._hand_back()
                self._retarget(self._asked)
            order = sorted(self.layers, key=lambda layer: self.target[layer.store] - layer.store.cache.num_slots)
            for layer in order:
                self._follow(layer)

    def _hand_back(self) -> None:
        """The native decode path's resolutions queued so far have run: the hit curves read
        next are every layer's up to this call, as on the Python path (one wait per move)."""
        for layer in self.layers:
            if layer.native is not None:
                layer.native.hand_back()

    def _follow(self, layer) -> None:
        stream = layer.store
        have, want = stream.cache.num_slots, self.target[stream]
        if want < have:
            self._resize(layer, want)
        elif want > have:
            grow = min(want - have, (self.capacity - self.held()) // self.size[stream])
            if grow > 0:
                self._resize(layer, have + grow)

    def _retarget(self, capacity: int) -> None:
        """New targets for `capacity`, one slot at a time from the current ones: a slot comes off
        where it costs the fewest hits (else the layer with the most slots), and goes on where it
        gains the most (else the layer with the fewest), within each layer's floor and experts."""
        streams = self.streams
        target = np.array([self.target[s] for s in streams])
        size = np.array([self.size[s] for s in streams])
        experts = np.array([s.cache.num_experts for s in streams])
        floor = np.minimum(self.floor, experts)
        curves = [s.cache.curve for s in streams] if all(s.cache.curve is not None for s in streams) else None
        total = int((target * size).sum())
        while total > capacity:
            cost = np.array([c.loss(int(t)) for c, t in zip(curves, target)]) if curves else -target.astype(float)
            cost[target <= floor] = np.inf
            i = int(np.argmin(cost))
            target[i] -= 1
            total -= int(size[i])
        while True:
            fits = (target < experts) & (size <= capacity - total)
            if not fits.any():
                break
            gain = np.array([c.gain(int(t)) for c, t in zip(curves, target)]) if curves else -target.astype(float)
            gain[~fits] = -np.inf
            i = int(np.argmax(gain))
            target[i] += 1
            total += int(size[i])
        self.target = {s: int(t) for s, t in zip(streams, target)}
        self.capacity = capacity

    def _resize(self, layer, slots: int) -> None:
        stream = layer.store
        if layer.native is not None:
            layer.native.hand_back()  # no resolution may still run on the table being resized
        stream.await_prefetch()  # its bytes land in the current arrays
        stream.reap()
        self.moves += abs(slots - stream.cache.num_slots)
        rows = stream.cache.resize(slots)
        stream.slots.resize(rows)
        layer.compute.use(stream.slots)

    def slots(self) -> list[int]:
        return [s.cache.num_slots for s in self.streams]
