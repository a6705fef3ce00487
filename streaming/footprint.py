"""What a checkpoint costs in memory, from headers and a lazily built model (no tensor data is
read): trunk bytes, routed-expert bytes per layer, the smallest budget that can stream it, and
its KV cache per token (kv_cost.py), and what a layer-major prefill holds per prompt token
(prompt_pass.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .architectures import ArchitectureSpec, find_expert_blocks, spec_for
from .checkpoint import CheckpointIndex
from .errors import NotMoEError
from .kv_cost import KVCost, kv_cost
from .prompt_pass import activation_bytes
from .settings import GIB
from .slots import expert_bytes


@dataclass(frozen=True)
class Footprint:
    model_dir: Path
    model_type: str
    total_bytes: int
    expert_bytes: int  # all routed experts of all layers
    layer_expert_bytes: tuple[int, ...]  # one expert of each MoE layer, all its tensors
    num_experts: tuple[int, ...]
    top_k: int | None
    # tensors on disk that stock mlx-lm's sanitize drops at load (an MTP head, a vision tower)
    dropped_bytes: int = 0
    kv: KVCost | None = None  # one sequence's caches by its length
    prefill_token_bytes: int = 0  # activations a layer-major prefill holds per prompt token

    @property
    def loaded_bytes(self) -> int:
        """What stock mlx-lm holds in memory: trunk and every expert."""
        return self.total_bytes - self.dropped_bytes

    @property
    def trunk_bytes(self) -> int:
        return self.loaded_bytes - self.expert_bytes

    @property
    def bytes_per_slot_row(self) -> int:
        """One slot in every MoE layer."""
        return sum(self.layer_expert_bytes)

    @property
    def min_budget_bytes(self) -> int:
        """The smallest budget: one token's experts in every layer."""
        return (self.top_k or 1) * self.bytes_per_slot_row

    @property
    def min_budget_gib(self) -> float:
        return self.min_budget_bytes / GIB

    def budget_gib_for_slots(self, slots: int) -> float:
        return slots * self.bytes_per_slot_row / GIB

    @property
    def token_expert_bytes(self) -> int:
        """Bytes of experts one decode token touches (top_k per layer)."""
        return self.min_budget_bytes


def checkpoint_footprint(
    path: str | Path, architectures: list[ArchitectureSpec] | None = None, trust_remote_code: bool = False
) -> Footprint:
    """Sizes of a checkpoint's trunk and experts, from its headers and a lazily built model
    (`trust_remote_code`: the caller checked that its `model_file`, if any, may run)."""
    index, model, spec, layers = expert_layers(path, architectures, trust_remote_code)
    return measure(index, model, spec, layers)


def measure(index: CheckpointIndex, model, spec: ArchitectureSpec, layers: list) -> Footprint:
    """The footprint of a lazily built, never evaluated `model` whose MoE layers hold `layers`
    (each an ExpertTensor list). Calls the model lazily to size its caches: before any block
    is swapped for a streamed one (a streamed layer reads its routing)."""
    per_layer = tuple(expert_bytes(t) for t in layers)
    counts = tuple(t[0].num_experts for t in layers)
    return Footprint(
        model_dir=index.model_dir,
        model_type=index.model_type,
        total_bytes=index.total_bytes(),
        expert_bytes=sum(b * n for b, n in zip(per_layer, counts)),
        layer_expert_bytes=per_layer,
        num_experts=counts,
        top_k=spec.experts_per_token(index.config),
        dropped_bytes=index.total_bytes() - _loaded_bytes(index, model, spec),
        kv=kv_cost(model, index.config),
        prefill_token_bytes=activation_bytes(model, index.config, spec.experts_per_token(index.config)),
    )


def expert_layers(path, architectures=None, trust_remote_code: bool = False):
    """-> (index, lazily built model, spec, each MoE layer's ExpertTensor list), no data read."""
    from mlx_lm.utils import load_model

    from .load_checks import LoadHooks, check_checkpoint
    from .expert_layout import expert_tensors
    from .remote_code import trusted

    index = check_checkpoint(path, None, str(path), LoadHooks(architectures), trust_remote_code)
    model, _ = load_model(index.model_dir, lazy=True, **trusted(load_model, trust_remote_code))
    spec = spec_for(index.model_type, architectures)
    blocks = find_expert_blocks(model, spec)
    if not blocks:
        raise NotMoEError(f"{index.model_dir}: model_type {index.model_type!r} has no routed-expert layers")
    return index, model, spec, [expert_tensors(index, p, b, spec) for p, b in blocks]


def _loaded_bytes(index: CheckpointIndex, model, spec: ArchitectureSpec) -> int:
    """Bytes of the checkpoint's tensors the model holds: each parameter's tensor, found as the
    engine finds expert tensors. A converted checkpoint stores parameters under their names, so
    what no parameter claims is what sanitize drops (MTP layers, vision towers, tied heads)."""
    from mlx.utils import tree_flatten

    claimed = {}
    for name, _ in tree_flatten(model.parameters()):
        info = index.find(name, spec.key_candidates(name))
        if info is not None:
            claimed[info.name] = info.nbytes
    return sum(claimed.values())
