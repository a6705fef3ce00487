"""The quantization recipe of a synthetic checkpoint: which mode, bits and group size, and which
layers' expert blocks get other bits. The quantizing itself is mlx-lm's own `quantize_model`, so
the class predicate, the skipped layers and the per-path entries of the config's `quantization`
block are exactly what `mlx_lm.convert` writes."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from typing import Optional, Union

import mlx.nn as nn

from .errors import SyntheticError
from .structure import routed_expert_modules

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
MXFP4_GROUP_SIZE = 32  # fixed by the format (gpt-oss exports)


@dataclass(frozen=True)
class QuantRecipe:
    mode: str  # "affine" or "mxfp4"
    bits: int
    group_size: int
    mixed_bits: tuple[tuple[int, int], ...] = ()  # (layer index, bits) for expert blocks

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "bits": self.bits,
            "group_size": self.group_size,
            "mixed_bits": [list(p) for p in self.mixed_bits],
        }


def resolve_recipe(
    bits: Union[int, str, None],
    group_size: Optional[int],
    mixed_bits,
    default_mode: str,
) -> Optional[QuantRecipe]:
    """None for an unquantized checkpoint. `bits` None means the family's usual export
    (4-bit affine, or mxfp4 for gpt-oss); an int means affine; "mxfp4" means mxfp4."""
    if bits is None:
        bits = "mxfp4" if default_mode == "mxfp4" else 4
    if isinstance(bits, str):
        text = bits.strip().lower()
        if text == "mxfp4":
            mode, nbits = "mxfp4", 4
        elif text.isdigit():
            mode, nbits = "affine", int(text)
        else:
            raise SyntheticError(f"bits={bits!r}: give an integer ({AFFINE_BITS}), 0 or 'mxfp4'")
    else:
        mode, nbits = "affine", int(bits)
    mixed = parse_mixed_bits(mixed_bits)
    if mode == "affine" and nbits == 0:
        if mixed:
            raise SyntheticError("mixed_bits needs a quantized checkpoint (bits > 0)")
        return None
    if mode == "affine" and nbits not in AFFINE_BITS:
        raise SyntheticError(f"bits={nbits} is not an affine bit width MLX supports {AFFINE_BITS}")
    for layer, b in mixed:
        if b not in AFFINE_BITS:
            raise SyntheticError(f"mixed_bits: layer {layer} asks for {b} bits; allowed {AFFINE_BITS}")
    if mode == "mxfp4":
        if group_size not in (None, MXFP4_GROUP_SIZE):
            raise SyntheticError(f"mxfp4 uses group_size {MXFP4_GROUP_SIZE}, not {group_size}")
        group_size = MXFP4_GROUP_SIZE
    elif group_size is None:
        group_size = 64
    if group_size not in (32, 64, 128):
        raise SyntheticError(f"group_size={group_size}: MLX supports 32, 64 or 128")
    return QuantRecipe(mode, nbits, group_size, mixed)


def parse_mixed_bits(spec) -> tuple[tuple[int, int], ...]:
    """Accepts None, {layer: bits}, "0:8,3:2" (layer:bits pairs), or a bare bit width B (int or
    "B") meaning: the expert blocks of every odd layer get B bits."""
    if spec is None or spec == "" or spec == {}:
        return ()
    if isinstance(spec, dict):
        pairs = [(int(k), int(v)) for k, v in spec.items()]
    elif isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        return (("odd", int(spec)),)  # resolved against the layer count later
    elif isinstance(spec, str):
        pairs = []
        for part in spec.split(","):
            m = re.fullmatch(r"\s*(\d+)\s*[:=]\s*(\d+)\s*", part)
            if not m:
                raise SyntheticError(
                    f"mixed_bits {spec!r}: expected LAYER:BITS pairs like '0:8,2:8' or one bit width"
                )
            pairs.append((int(m.group(1)), int(m.group(2))))
    elif isinstance(spec, (list, tuple)):
        pairs = [(int(a), int(b)) for a, b in spec]
    else:
        raise SyntheticError(f"mixed_bits {spec!r}: expected a dict, 'L:B,...' or a bit width")
    return tuple(sorted(dict(pairs).items()))


def expand_mixed_bits(recipe: QuantRecipe, num_layers: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for layer, b in recipe.mixed_bits:
        if layer == "odd":
            out.update({i: b for i in range(1, num_layers, 2)})
        elif 0 <= layer < num_layers:
            out[layer] = b
        else:
            raise SyntheticError(f"mixed_bits names layer {layer}; the model has {num_layers} layers")
    return out


def _layer_index(path: str) -> Optional[int]:
    parts = path.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("layers", "h", "blocks") and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def quantize(model: nn.Module, config: dict, recipe: QuantRecipe, num_layers: int) -> dict:
    """Quantize `model` in place (lazily: nothing is evaluated) through mlx-lm's
    `quantize_model`; return the config with its `quantization` block."""
    from mlx_lm.utils import quantize_model

    per_layer = expand_mixed_bits(recipe, num_layers)
    own = getattr(model, "quant_predicate", None)  # e.g. gpt-oss: router at 8 bits
    routed = {p for p, _ in routed_expert_modules(model)}

    def predicate(path, module):
        if per_layer and path in routed:
            layer = _layer_index(path)
            if layer in per_layer and (recipe.mode != "affine" or per_layer[layer] != recipe.bits):
                # recorded per path in the config, as mlx-lm's mixed recipes are
                return {"group_size": recipe.group_size, "bits": per_layer[layer], "mode": "affine"}
        return own(path, module) if own is not None else True

    # quantize_model prints its bits-per-weight figure; keep the caller's stdout clean.
    with contextlib.redirect_stdout(io.StringIO()):
        _, qconfig = quantize_model(
            model,
            config,
            recipe.group_size,
            recipe.bits,
            mode=recipe.mode,
            quant_predicate=predicate if (per_layer or own is not None) else None,
        )
    return qconfig
