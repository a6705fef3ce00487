"""Which checkpoint tensors hold a block's stacked experts: the loader streams them, the
footprint counts them."""

from __future__ import annotations

import mlx.nn as nn
from mlx.utils import tree_flatten

from .architectures import ArchitectureSpec
from .checkpoint import CheckpointIndex
from .errors import CheckpointError
from .slots import ExpertTensor


def expert_tensors(index: CheckpointIndex, path: str, block: nn.Module, spec: ArchitectureSpec):
    """The checkpoint tensors behind a block's stacked expert parameters, checked against the
    model's shapes. Other parameters a block holds stay with the trunk (muse_spark keeps a
    norm, `experts.post_expert_norm`, inside its SwitchGLU). A plugin's block class without
    stacked linears streams all its parameters."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    stacked = {p for p, m in block.named_modules() if isinstance(m, (SwitchLinear, QuantizedSwitchLinear))}
    tensors = []
    for leaf, param in tree_flatten(block.parameters()):
        if stacked and leaf.rpartition(".")[0] not in stacked:
            continue
        full = f"{path}.{leaf}"
        info = index.find(full, spec.key_candidates(full))
        if info is None:
            unstacked = index.unstacked_experts_near(path)
            if unstacked:
                raise CheckpointError(
                    f"{index.model_dir}: experts are not stacked (found {unstacked[0]}, ...); "
                    "streaming needs the layout mlx_lm.convert writes: convert the checkpoint first"
                )
            raise CheckpointError(f"{index.model_dir}: tensor {full} not found in any shard")
        if tuple(info.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{index.files[info.file]}: tensor {info.name} has shape {list(info.shape)}, "
                f"the model expects {list(param.shape)}"
            )
        tensors.append(ExpertTensor(leaf, info))
    return tensors
