"""Splitting the expert budget over MoE layers: how many slots each layer gets."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import BudgetError
from .settings import GIB, StreamSettings
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
    settings: StreamSettings,
    top_k: int | None,
    model_dir: Path,
    hit_curves: list | None = None,
) -> list[LayerPlan]:
    """Slots per layer: evenly (as many in every layer as the budget pays for), or, given
    measured hit curves (warm_start.lru_hit_curve per layer), where they gain the most hits."""
    sizes = [expert_bytes(tensors) for _, tensors in layers]
    counts = [tensors[0].num_experts for _, tensors in layers]
    per_slot_row = sum(sizes)  # one slot in every layer
    slots = settings.budget_bytes // per_slot_row
    need = max(top_k or 1, 1)
    if slots < need:
        smallest = need * per_slot_row / GIB
        raise BudgetError(
            f"{model_dir}: budget_gib={settings.budget_gib} pays for {slots} expert slot(s) per "
            f"MoE layer, but each token is routed to {need} experts in every one of the "
            f"{len(layers)} MoE layers; the smallest budget is {smallest:.3f} GiB"
        )
    per_layer = [slots] * len(layers)
    if hit_curves is not None:
        per_layer = slots_from_curves(hit_curves, sizes, settings.budget_bytes, need)
    return [
        LayerPlan(
            path=path,
            num_experts=count,
            num_slots=min(n, count),
            expert_bytes=size,
            resident=settings.resident and n >= count,
        )
        for (path, _), size, count, n in zip(layers, sizes, counts, per_layer)
    ]
