"""The multi-token-prediction (MTP) head a family's real export carries and mlx-lm's `sanitize`
drops at load: a decoder layer shaped like the model's last MoE layer (stacked experts,
quantized as the trunk) under the family's MTP prefix, plus the head's norms and projections.
Stock never loads these tensors, so their values only need to be distinct random bytes; they are
written after the model's tensors, as the real exports put them in the last shard."""

from __future__ import annotations

import math
import re

import mlx.core as mx
import numpy as np

from .preset import Mtp
from .quantization import QuantRecipe
from .shards import TensorGroup
from .weights import CHUNK_ELEMENTS, key_for, random_words, seed_for

_LAYER = re.compile(r"^(.*\.(?:layers|h|blocks)\.)(\d+)\.")


def mtp_specs(mtp: Mtp, layers: int, hidden: int, weights: dict, expert_names: set[str],
              quant: QuantRecipe | None, dtype) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """Name -> (shape, dtype) of every MTP tensor, in write order."""
    layer, norms, projs = mtp.names(layers)
    found = [m for m in map(_LAYER.match, expert_names) if m]
    root, last = max(((m.group(1), int(m.group(2))) for m in found), key=lambda x: x[1])
    source = f"{root}{last}."
    out = {f"{layer}.{k[len(source):]}": (tuple(v.shape), v.dtype)
           for k, v in weights.items() if k.startswith(source)}
    for name in norms:
        out[name] = ((hidden,), dtype)
    for name in projs:
        if quant is None:
            out[f"{name}.weight"] = ((hidden, 2 * hidden), dtype)
        else:  # affine at the trunk's bits, as mlx-lm quantizes the other linears
            out[f"{name}.weight"] = ((hidden, 2 * hidden * quant.bits // 32), mx.uint32)
            out[f"{name}.scales"] = ((hidden, 2 * hidden // quant.group_size), dtype)
            out[f"{name}.biases"] = ((hidden, 2 * hidden // quant.group_size), dtype)
    return out


def mtp_groups(specs: dict, seed: int) -> list[TensorGroup]:
    return [_random_group(name, shape, dtype, seed) for name, (shape, dtype) in specs.items()]


def nbytes(shape, dtype) -> int:
    return math.prod(shape) * dtype.size


def _random_group(name: str, shape: tuple[int, ...], dtype, seed: int) -> TensorGroup:
    """Random values of `shape` and `dtype`, made in row blocks of about CHUNK_ELEMENTS."""
    if not shape:
        return TensorGroup([name], 1, lambda i: [_draw(name, (), dtype, seed)])
    row = math.prod(shape[1:])
    rows = max(1, CHUNK_ELEMENTS // max(1, row))
    n_chunks = max(1, -(-shape[0] // rows))

    def make(i: int):
        piece = (min(rows, shape[0] - i * rows),) + shape[1:]
        return [_draw(f"{name}#{i}", piece, dtype, seed)]

    return TensorGroup([name], n_chunks, make)


def _draw(name: str, shape, dtype, seed: int):
    if mx.issubdtype(dtype, mx.floating):
        return mx.random.uniform(-0.05, 0.05, shape, dtype=dtype, key=key_for(seed, name))
    np_dtype = np.dtype(str(dtype).rsplit(".", 1)[-1])
    n = math.prod(shape) * np_dtype.itemsize
    words = random_words((-(-n // 4),), seed_for(seed, name))
    return words.view(np.uint8)[:n].view(np_dtype).reshape(shape)
