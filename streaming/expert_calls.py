"""Computing chosen (token, expert) pairs of one stock call with the stock projection layers, in
calls shaped so that each takes the kernel stock's whole call takes (kernel_match.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .kernel_match import RowPlan


def expert_rows(module: nn.Module, x: mx.array, idx: mx.array, do_sort: bool) -> mx.array:
    """The body of SwitchGLU / SwitchMLP between its sort and unsort, on given rows."""
    if "gate_proj" in module:
        up = module.up_proj(x, idx, sorted_indices=do_sort)
        gate = module.gate_proj(x, idx, sorted_indices=do_sort)
        return module.down_proj(module.activation(up, gate), idx, sorted_indices=do_sort)
    h = module.activation(module.fc1(x, idx, sorted_indices=do_sort))
    return module.fc2(h, idx, sorted_indices=do_sort)


def call_pairs(module: nn.Module, rows: mx.array, pos: np.ndarray, slots: np.ndarray, k: int,
               do_sort: bool, plan: RowPlan) -> tuple[list[mx.array], list[np.ndarray]]:
    """Outputs of the pairs at flat routing positions `pos` (token `pos // k`, whose row in
    `rows` comes from `token_rows`), with their experts at `slots` of the module's expert
    tensors: sorted by slot exactly when stock sorts its whole call, in calls of at most
    `plan.max_rows` rows, each padded with copies of its last row to `plan.min_rows` (the
    copies' outputs are dropped). Returns (outputs, their positions)."""
    if do_sort:
        by_slot = np.argsort(slots, kind="stable")
        pos, slots = pos[by_slot], slots[by_slot]
    outputs, positions = [], []
    for start in range(0, pos.size, plan.max_rows):
        p, s = pos[start : start + plan.max_rows], slots[start : start + plan.max_rows]
        n = p.size
        if n < plan.min_rows:
            p = np.concatenate([p, np.repeat(p[-1:], plan.min_rows - n)])
            s = np.concatenate([s, np.repeat(s[-1:], plan.min_rows - n)])
        y = expert_rows(module, rows[mx.array(p // k)], mx.array(s.astype(np.uint32)), do_sort)
        outputs.append(y[:n] if p.size > n else y)
        positions.append(p[:n])
    return outputs, positions


def token_rows(x: mx.array) -> mx.array:
    """One row per token, shaped as stock's gather-sort makes them."""
    return mx.expand_dims(x, (-2, -3)).flatten(0, -3)


def stitch(outputs: list[mx.array], positions: list[np.ndarray], axis: int) -> mx.array:
    """Outputs computed for disjoint subsets of positions along `axis`, back in position order
    (a concatenation and a gather: no arithmetic, so the bits are the computed ones)."""
    order = np.concatenate(positions)
    inverse = np.empty(order.size, dtype=np.int32)
    inverse[order] = np.arange(order.size, dtype=np.int32)
    return mx.take(mx.concatenate(outputs, axis=axis), mx.array(inverse), axis=axis)


def unflatten_pairs(y: mx.array, ids_shape: tuple) -> mx.array:
    """Pair outputs stitched in routing order, back to stock's (..., k, dims) layout."""
    return mx.unflatten(y, 0, ids_shape).squeeze(-2)
