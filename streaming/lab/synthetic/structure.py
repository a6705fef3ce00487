"""Where things live in an mlx-lm model, found by module type rather than by name: experts sit at
`mlp.switch_mlp`, `mlp.experts`, `block_sparse_moe.switch_mlp`, `mixer.switch_mlp`, ... depending
on the family, but they are always SwitchLinear / QuantizedSwitchLinear modules."""

from __future__ import annotations

import re
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

# A router is the matrix that scores experts: `mlp.gate`, `mlp.router`, `mlp.gate.proj`
# (laguna), `block_sparse_moe.gate`, `mixer.gate` (a raw parameter in DeepSeek-style MoEGate)...
# but not a dense `gate_proj` nor the (1, hidden) `shared_expert_gate`.
_ROUTER_PATH = re.compile(r"(^|\.)(gate|router|wg)(\.\w+)?$")


def is_expert_module(module: nn.Module) -> bool:
    return isinstance(module, (SwitchLinear, QuantizedSwitchLinear))


def direct_params(module: nn.Module) -> Iterator[tuple[str, mx.array]]:
    """The arrays a module holds itself (not its children's), as `parameters()` sees them."""
    for name, value in module.items():
        if isinstance(value, mx.array) and not name.startswith("_"):
            yield name, value


def iter_params(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, mx.array]]:
    """(module path, module, parameter name, array) for every parameter of `model`."""
    for path, module in model.named_modules():
        for name, value in direct_params(module):
            yield path, module, name, value


def routed_expert_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(path, module) of the stacked linears inside SwitchGLU / SwitchMLP blocks: the routed
    experts. A SwitchLinear elsewhere is not one (deepseek_v41's grouped attention output
    projection `o_a_proj` is a SwitchLinear over o_groups)."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    for path, block in model.named_modules():
        if isinstance(block, (SwitchGLU, SwitchMLP)):
            for sub, module in block.named_modules():
                if is_expert_module(module):
                    yield f"{path}.{sub}" if path else sub, module


def expert_counts(model: nn.Module) -> set[int]:
    return {m["weight"].shape[0] for _, m in routed_expert_modules(model)}


def is_router(path: str, module: nn.Module, name: str, value: mx.array, experts: set[int]) -> bool:
    return (
        name == "weight"
        and value.ndim == 2
        and value.shape[0] in experts
        and not is_expert_module(module)
        and _ROUTER_PATH.search(path) is not None
    )


def expert_param_names(model: nn.Module) -> set[str]:
    """Full names of every tensor that belongs to a routed expert block (weights, scales,
    biases, per-expert bias)."""
    out = set()
    for path, module in routed_expert_modules(model):
        for name, _ in direct_params(module):
            out.add(f"{path}.{name}")
    return out
