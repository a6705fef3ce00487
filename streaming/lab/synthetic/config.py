"""Assemble a checkpoint's config.json (before quantization adds its block): the preset's text
config at the chosen sizes, the caller's overrides, and the mlx-vlm wrapping when asked for."""

from __future__ import annotations

import math

import mlx.core as mx

from .errors import SyntheticError
from .preset import Dims, Preset, deep_merge

# Dummy vision tower of a VLM export: a few small tensors that the family's sanitize drops, so
# the engine sees the non-text tensors real mlx-vlm exports carry.
_VISION_HIDDEN = 64


def text_config(config: dict) -> dict:
    """The part of a config that describes the language model."""
    return config.get("text_config", config)


def build_config(
    preset: Preset, dims: Dims, *, overrides: dict | None, vlm_layout: bool, dtype: str
) -> dict:
    config = preset.build(dims)
    text = text_config(config)
    if overrides:
        merged = deep_merge(text, overrides)
        text.clear()
        text.update(merged)
    if preset.finalize is not None:
        preset.finalize(text)
    if preset.max_layers is not None and text["num_hidden_layers"] > preset.max_layers:
        raise SyntheticError(
            f"{preset.name}: {text['num_hidden_layers']} layers is more than stock mlx-lm can "
            f"load ({preset.max_layers}); its sanitize drops the tensors of layer "
            f"{preset.max_layers} (the real model's MTP layer). Use fewer, wider layers."
        )
    config["torch_dtype"] = dtype
    if not vlm_layout:
        return config
    if preset.vlm is None:
        raise SyntheticError(
            f"--vlm-layout is not available for {preset.name}: stock mlx-lm has no "
            f"`language_model.` layout for it (no VLM wrapper class, and its sanitize does not "
            f"strip the prefix), so such a checkpoint would not load"
        )
    vlm = preset.vlm
    if vlm.kind == "wrapper":
        text = dict(config)
        text.pop("architectures", None)
        text.pop("torch_dtype", None)
        text["model_type"] = vlm.text_model_type
        config = {
            "architectures": list(vlm.architectures),
            "model_type": vlm.model_type,
            "text_config": text,
            "vocab_size": text["vocab_size"],  # gemma4's wrapper hands its own to the text model
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
        }
    if vlm.vision_prefix is not None:
        config["vision_config"] = {
            "model_type": f"{config['model_type']}_vision",
            "hidden_size": _VISION_HIDDEN,
            "depth": 1,
            "patch_size": 4,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "out_hidden_size": text_config(config)["hidden_size"],
        }
    return config


def vision_tensors(config: dict, prefix: str, seed: int, dtype) -> dict[str, mx.array]:
    """Small random tensors of a dummy vision tower under `prefix` (lazy)."""
    hidden = text_config(config)["hidden_size"]
    patch = 3 * 2 * 4 * 4
    shapes = {
        f"{prefix}.patch_embed.proj.weight": (_VISION_HIDDEN, patch),
        f"{prefix}.blocks.0.norm1.weight": (_VISION_HIDDEN,),
        f"{prefix}.blocks.0.attn.qkv.weight": (3 * _VISION_HIDDEN, _VISION_HIDDEN),
        f"{prefix}.merger.mlp.0.weight": (hidden, 4 * _VISION_HIDDEN),
    }
    from .weights import key_for

    out = {}
    for name, shape in shapes.items():
        s = 1 / math.sqrt(shape[-1])
        out[name] = mx.random.uniform(-s, s, shape, key=key_for(seed, name)).astype(dtype)
    return out
