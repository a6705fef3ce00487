"""Random weights for an mlx-lm model, built lazily: the model is made by mlx-lm's own class from
the config, every parameter is replaced by a lazy random array (nothing is evaluated except a
few tiny initial values), cast like `mlx_lm.convert` casts, and later quantized by mlx-lm.

Each tensor is drawn from a key derived from (seed, tensor name), so its bytes do not depend on
which other tensors exist or on the order they are evaluated in. A large tensor is drawn in
chunks along its first axis (experts, or rows), each from its own key: the writer evaluates and
writes one chunk at a time, so no whole float copy of a big expert stack is ever in memory."""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np
import mlx.nn as nn
from mlx.utils import tree_flatten

from .structure import expert_counts, is_router, iter_params

# Router logits of a freshly initialized model are ~N(0, 0.6): nearly flat routing, where every
# expert is about as likely and a cache policy has nothing to learn. Scaling the router up makes
# each token prefer a few experts strongly, as trained routers do; giving the experts' rows
# different norms (x ROUTER_ROW_SPREAD, from 1 - spread/2 to 1 + spread/2) makes some experts
# hot and others rare across tokens, as real routing traces are.
ROUTER_SCALE = 8.0
ROUTER_ROW_SPREAD = 1.0
# Parameters initialized to zero (SwitchLinear biases, raw router matrices, correction biases,
# attention sinks, dt biases) become uniform in +-ZERO_INIT_RANGE: a zero hides indexing bugs.
ZERO_INIT_RANGE = 0.1
# Parameters initialized to other constants (norm weights, A_log, D) are jittered by +-10%.
JITTER = 0.1
# Tensors above this many elements are drawn in chunks of about this size. Quantizing one chunk
# of a bf16 draw peaks at ~3.3x its float32 size in MLX (measured: 220 MB for 33.5M elements),
# so a chunk costs ~200 MB at most whatever the tensor size.
CHUNK_ELEMENTS = 1 << 24

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


@dataclass(frozen=True)
class ChunkedDraw:
    """A tensor drawn in `n_chunks` pieces along axis 0: draw(i) is the lazy piece i."""

    shape: tuple[int, ...]
    n_chunks: int
    draw: Callable[[int], mx.array]

    def full(self) -> mx.array:
        """The whole tensor, lazily (for shapes and for small tensors only)."""
        if self.n_chunks == 1:
            return self.draw(0)
        return mx.concatenate([self.draw(i) for i in range(self.n_chunks)], axis=0)


def model_classes(config: dict):
    """mlx-lm's own lookup of the Model / ModelArgs classes for a config."""
    from mlx_lm import utils

    return utils._get_classes(config)


def build_model(config: dict, seed: int) -> nn.Module:
    """The mlx-lm model for `config`, parameters lazy (never evaluated here)."""
    model_class, args_class = model_classes(config)
    mx.random.seed(seed)
    # from_dict may rewrite nested dicts (rope parameters): keep the caller's config intact
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    model.eval()
    return model


def key_for(seed: int, name: str) -> mx.array:
    return mx.random.key(seed_for(seed, name))


def _fan_in(module: nn.Module, weight: mx.array) -> int:
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return max(1, math.prod(weight.shape[1:]))
    return max(1, weight.shape[-1])


