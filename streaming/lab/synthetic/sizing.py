"""Sizes of a synthetic checkpoint computed from shapes alone (nothing evaluated or written), and
the layer count that makes a checkpoint reach a target size: callers pick a checkpoint larger
than a memory budget before paying for writing it."""

from __future__ import annotations

import re
from typing import Optional

from .errors import SyntheticError
from .mtp import nbytes
from .registry import get_preset
from .shards import plan_shards
from .spec import SynthSpec, materialize, resolve_spec


_LAYER = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")


def summarize(spec: SynthSpec, weights: dict, expert_names: set[str], total_parameters: int,
              mtp: Optional[dict] = None) -> dict:
    """trunk_bytes and expert_bytes count what stock mlx-lm loads; mtp_bytes the MTP head it
    drops; total_bytes everything on disk."""
    sizes = {k: v.nbytes for k, v in weights.items()}
    mtp_sizes = {k: nbytes(shape, dtype) for k, (shape, dtype) in (mtp or {}).items()}
    expert_bytes = sum(n for k, n in sizes.items() if k in expert_names)
    per_layer: dict[int, int] = {}
    for k in expert_names:
        m = _LAYER.search(k)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + sizes[k]
    loaded = sum(sizes.values())
    return {
        "total_bytes": loaded + sum(mtp_sizes.values()),
        "expert_bytes": expert_bytes,
        "trunk_bytes": loaded - expert_bytes,
        "mtp_bytes": sum(mtp_sizes.values()),
        "mtp_tensors": len(mtp_sizes),
        "moe_layers": len(per_layer),
        "experts": spec.experts,
        "expert_bytes_per_layer": {str(k): per_layer[k] for k in sorted(per_layer)},
        "bytes_per_expert": max(per_layer.values()) // spec.experts if per_layer else 0,
        "n_tensors": len(sizes) + len(mtp_sizes),
        "n_shards": len(plan_shards({**sizes, **mtp_sizes}, spec.shard_size_mb << 20)),
        "total_parameters": total_parameters,
        "layers": spec.layers,
    }


def estimate_size(arch: str = "qwen3_moe", **kwargs) -> dict:
    """Sizes of the checkpoint `make_checkpoint(out_dir, arch, **kwargs)` would write, from
    shapes only: total_bytes, expert_bytes, trunk_bytes (tensor data; file headers and the
    tokenizer add a few hundred KB), plus moe_layers, bytes_per_expert, n_shards..."""
    kwargs.pop("progress", None)
    spec = resolve_spec(arch, **kwargs)
    m = materialize(spec, values=False)
    return summarize(spec, m.weights, m.expert_names, m.total_parameters, m.mtp)


def layers_for_target(arch: str, target_bytes: int, **kwargs) -> int:
    """The smallest layer count whose checkpoint holds at least `target_bytes` of tensors,
    other sizes as in kwargs. Raises when the architecture's layer limit is reached first."""
    kwargs.pop("layers", None)
    kwargs.pop("progress", None)
    preset = get_preset(arch)
    lo = max(preset.min_layers, preset.layers if preset.layers >= 4 else 4)

    def total(n: int) -> int:
        return estimate_size(arch, layers=n, **kwargs)["total_bytes"]

    # sizes grow about linearly with layers (hybrid patterns repeat every 4 layers): take the
    # slope over 4 layers, jump near the answer, then step to the exact smallest count
    a, b = total(lo), total(lo + 4)
    slope = max(1, (b - a) / 4)
    guess = max(preset.min_layers, int(lo + (target_bytes - a) / slope))
    limit: Optional[int] = preset.max_layers
    if limit is not None:
        guess = min(guess, limit)
    while guess > preset.min_layers and total(guess - 1) >= target_bytes:
        guess -= 1
    while total(guess) < target_bytes:
        if limit is not None and guess >= limit:
            raise SyntheticError(
                f"{arch}: even {limit} layers stay below {target_bytes / 1e9:.2f} GB; "
                f"raise hidden, moe_hidden or experts"
            )
        guess += 1
    return guess
