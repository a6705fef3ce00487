"""A streamed layer's compute part (ExpertCompute): the stock SwitchGLU / SwitchMLP computing
from slot arrays, and chosen (token, expert) pairs of one stock call computed with its
projection layers in calls shaped so that each takes the kernel stock's whole call takes
(kernel_match.py)."""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from . import kernel_match
from .kernel_match import RowPlan


class ExpertCompute:
    """The stock block whose expert tensors are a layer's slot arrays, and the rule that shapes
    calls on it (or on a scratch buffer) to take the kernel stock's call takes."""

    def __init__(self, module: nn.Module, num_experts: int):
        self.module = module  # the stock SwitchGLU / SwitchMLP; its expert tensors are slot arrays
        self.num_experts = num_experts  # the checkpoint's: the expert count stock's kernel sees
        self.backend = kernel_match.current_backend()
        self.quantized = kernel_match.is_quantized(module)

    def __call__(self, x: mx.array, slots: mx.array) -> mx.array:
        """Stock's call, with the experts' slot numbers for their ids."""
        return self.module(x, slots)

    def row_plan(self, stock_rows: int, array_experts: int, sorted_rows: bool) -> RowPlan:
        """How to shape calls on a tensor of `array_experts` experts (slots, scratch) that
        compute part of a stock call of `stock_rows` (token, expert) pairs."""
        return kernel_match.plan_rows(self.backend, stock_rows, self.num_experts, array_experts, sorted_rows,
                                      self.quantized)

    def pairs(self, rows: mx.array, pos: np.ndarray, slots: np.ndarray, k: int, do_sort: bool, plan: RowPlan,
              buffer=None) -> tuple[list[mx.array], list[np.ndarray]]:
        """call_pairs on the slot arrays, or on a scratch `buffer` (ExpertSlots outside the cache)."""
        module = self.module if buffer is None else with_arrays(self.module, buffer.arrays)
        return call_pairs(module, rows, pos, slots, k, do_sort, plan)

    def use(self, slots) -> None:
        """Compute from these slot arrays (ExpertSlots) from now on: the online budget resized them."""
        self.module.update(tree_unflatten(list(slots.arrays.items())))


def with_arrays(inner: nn.Module, arrays: dict[str, mx.array]) -> nn.Module:
    """A shallow copy of the block computing with other expert tensors (scratch buffers)."""
    clone = copy.copy(inner)
    for child in {leaf.split(".", 1)[0] for leaf in arrays}:
        clone[child] = copy.copy(inner[child])
    clone.update(tree_unflatten(list(arrays.items())))
    return clone


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
