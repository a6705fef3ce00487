"""Approximate knobs, off by default and labelled lossy: with them the output is no longer
bitwise stock. `expert-stream bench` reports their token agreement with exact output.

- top_k_override: route every token to fewer experts (the MoE block's own top-k attribute).
- skip_miss_below: during decode, a missing expert whose routing weight (normalised over the
  token's selected experts) is below the threshold is not read; its contribution is dropped.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .errors import SettingsError
from .lookahead import block_router, module_at

# Attribute names MoE blocks (or their gates) keep their top-k in, across mlx-lm models.
TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "num_experts_per_token", "experts_per_token")


def override_top_k(model: nn.Module, expert_paths: list[str], top_k: int | None, k: int) -> None:
    """Set the top-k of every MoE block holding one of `expert_paths` to k."""
    for path in expert_paths:
        block = module_at(model, path.rsplit(".", 1)[0])
        owners = [block] + [block.get(n) for n in ("gate", "router") if isinstance(block.get(n), nn.Module)]
        changed = False
        for owner in owners:
            for attr in TOP_K_ATTRS:
                if isinstance(getattr(owner, attr, None), int) and (top_k is None or getattr(owner, attr) == top_k):
                    setattr(owner, attr, k)
                    changed = True
        if not changed:
            raise SettingsError(
                f"top_k_override: cannot find the top-k attribute of {type(block).__name__} at "
                f"{path.rsplit('.', 1)[0]} (looked for {', '.join(TOP_K_ATTRS)})"
            )


class MissSkipper:
    """Decides which of a decode token's missing experts are too light to be worth a read."""

    def __init__(self, block: nn.Module, threshold: float, router_hook=None):
        self.scores = block_router(block, router_hook)
        self.threshold = threshold
        if self.scores is None:
            raise SettingsError(
                f"skip_miss_below: no router found in {type(block).__name__} to weigh experts by"
            )

    def light(self, x: mx.array, ids: np.ndarray) -> np.ndarray:
        """Bool mask over the token's k selected experts: normalised weight below threshold."""
        scores = self.scores(x.reshape(-1, x.shape[-1])[-1:])[0].astype(mx.float32)
        weights = np.array(mx.softmax(scores, axis=-1))[ids.reshape(-1)]
        return weights / weights.sum() < self.threshold
