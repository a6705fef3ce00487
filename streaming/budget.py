"""Splitting the expert budget over MoE layers: how many slots each layer gets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .slots import ExpertTensor, expert_bytes
from .warm_start import slots_from_curves


@dataclass(frozen=True)
class LayerPlan:
    path: str
    num_experts: int
    num_slots: int
    expert_bytes: int  # one expert, all its tensors
    resident: bool  # left as a stock block: all experts fit in this layer's share

    @property
    def slot_bytes(self) -> int:
        return self.num_slots * self.expert_bytes


def plan_layers(
    layers: list[tuple[str, list[ExpertTensor]]],
    budget_bytes: int,
    resident: bool,
    top_k: int | None,
    hit_curves: list | None = None,
) -> list[LayerPlan]:
    """Slots per layer: evenly (as many in every layer as the budget pays for), or, given
    measured hit curves (warm_start.lru_hit_curve per layer), where they gain the most hits.
    The budget holds one token's experts in every layer (load_checks.check_budget said so).
    `resident`: a layer whose share holds all its experts stays a stock block."""
    sizes = [expert_bytes(tensors) for _, tensors in layers]
    counts = [tensors[0].num_experts for _, tensors in layers]
    need = max(top_k or 1, 1)
    per_layer = [budget_bytes // sum(sizes)] * len(layers)  # one slot in every layer, as many as it pays for
    if hit_curves is not None:
        per_layer = slots_from_curves(hit_curves, sizes, budget_bytes, need)
    return [
        LayerPlan(
            path=path,
            num_experts=count,
            num_slots=min(n, count),
            expert_bytes=size,
            resident=resident and n >= count,
        )
        for (path, _), size, count, n in zip(layers, sizes, counts, per_layer)
    ]


class HitCurve:
    """One layer's hit curve measured as it serves: ``hist[d]`` counts accesses whose LRU stack
    distance was d (the expert was the d-th most recent; ``num_experts + 1``: first use), so an
    LRU cache of c slots would have hit ``hist[1:c + 1].sum()`` of them. Counts halve every
    ``half_life`` calls, so the curve follows the routing as the text drifts."""

    def __init__(self, num_experts: int, half_life: int = 4096):
        self.num_experts = num_experts
        self.half_life = half_life
        self.hist = np.zeros(num_experts + 2)
        self._stamp = np.full(num_experts, -1, dtype=np.int64)
        self._calls = 0

    def record(self, experts: np.ndarray) -> None:
        st = self._stamp[experts]
        d = (self._stamp[None, :] > st[:, None]).sum(axis=1) + 1
        d[st < 0] = self.num_experts + 1
        np.add.at(self.hist, d, 1.0)
        self._calls += 1
        self._stamp[experts] = self._calls
        if not self._calls % self.half_life:
            self.hist *= 0.5

    def gain(self, slots: int) -> float:
        """Hits one more slot would have added."""
        return float(self.hist[slots + 1]) if slots < self.num_experts else -1.0

    def loss(self, slots: int) -> float:
        """Hits one slot fewer would have cost."""
        return float(self.hist[slots])


# Slots move from the layer that one slot fewer costs least to the layer that one more gains
# most, while the gain is above RATIO times the loss (a move evicts an expert the losing layer
# may read again: without the margin, noise in the curves' flat tails moved a tenth of all
# slots every 256 tokens and cost more misses than it saved), at most MAX_MOVES per rebalance.
# Measured on the llama4 trace (12,000 decode tokens, LRU): every 64 tokens, up to 8 moves,
# ratio 1.5 or 2: -9% misses at 25% capacity, -17% at 50%; greedy reallocation from the whole
# curves every 256 tokens: -7% and +4%.
REBALANCE_EVERY = 64
RATIO = 1.5
MAX_MOVES = 8


def rebalance(curves: list[HitCurve], slots: list[int], floor: int) -> list[int]:
    """New slot counts (same total) for layers of equal expert size, given their hit curves."""
    slots = list(slots)
    for _ in range(MAX_MOVES):
        gains = [c.gain(s) for c, s in zip(curves, slots)]
        losses = [c.loss(s) if s > floor else np.inf for c, s in zip(curves, slots)]
        to, frm = int(np.argmax(gains)), int(np.argmin(losses))
        if to == frm or gains[to] <= 0 or gains[to] <= RATIO * losses[frm]:
            break
        slots[to] += 1
        slots[frm] -= 1
    return slots
