"""What a synthetic checkpoint is made of: the caller's arguments resolved against the
architecture's preset (`SynthSpec`), and the lazy model they describe (`materialize`). Writing
and size estimates both start here, so an estimate describes exactly what would be written."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from . import quantization
from .config import build_config, text_config, vision_tensors
from .errors import SyntheticError
from .preset import Dims
from .registry import get_preset
from .mtp import mtp_groups, mtp_specs
from .structure import expert_param_names
from .tokenizer import MIN_VOCAB_SIZE
from .shards import TensorGroup
from .weights import DTYPES, build_model, flat_weights, quantized_expert_draw, randomize

DEFAULT_VOCAB_SIZE = 1024
FORMAT_VERSION = 2  # bump when the same arguments would give different bytes


@dataclass(frozen=True)
class SynthSpec:
    arch: str
    layers: int
    experts: int
    top_k: int
    hidden: int
    moe_hidden: int
    vocab_size: int
    quant: Optional[quantization.QuantRecipe]
    dtype: str
    seed: int
    shard_size_mb: int
    vlm_layout: bool
    overrides: dict = field(default_factory=dict)

    @property
    def dims(self) -> Dims:
        return Dims(self.layers, self.experts, self.top_k, self.hidden, self.moe_hidden,
                    self.vocab_size)

    def identity(self) -> dict:
        """Everything the bytes depend on, for synth.json (the cache key)."""
        import mlx_lm

        d = asdict(self)
        d["quant"] = self.quant.as_dict() if self.quant else None
        d["format_version"] = FORMAT_VERSION
        d["mlx_version"] = mx.__version__
        d["mlx_lm_version"] = mlx_lm.__version__
        return json.loads(json.dumps(d))  # tuples -> lists, as read back from disk


def resolve_spec(
    arch: str = "qwen3_moe",
    *,
    layers=None,
    experts=None,
    top_k=None,
    hidden=None,
    moe_hidden=None,
    bits=None,
    group_size=None,
    mixed_bits=None,
    dtype="bfloat16",
    seed=0,
    vocab_size=None,
    shard_size_mb=2048,
    vlm_layout=False,
    overrides=None,
) -> SynthSpec:
    preset = get_preset(arch)
    if dtype not in DTYPES:
        raise SyntheticError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    spec = SynthSpec(
        arch=arch,
        layers=int(layers if layers is not None else preset.layers),
        experts=int(experts if experts is not None else preset.experts),
        top_k=int(top_k if top_k is not None else preset.top_k),
        hidden=int(hidden if hidden is not None else preset.hidden),
        moe_hidden=int(moe_hidden if moe_hidden is not None else preset.moe_hidden),
        vocab_size=int(vocab_size if vocab_size is not None else DEFAULT_VOCAB_SIZE),
        quant=quantization.resolve_recipe(
            bits if bits is not None else preset.default_bits,
            group_size if group_size is not None else preset.default_group_size,
            mixed_bits,
            preset.quant_mode,
        ),
        dtype=dtype,
        seed=int(seed),
        shard_size_mb=int(shard_size_mb),
        vlm_layout=bool(vlm_layout),
        overrides=json.loads(json.dumps(overrides or {})),
    )
    if spec.layers < preset.min_layers:
        raise SyntheticError(f"{arch} needs at least {preset.min_layers} layers, got {spec.layers}")
    if not 1 <= spec.top_k <= spec.experts:
        raise SyntheticError(f"top_k={spec.top_k} must be between 1 and experts={spec.experts}")
    if spec.vocab_size < MIN_VOCAB_SIZE:
        raise SyntheticError(f"vocab_size={spec.vocab_size}: at least {MIN_VOCAB_SIZE}")
    if spec.shard_size_mb < 1:
        raise SyntheticError("shard_size_mb must be at least 1")
    return spec


@dataclass
class Materialized:
    config: dict  # config.json content (quantization block included)
    weights: dict[str, mx.array]  # tensor name -> lazy array, in shard order (for shapes)
    groups: list[TensorGroup]  # how the writer produces them, chunk by chunk
    expert_names: set[str]  # names of routed-expert tensors
    total_parameters: int
    # the MTP head stock drops at load: name -> (shape, dtype); written after `weights`
    mtp: dict = field(default_factory=dict)


def materialize(spec: SynthSpec, *, values: bool = True) -> Materialized:
    """The lazy model for `spec`. values=False skips drawing random values (shapes, dtypes and
    names are the same): for size estimates."""
    from mlx_lm.utils import get_total_parameters

    preset = get_preset(spec.arch)
    config = build_config(
        preset, spec.dims, overrides=spec.overrides, vlm_layout=spec.vlm_layout, dtype=spec.dtype
    )
    model = build_model(config, spec.seed)
    chunked = randomize(model, spec.seed, spec.dtype, values=values)
    if preset.pack is not None:
        config = preset.pack(model, config, spec)
        chunked = {}  # packed tensors are rotated whole, not drawn and quantized in chunks
    elif spec.quant is not None:
        num_layers = text_config(config)["num_hidden_layers"]
        config = quantization.quantize(model, config, spec.quant, num_layers)
    weights = flat_weights(model)
    groups = _groups(model, weights, chunked, spec.seed)
    experts = expert_param_names(model)
    total_parameters = get_total_parameters(model)
    del model  # the weights and groups hold the only references: written tensors are freed

    rename = (lambda k: k)
    if spec.vlm_layout and preset.vlm.kind == "prefix":
        rename = (lambda k: f"language_model.{k}")
    weights = {rename(k): v for k, v in weights.items()}
    experts = {rename(k) for k in experts}
    for g in groups:
        g.names = [rename(n) for n in g.names]
    if spec.vlm_layout and preset.vlm.vision_prefix is not None:
        vision = vision_tensors(config, preset.vlm.vision_prefix, spec.seed, DTYPES[spec.dtype])
        weights.update(vision)
        groups += [_single(weights, name) for name in vision]
    mtp = {}
    if preset.mtp is not None and not spec.vlm_layout:
        mtp = mtp_specs(preset.mtp, spec.layers, spec.hidden, weights, experts,
                        spec.quant, DTYPES[spec.dtype])
        groups += mtp_groups(mtp, spec.seed)
    return Materialized(config, weights, groups, experts, total_parameters, mtp)


def _single(weights: dict, name: str) -> TensorGroup:
    # The group owns the array and hands it over once: after writing nothing holds it (the
    # caller must drop `weights` before writing).
    box = [weights[name]]
    return TensorGroup([name], 1, lambda i: [box.pop()])


def _groups(model: nn.Module, weights: dict, chunked: dict, seed: int) -> list[TensorGroup]:
    """One group per tensor, except: quantized expert stacks are drawn directly in quantized
    form, and other tensors drawn in chunks are quantized chunk by chunk (quantization groups
    run along the last axis, so quantizing row blocks gives the bytes of quantizing the
    whole). Both are made and written a chunk at a time."""
    modules = dict(model.named_modules())
    groups, done = [], set()
    for name in weights:
        if name in done:
            continue
        path, _, leaf = name.rpartition(".")
        module = modules.get(path)
        members = [f"{path}.{p}" for p in ("weight", "scales", "biases") if f"{path}.{p}" in weights]
        if isinstance(module, QuantizedSwitchLinear) and leaf in ("weight", "scales", "biases"):
            n_chunks, make = quantized_expert_draw(module, f"{path}.weight", seed)
        elif leaf in ("weight", "scales", "biases") and f"{path}.weight" in chunked:
            draw = chunked[f"{path}.weight"]
            n_chunks = draw.n_chunks
            if "scales" in module:
                q = dict(group_size=module.group_size, bits=module.bits,
                         mode=getattr(module, "mode", "affine"))

                def make(i, draw=draw, q=q):
                    return list(mx.quantize(draw.draw(i), **q))
            else:

                def make(i, draw=draw):
                    return [draw.draw(i)]
        else:
            groups.append(_single(weights, name))
            continue
        groups.append(TensorGroup(members, n_chunks, make))
        done.update(members)
    return groups
