"""What a synthetic preset is: the sizes a caller picks (`Dims`), a family's preset (`Preset`,
with its mlx-vlm layout and MTP head), and the helpers every family's config is built with."""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class Dims:
    """The sizes a caller chooses; everything else in a config derives from them."""

    layers: int
    experts: int
    top_k: int
    hidden: int
    moe_hidden: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return 32 if self.hidden <= 256 else 64

    @property
    def heads(self) -> int:
        return max(2, self.hidden // self.head_dim)

    @property
    def kv_heads(self) -> int:
        return max(1, self.heads // 2)

    @property
    def intermediate(self) -> int:
        """Width of the dense MLPs (dense first layers, shared experts' neighbours)."""
        return 2 * self.hidden

    @property
    def expert_groups(self) -> tuple[int, int]:
        """(n_group, topk_group) for grouped top-k routers (DeepSeek-V3 style): 4 groups, 2
        chosen, when the experts split evenly and the top-k still fits the chosen groups."""
        if self.experts % 4 == 0 and self.experts >= 8 and self.top_k <= self.experts // 2:
            return 4, 2
        return 1, 1


@dataclass(frozen=True)
class VlmLayout:
    """How the mlx-vlm text export of a family looks to stock mlx-lm.

    kind: "wrapper"  the config becomes a VLM wrapper (`model_type` below, the text config
                     nested in `text_config`) whose mlx-lm class holds `language_model`;
          "native"   the mlx-lm class already names everything `language_model.` (the
                     config is nested already); the export adds vision weights and config;
          "prefix"   same config; tensor names get a `language_model.` prefix that the
                     family's `sanitize` strips.
    vision_prefix: where dummy vision-tower tensors go (dropped by the family's sanitize),
                   or None when sanitize would not drop them (strict load would fail)."""

    kind: str
    model_type: Optional[str] = None
    architectures: tuple[str, ...] = ()
    text_model_type: Optional[str] = None
    vision_prefix: Optional[str] = "vision_tower"


@dataclass(frozen=True)
class Mtp:
    """Where a family's real export keeps its multi-token-prediction (MTP) head, which mlx-lm's
    `sanitize` drops at load. Names are full tensor names; "{n}" is num_hidden_layers.

    layer: prefix of the MTP decoder layer, written with the tensors of the model's last MoE
           layer (stacked experts, quantized as the trunk): the case where an index that went by
           names alone would find one more expert layer.
    norms: the head's norm vectors (hidden); projs: its linears (2 x hidden -> hidden)."""

    layer: str
    norms: tuple[str, ...] = ()
    projs: tuple[str, ...] = ()

    def names(self, layers: int) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        n = str(layers)
        return (self.layer.replace("{n}", n), tuple(x.replace("{n}", n) for x in self.norms),
                tuple(x.replace("{n}", n) for x in self.projs))


def deepseek_mtp(layer: str = "model.layers.{n}") -> Mtp:
    """DeepSeek-V3's layout (GLM-4.5, Step-3.5, Ling 2.5 alike): one more decoder layer after the
    last, with its embedding / hidden norms, their projection and the shared head's norm."""
    return Mtp(layer, norms=(f"{layer}.enorm.weight", f"{layer}.hnorm.weight", f"{layer}.shared_head.norm.weight"),
               projs=(f"{layer}.eh_proj",))


def qwen_mtp(root: str = "mtp") -> Mtp:
    """Qwen3.5's layout (MiMo-V2, LongCat, K-EXAONE alike): an `mtp` module beside the model."""
    return Mtp(f"{root}.layers.0", norms=(f"{root}.norm.weight", f"{root}.pre_fc_norm_embedding.weight",
                                          f"{root}.pre_fc_norm_hidden.weight"), projs=(f"{root}.fc",))


@dataclass(frozen=True)
class Preset:
    name: str
    build: Callable[[Dims], dict]
    layers: int = 2
    experts: int = 16
    top_k: int = 4
    hidden: int = 128
    moe_hidden: int = 64
    min_layers: int = 1
    # mlx-lm's deepseek_v3 sanitize drops every tensor of `model.layers.61` (the MTP layer of
    # the real model), so a checkpoint with more layers cannot load strictly.
    max_layers: Optional[int] = None
    quant_mode: str = "affine"  # the family's usual export: gpt-oss ships mxfp4 experts
    # Its usual bits and group size when the caller gives none (None: 4 bits, group 64).
    default_bits: Optional[int] = None
    default_group_size: Optional[int] = None
    vlm: Optional[VlmLayout] = None
    module: Optional[str] = None  # mlx_lm.models.<module>; defaults to the name
    notes: str = ""
    # Fixes up the text config after the caller's overrides (nemotron_h: the layer count
    # follows an overridden hybrid pattern) or rejects inconsistent overrides.
    finalize: Optional[Callable[[dict], None]] = None
    # The first mlx-lm that has the family (None: every supported one, 0.31 on).
    mlx_lm_since: Optional[str] = None
    # Stock mlx-lm runs the family through Metal-only kernels: no forward pass elsewhere.
    metal_only: bool = False
    # The MTP head the family's exports carry and its sanitize drops (text layout only).
    mtp: Optional[Mtp] = None
    # Turns the randomized model and its config into the family's export and quantizes it
    # (model, config, SynthSpec) -> config, instead of the usual quantization: Prism's
    # Hadamard-rotated packs.
    pack: Optional[Callable] = None

    def unavailable_reason(self) -> Optional[str]:
        """Why the installed mlx-lm cannot build this family, or None when it can."""
        if self.available():
            return None
        import mlx_lm

        since = f" (added in mlx-lm {self.mlx_lm_since})" if self.mlx_lm_since else ""
        return f"{self.name} needs mlx_lm.models.{self.module or self.name}{since}; mlx-lm {mlx_lm.__version__} is installed"

    def available(self) -> bool:
        try:
            importlib.import_module(f"mlx_lm.models.{self.module or self.name}")
        except ImportError:
            return False
        return True


def common_config(d: Dims, model_type: str, architecture: str) -> dict:
    """The keys of a text model's config that every family sets the same way."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "num_hidden_layers": d.layers,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.kv_heads,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }


def mla_config(d: Dims) -> dict:
    """Multi-head latent attention sizes (DeepSeek-V2/V3, GLM-4.7-Flash), shrunk."""
    return {
        "num_key_value_heads": d.heads,
        "kv_lora_rank": 64,
        "q_lora_rank": 96,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
    }


def deep_merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
