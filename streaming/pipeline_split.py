"""What each rank of mlx-lm's pipeline holds: its layers (the split of the model's own
`pipeline()`, run on a stand-in with no weights), trunk bytes and routed-expert bytes, from the
shard headers and a lazily built model (no tensor data is read)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from .architectures import ArchitectureSpec, check_streamable, find_expert_blocks, spec_for
from .checkpoint import CheckpointIndex
from .errors import NotMoEError
from .slots import expert_bytes

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # mlx-lm's own rule for a tensor's layer


@dataclass(frozen=True)
class RankShare:
    rank: int
    first_layer: int
    end_layer: int  # one past the last
    trunk_bytes: int  # its layers' non-expert tensors, plus embeddings, final norm, head (every rank)
    expert_bytes: int  # all routed experts of its MoE layers
    moe_layers: int
    slot_row_bytes: int  # one slot in each of its MoE layers
    top_k: int | None
    model_layers: int  # of the whole model (an uneven split of mlx-lm 0.31 can run past it)

    @property
    def min_budget_bytes(self) -> int:
        return (self.top_k or 1) * self.slot_row_bytes


class _Group:
    """What `pipeline()` asks of an mlx.distributed group: its rank and size."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def layer_ranges(model, ranks: int) -> list[tuple[int, int]]:
    """(first, end) layer of every rank, by the model's own `pipeline()` on a stand-in."""
    inner = model.model
    out = []
    for rank in range(ranks):
        stand_in = SimpleNamespace(layers=list(range(len(inner.layers))))
        type(inner).pipeline(stand_in, _Group(rank, ranks))
        out.append((stand_in.start_idx, stand_in.end_idx))
    return out


def rank_shares(path: str | Path, ranks: int, architectures: list[ArchitectureSpec] | None = None,
                trust_remote_code: bool = False) -> list[RankShare]:
    from mlx_lm.utils import load_model

    from .expert_layout import expert_tensors
    from .remote_code import trusted

    index = CheckpointIndex(path)
    check_streamable(index.model_type, index.model_dir)
    model, _ = load_model(index.model_dir, lazy=True, strict=False, **trusted(load_model, trust_remote_code))
    if not (hasattr(model, "model") and hasattr(model.model, "pipeline")):
        raise NotMoEError(f"{index.model_dir}: mlx-lm has no pipeline mode for model_type {index.model_type!r}; "
                          "it runs on one machine only")
    if not 1 <= ranks <= len(model.model.layers):
        raise NotMoEError(f"--ranks {ranks}: the model has {len(model.model.layers)} layers, one rank needs one")
    spec = spec_for(index.model_type, architectures)
    blocks = find_expert_blocks(model, spec)
    if not blocks:
        raise NotMoEError(f"{index.model_dir}: model_type {index.model_type!r} has no routed-expert layers")
    moe = {}  # layer -> (bytes of one expert, experts)
    expert_names = set()
    for block_path, block in blocks:
        tensors = expert_tensors(index, block_path, block, spec)
        expert_names |= {t.info.name for t in tensors}
        layer = int(LAYER.search(block_path).group(1))
        moe[layer] = (expert_bytes(tensors), tensors[0].num_experts)
    shared, per_layer = 0, {}
    for name, info in index.tensors.items():
        if name in expert_names:
            continue
        found = LAYER.search(name)
        if found is None:
            shared += info.nbytes
        else:
            per_layer[int(found.group(1))] = per_layer.get(int(found.group(1)), 0) + info.nbytes
    top_k = spec.experts_per_token(index.config)
    out = []
    for rank, (first, end) in enumerate(layer_ranges(model, ranks)):
        mine = [moe[i] for i in range(first, end) if i in moe]
        out.append(RankShare(
            rank=rank, first_layer=first, end_layer=end,
            trunk_bytes=shared + sum(per_layer.get(i, 0) for i in range(first, end)),
            expert_bytes=sum(b * n for b, n in mine), moe_layers=len(mine),
            slot_row_bytes=sum(b for b, _ in mine), top_k=top_k, model_layers=len(model.model.layers),
        ))
    return out