def _chunked(seed: int, name: str, shape, sample: Callable) -> ChunkedDraw:
    """sample(shape, key) drawn whole for small tensors, else in row blocks along axis 0."""
    shape = tuple(shape)
    row = math.prod(shape[1:])
    if math.prod(shape) <= CHUNK_ELEMENTS or shape[0] == 1:
        return ChunkedDraw(shape, 1, lambda i: sample(shape, key_for(seed, name)))
    rows = max(1, CHUNK_ELEMENTS // row)
    n = -(-shape[0] // rows)

    def draw(i: int) -> mx.array:
        start = i * rows
        piece = (min(rows, shape[0] - start),) + shape[1:]
        return sample(piece, key_for(seed, f"{name}#{i}"))

    return ChunkedDraw(shape, n, draw)


def randomize(
    model: nn.Module, seed: int, dtype: str, *, values: bool = True
) -> dict[str, ChunkedDraw]:
    """Give every parameter its random value (lazily) and cast it as `mlx_lm.convert --dtype`
    does (the model's `cast_predicate` keeps e.g. e_score_correction_bias in float32). Returns
    the draws of the tensors big enough to be drawn in chunks, by full name.
    values=False only casts: the shapes and dtypes are then final, for size estimates."""
    target = DTYPES[dtype]
    cast_predicate = getattr(model, "cast_predicate", lambda _: True)
    experts = expert_counts(model)
    chunked: dict[str, ChunkedDraw] = {}

    small = []  # (module, name, full name): their new value depends on their initial value
    for path, module, name, value in iter_params(model):
        full = f"{path}.{name}" if path else name
        if not mx.issubdtype(value.dtype, mx.floating):
            continue
        cast = target if cast_predicate(full) else value.dtype
        if not values:
            module[name] = value.astype(cast)
            continue
        weight = module.get("weight") if name == "bias" else value
        # big tensors are drawn straight in their final dtype: no float32 copy in memory
        if name == "weight" and value.ndim >= 2:
            if isinstance(module, nn.Embedding):
                scale = math.sqrt(1 / value.shape[-1])
                draw = _chunked(
                    seed, full, value.shape,
                    lambda s, k, scale=scale, c=cast: mx.random.normal(s, dtype=c, scale=scale, key=k),
                )
            elif is_router(path, module, name, value, experts):
                s = 1 / math.sqrt(_fan_in(module, value))
                rows = mx.random.uniform(shape=(value.shape[0], 1), key=key_for(seed, full + "#rows"))
                scaled = mx.random.uniform(-s, s, value.shape, key=key_for(seed, full))
                scaled = scaled * (ROUTER_SCALE * (1 + ROUTER_ROW_SPREAD * (rows - 0.5)))
                module[name] = scaled.astype(cast)
                continue
            else:
                s = 1 / math.sqrt(_fan_in(module, value))
                draw = _chunked(
                    seed, full, value.shape,
                    lambda sh, k, s=s, c=cast: mx.random.uniform(-s, s, sh, dtype=c, key=k),
                )
        elif name == "bias" and isinstance(weight, mx.array) and weight.ndim >= 2:
            s = 1 / math.sqrt(_fan_in(module, weight))
            draw = _chunked(
                seed, full, value.shape,
                lambda sh, k, s=s, c=cast: mx.random.uniform(-s, s, sh, dtype=c, key=k),
            )
        else:
            small.append((module, name, full, cast))
            continue
        if draw.n_chunks > 1:
            chunked[full] = draw
        module[name] = draw.full()

    if small:
        mx.eval([m[n] for m, n, _, _ in small])
    for module, name, full, cast in small:
        init = module[name].astype(mx.float32)
        u = mx.random.uniform(-1.0, 1.0, init.shape, key=key_for(seed, full))
        if not mx.any(init != 0).item():
            new = ZERO_INIT_RANGE * u
        else:
            new = init * (1 + JITTER * u)
        module[name] = new.astype(cast)
    return chunked


def seed_for(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def random_words(shape, seed: int) -> np.ndarray:
    """Uniform random uint32 words from NumPy's SFC64 raw stream (stable across NumPy versions,
    1.3 GB/s here; MLX has no public bit generator and would need several passes)."""
    n = math.prod(shape)
    raw = np.random.SFC64(seed).random_raw((n + 1) // 2)
    return raw.view(np.uint32)[:n].reshape(shape)


def quantized_expert_draw(module: nn.Module, full: str, seed: int) -> tuple[int, Callable]:
    """Draw a quantized expert stack directly in quantized form: random codes and scales (and
    biases) chosen so the dequantized weights are uniform in about +-1/sqrt(input_dims), like
    mlx-lm's init. 8x less random data than quantizing a float draw, and no quantize pass: a
    checkpoint larger than memory writes in minutes. The codes are a NumPy array. Returns (n_chunks, make(i) -> [weight,
    scales(, biases)] for experts of chunk i)."""
    weight, scales = module["weight"], module["scales"]
    experts = weight.shape[0]
    in_dims = scales.shape[-1] * module.group_size
    bound = 1 / math.sqrt(in_dims)
    mode = getattr(module, "mode", "affine")
    per_expert = math.prod(weight.shape[1:])
    rows = max(1, min(experts, CHUNK_ELEMENTS // max(1, per_expert)))
    n_chunks = -(-experts // rows)

    def make(i: int) -> list[mx.array]:
        n = min(rows, experts - i * rows)
        k_s, k_b = mx.random.split(key_for(seed, f"{full}#q{i}"))
        codes = random_words((n,) + weight.shape[1:], seed_for(seed, f"{full}#codes{i}"))
        jitter = mx.random.uniform(-1.0, 1.0, (n,) + scales.shape[1:], key=k_s)
        if mode == "mxfp4":
            # e2m1 codes have an rms of ~2.93 (uniform codes); e8m0 scale = 2^(e - 127)
            e = 127 + round(math.log2(bound / math.sqrt(3) / 2.93))
            return [codes, (e + mx.round(jitter)).astype(mx.uint8)]
        levels = (1 << module.bits) - 1
        step = (2 * bound / levels) * (1 + 0.2 * jitter)  # +-10% per group
        offset = 0.05 * bound * mx.random.uniform(-1.0, 1.0, step.shape, key=k_b)
        return [codes, step.astype(scales.dtype), (offset - step * levels / 2).astype(scales.dtype)]

    return n_chunks, make


def flat_weights(model: nn.Module) -> dict[str, mx.array]:
    """Name -> array in the order mlx-lm's `save_model` shards them (tree order)."""
    return dict(tree_flatten(model.parameters()))
