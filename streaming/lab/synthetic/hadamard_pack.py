"""Prism's Hadamard packs (model_type prism_hadamard_qwen35, the Bonsai 2 MLX exports): a qwen3_5
model whose every nn.Linear / nn.Embedding of the language model is stored 2-bit affine (group
128) in a signed, blockwise Walsh-Hadamard-rotated basis, listed in the config's `modules`
manifest with its block and a `<module>.signs` vector; mlx-lm rotates the activations at run
time (the embedding's rows back). The routed experts (SwitchGLU) are not in the manifest: they
are plain 2-bit affine group-128 stacks, quantized as mlx-lm's load quantizes them.

The synthetic pack folds the rotation into a random qwen3_5 model's own weights, so the pack
computes what the unrotated model does (up to the 2-bit error) and routing keeps its
preferences. Names are the published packs' (schema 2, `language_model.` names of the mlx-vlm
qwen3_5 model)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from . import quantization
from .errors import SyntheticError
from .weights import key_for

FAMILY = "prism_hadamard_qwen35"
# What mlx-lm accepts, and nothing else (its ModelArgs checks each).
PACK_QUANT = quantization.QuantRecipe("affine", 2, 128)
SCHEMA = {
    "schema_version": 2,
    "tensor_namespace": "mlx-vlm-qwen3_5",
    "base_model_type": "qwen3_5",
    "gdn_activation_layout": "grouped",
}
# The published packs rotate in blocks of 1024; a narrower input takes the largest block of
# mlx-lm's list that divides it (0: no rotation, no signs).
BLOCKS = (1024, 512)


def block_for(width: int) -> int:
    return next((b for b in BLOCKS if width % b == 0), 0)


def pack(model: nn.Module, config: dict, spec) -> dict:
    """Turn the randomized qwen3_5 `model` (its Model class wraps `language_model`) into the
    pack in place, quantize its experts, and return the pack's config.json content."""
    from mlx_lm.models.prism_hadamard_qwen35 import (
        HadamardQuantizedEmbedding,
        HadamardQuantizedLinear,
        hadamard_rotate,
    )

    if spec.quant != PACK_QUANT:
        got = spec.quant.as_dict() if spec.quant else "unquantized"
        raise SyntheticError(
            f"{FAMILY}: the packs are 2-bit affine with group size 128 (mlx-lm refuses anything "
            f"else), got {got}; leave bits, group_size and mixed_bits unset"
        )
    lm = model.language_model
    records, replacements = [], []
    for path, module in reversed(lm.named_modules()):  # model order
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        rows, width = module.weight.shape
        if width % PACK_QUANT.group_size:
            raise SyntheticError(
                f"{FAMILY}: {path} has input width {width}, not a multiple of 128 as the pack's "
                "2-bit group-128 linears need; pick hidden and the head sizes as multiples of 128"
            )
        block = block_for(width)
        embedding = isinstance(module, nn.Embedding)
        cls = HadamardQuantizedEmbedding if embedding else HadamardQuantizedLinear
        packed = cls(width, rows, block)
        weight = module.weight
        if block:
            # row r is stored as H(r * signs): qmm(H(x * signs)) is then x @ r, and the
            # embedding's inverse rotation gives the row back
            key = key_for(spec.seed, f"language_model.{path}.signs")
            packed.signs = mx.where(mx.random.bernoulli(0.5, (width,), key=key), 1.0, -1.0)
            weight = hadamard_rotate(weight.astype(mx.float32), block, packed.signs)
        q = mx.quantize(weight.astype(mx.float16), group_size=PACK_QUANT.group_size, bits=PACK_QUANT.bits)
        packed.weight, packed.scales, packed.biases = q
        replacements.append((path, packed))
        records.append({"path": path, "block": block, "embedding": embedding, "dtype": "float16"})
    lm.update_modules(tree_unflatten(replacements))

    # Only the experts remain quantizable (the packed modules have no to_quantized), so
    # mlx-lm's quantizer writes exactly the pack's block.
    num_layers = config["text_config"]["num_hidden_layers"]
    config = quantization.quantize(model, config, PACK_QUANT, num_layers)
    if config["quantization"] != {"group_size": 128, "bits": 2, "mode": "affine"}:
        raise SyntheticError(f"{FAMILY}: the quantizer wrote {config['quantization']}, not the pack's block")
    config.update(SCHEMA)
    config["model_type"] = FAMILY
    config["components"] = {"text": True, "vision": "vision_config" in config, "mtp": False}
    config["modules"] = records
    return config
