"""What the engine must know about an architecture: which modules are routed-expert blocks,
where their tensors live in the checkpoint, and (for lookahead) where the router and the norm in
front of it are. Plugins register `ArchitectureSpec`s; the generic spec covers every mlx-lm
model whose experts are a `SwitchGLU` or `SwitchMLP` (found by type, not by name: experts sit at
`mlp.switch_mlp`, `mlp.experts`, `block_sparse_moe.switch_mlp`, `feed_forward.experts`, ...)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

# Config keys that hold the number of experts each token is routed to, across mlx-lm models.
TOP_K_KEYS = (
    "num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k", "experts_per_token", "moe_k",
    "top_k_experts", "moe_top_k",  # gemma4_text, step3p5
)
# Names routers go by inside an MoE block, and the norms in front of the MoE block in a layer.
ROUTER_NAMES = ("gate", "router")
NORM_NAMES = ("post_attention_layernorm", "pre_feedforward_layernorm", "ffn_norm", "norm2", "norm")


def _key_candidates(param_path: str) -> list[str]:
    """Checkpoint keys a model parameter may be stored under: as named, or in the mlx-vlm text
    export layout where the language model sits under `language_model.`."""
    if param_path.startswith("language_model."):
        return [param_path, param_path[len("language_model."):]]
    return [param_path, "language_model." + param_path, "model.language_model." + param_path.removeprefix("model.")]


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one family of models looks to the engine.

    model_types: config `model_type` values this spec is for (empty: any, the generic fallback).
    expert_classes: module classes that hold stacked routed experts and are called as
        `block(x, indices)` like mlx-lm's SwitchGLU / SwitchMLP.
    key_candidates: model parameter path -> checkpoint keys to try, in order.
    top_k: config -> experts per token (None: read TOP_K_KEYS).
    router: MoE block -> callable(x) returning router logits for x (for lookahead), or None.
    """

    name: str
    model_types: tuple[str, ...] = ()
    expert_classes: tuple[type, ...] = (SwitchGLU, SwitchMLP)
    key_candidates: Callable[[str], list[str]] = _key_candidates
    top_k: Optional[Callable[[dict], Optional[int]]] = None
    router: Optional[Callable[[nn.Module], Optional[Callable]]] = None
    notes: str = field(default="", compare=False)

    def experts_per_token(self, config: dict) -> Optional[int]:
        if self.top_k is not None:
            return self.top_k(config)
        for source in (config, config.get("text_config") or {}):
            for key in TOP_K_KEYS:
                if isinstance(source.get(key), int):
                    return source[key]
        return None


# MoE families of mlx-lm that cannot stream, and why (one sentence each, shown to the user).
UNSTREAMABLE = {
    "dbrx": "mlx-lm builds its experts as one MLP module per expert, not one stacked SwitchGLU, "
    "so no expert is a byte range of a stacked tensor",
}


def check_streamable(model_type: str, model_dir) -> None:
    """Refuse a family listed in UNSTREAMABLE, naming it and saying what to do."""
    from .errors import CheckpointError

    if model_type in UNSTREAMABLE:
        raise CheckpointError(
            f"{model_dir}: model_type {model_type!r} cannot stream: {UNSTREAMABLE[model_type]}; "
            "load it with mlx_lm.load (the whole model in memory) or without expert_stream settings"
        )


GENERIC = ArchitectureSpec(name="generic", notes="any mlx-lm model with SwitchGLU / SwitchMLP experts")


def spec_for(model_type: str, specs: list[ArchitectureSpec] | None) -> ArchitectureSpec:
    """The registered spec for model_type, else the generic one."""
    for spec in specs or ():
        if model_type in spec.model_types:
            return spec
    return GENERIC


def find_expert_blocks(model: nn.Module, spec: ArchitectureSpec) -> list[tuple[str, nn.Module]]:
    """(path, module) of every routed-expert block, in model order."""
    classes = spec.expert_classes
    return [(path, m) for path, m in model.named_modules() if isinstance(m, classes)][::-1]
