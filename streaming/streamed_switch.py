"""The streamed expert layer: a drop-in for mlx-lm's SwitchGLU / SwitchMLP whose routed experts
stay on disk. It wraps the stock module itself (its expert tensors swapped for slot arrays) and
calls it with slot numbers instead of expert ids, so the arithmetic, the activation and stock's
sort rule (sort the token-expert pairs when `indices.size >= 64`) are stock's own code.

Each call picks one path (decode_paths.py, prefill_sweep.py). Where a miss is handled: the
path asks the layer's ExpertStore (expert_store.py) for the missing experts, and the store
reserves slots, reads, and lets the slots claim them once the bytes are in. Calls that need
several stock calls shape them so the backend picks stock's kernel for each (kernel_match.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import kernel_match
from .decode_paths import ComputeFloor, LayerByLayer, LossySkip, ResidentPath, stock_sorts
from .expert_calls import call_pairs, stitch, token_rows, unflatten_pairs
from .expert_store import ExpertStore
from .prefill_sweep import PrefillSweep


class StreamedSwitch(nn.Module):
    """Called exactly like the SwitchGLU / SwitchMLP it replaces: `layer(x, indices)`."""

    def __init__(self, inner: nn.Module, store: ExpertStore, overlap: bool = True, skipper=None,
                 scratch=None, lookahead=None):
        super().__init__()
        self.inner = inner
        self.store = store
        self.resident = ResidentPath(self)
        self.layered = LayerByLayer(self, overlap, lookahead)
        self.sweep = PrefillSweep(self, scratch)
        self.skip = LossySkip(self, skipper, self.layered) if skipper is not None else None
        self.floor = None  # the benchmark's ComputeFloor while it times compute alone
        self.online_budget = None  # OnlineBudget moving slots between layers (set by the loader)
        self.path_taken = None  # the path object of the latest call
        self.backend = kernel_match.current_backend()
        self.quantized = kernel_match.is_quantized(inner)

    def __getattr__(self, name: str):
        # The model may reach into the block it built: muse_spark reads
        # `experts.post_expert_norm`, a norm it keeps on its SwitchGLU.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "inner" not in self:
                raise
            return getattr(self["inner"], name)

    def time_compute_only(self, on: bool) -> None:
        """Benchmark: compute every call as if all experts were resident (ComputeFloor)."""
        self.floor = ComputeFloor(self) if on else None

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.online_budget is not None and self.floor is None:
            self.online_budget.apply(self)  # slots follow the budget, in a layer holding every expert too
        path = self.floor or (self.resident if self.store.on_device() else None)
        if path is not None:
            self.path_taken = path
            return path(x, indices)
        store = self.store
        store.reap()
        try:
            call = self.layered.route(x, indices)
            path = self._host_path(x, call)
            self.path_taken = path
            y = path(x, indices, call)
        except BaseException:
            store.reap()  # a failed call leaves no read behind that could still write a slot
            raise
        store.pending.append(y)
        return y

    def _host_path(self, x, call):
        """The path for a call whose routing is on the host."""
        if call.needed.size > self.store.cache.num_slots:
            return self.sweep
        if self.skip is not None and call.single_token:
            call.kept = self.skip.keep(x, call)
            if call.kept is not None:
                return self.skip
        return self.layered

    def row_plan(self, stock_rows: int, array_experts: int, sorted_rows: bool) -> kernel_match.RowPlan:
        """How to shape calls on a tensor of `array_experts` experts (slots, scratch) that
        compute part of a stock call of `stock_rows` (token, expert) pairs."""
        return kernel_match.plan_rows(self.backend, stock_rows, self.store.cache.num_experts,
                                      array_experts, sorted_rows, self.quantized)

    def whole(self, x, indices, ids):
        """The stock call on the slots (every expert of `ids` resident), or, where the slot
        tensors' smaller expert count would make the backend pick another kernel than stock's
        (Metal), the same pairs in calls that pick stock's."""
        store = self.store
        sort = stock_sorts(indices.size)
        plan = self.row_plan(ids.size, store.cache.num_slots, sort)
        if plan.whole(ids.size):
            return self.inner(x, store.device_slots(indices))
        flat = ids.reshape(-1)
        pos = np.arange(flat.size)
        ys, ps = call_pairs(self.inner, token_rows(x), pos, store.cache.slot_of[flat], ids.shape[-1], sort, plan)
        return unflatten_pairs(stitch(ys, ps, axis=0), ids.shape)
