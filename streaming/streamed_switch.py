"""The streamed expert layer: a drop-in for mlx-lm's SwitchGLU / SwitchMLP whose routed experts
stay on disk. It wraps the stock module itself (its expert tensors swapped for slot arrays) and
calls it with slot numbers instead of expert ids, so the arithmetic, the activation and stock's
sort rule (sort the token-expert pairs when `indices.size >= 64`) are stock's own code.

Two situations need more than one stock call, and both keep every row's computation identical
(the calls are shaped so that the backend picks stock's kernel for each: kernel_match.py):
- decode with misses: the resident experts compute while the misses are read (overlap), then the
  missing ones; the two outputs are stitched back in routing order (a pure gather).
- a call that needs more experts than the layer has slots (long prefill under a small budget):
  the prefill sweep (prefill_sweep.py) runs the experts through the slots and a scratch buffer
  in groups, each group's (token, expert) pairs sorted exactly when stock sorts the whole call.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import kernel_match
from .expert_calls import call_pairs, stitch, token_rows, unflatten_pairs
from .layer_stream import LayerStream
from .prefill_sweep import sweep


def stock_sorts(indices_size: int) -> bool:
    """Stock SwitchGLU's rule. We evaluate it on the call's whole index array, never on a
    subset, so the kernel path (sorted or not) is always stock's."""
    return indices_size >= 64


class StreamedSwitch(nn.Module):
    """Called exactly like the SwitchGLU / SwitchMLP it replaces: `layer(x, indices)`."""

    def __init__(self, inner: nn.Module, stream: LayerStream, overlap: bool = True, skipper=None):
        super().__init__()
        self.inner = inner
        self.stream = stream
        self.overlap = overlap
        self.skipper = skipper  # lossy.MissSkipper when skip_miss_below is set
        self.online_budget = None  # OnlineBudget moving slots between layers (set by the loader)
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

    def row_plan(self, stock_rows: int, array_experts: int, sorted_rows: bool) -> kernel_match.RowPlan:
        """How to shape calls on a tensor of `array_experts` experts (slots, scratch) that
        compute part of a stock call of `stock_rows` (token, expert) pairs."""
        return kernel_match.plan_rows(self.backend, stock_rows, self.stream.cache.num_experts,
                                      array_experts, sorted_rows, self.quantized)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        stream = self.stream
        if stream.forced_hits:
            return self.inner(x, mx.remainder(indices, stream.cache.num_slots))
        if stream.all_resident and stream.recorder is None:
            stream.cache.stats.calls += 1
            stream.cache.stats.resident_calls += 1
            return self.inner(x, stream.device_slots(indices))
        checks = stream.speculative_pass
        if checks is not None and indices.size == indices.shape[-1]:
            stream.speculated_ids = indices  # checked by the pass, a group of layers at a time
            y = self.inner(x, stream.device_slots(indices))
            stream.pending.append(y)
            checks.computed(stream, y)  # may end the pass here (pass_checks.MissFound)
            return y
        stream.reap()
        if self.online_budget is not None:
            self.online_budget.apply(self)
        try:
            y = self._streamed(x, indices)
        except BaseException:
            stream.reap()  # a failed call leaves no read behind that could still write a slot
            raise
        stream.pending.append(y)
        return y

    def _streamed(self, x: mx.array, indices: mx.array) -> mx.array:
        """The layer-by-layer path: find the call's misses, read them, compute."""
        stream = self.stream
        stream.await_prefetch()
        single_token = indices.size == indices.shape[-1]
        look = stream.lookahead if single_token else None
        guess = look.guess(x) if look is not None else None
        if guess is not None:
            mx.eval(indices, guess)  # the layer's one sync point: its routing and the guess
        ids = np.array(indices)
        if stream.recorder is not None:
            stream.recorder.add(stream.position, ids)
        needed = np.unique(ids)
        stream.score_guess(needed)
        if needed.size > stream.cache.num_slots:
            return sweep(self, x, ids, needed, stock_sorts(indices.size))
        return self._from_slots(x, indices, ids, needed, look, guess)

    def _from_slots(self, x, indices, ids, needed, look, guess):
        stream = self.stream
        if self.skipper is not None and ids.size == ids.shape[-1]:
            kept = self._skip_light_misses(x, ids, needed)
            if kept is not None:
                return self._positions_only(x, ids, kept, look, guess)
        missing = stream.cache.access(needed)
        reads = stream.start_reads(missing, protected=needed) if missing.size else None
        if guess is not None:
            # Queued behind this layer's own reads, so a guess never delays a real miss.
            look.issue(np.array(guess))
        if reads is None:
            stream.last_path = "resident"
            return self._whole(x, indices, ids)
        if self.overlap and ids.size == ids.shape[-1] and missing.size < needed.size and not stock_sorts(indices.size):
            stream.last_path = "overlap"
            return self._overlapped(x, ids, missing, reads)
        stream.finish_reads(reads)
        stream.last_path = "resident"
        return self._whole(x, indices, ids)

    def _whole(self, x, indices, ids):
        """The stock call on the slots, or, where the slot tensors' smaller expert count would
        make the backend pick another kernel than stock's (Metal), the same pairs in calls
        that pick stock's."""
        stream = self.stream
        sort = stock_sorts(indices.size)
        plan = self.row_plan(ids.size, stream.cache.num_slots, sort)
        if plan.whole(ids.size):
            return self.inner(x, stream.device_slots(indices))
        flat = ids.reshape(-1)
        pos = np.arange(flat.size)
        ys, ps = call_pairs(self.inner, token_rows(x), pos, stream.cache.slot_of[flat], ids.shape[-1], sort, plan)
        return unflatten_pairs(stitch(ys, ps, axis=0), ids.shape)

    def _overlapped(self, x, ids, missing, reads):
        """One token: compute its resident experts while the missing ones are read."""
        stream = self.stream
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        plan = self.row_plan(k, stream.cache.num_slots, False)
        is_miss = np.isin(flat, missing)
        hit_pos, miss_pos = np.flatnonzero(~is_miss), np.flatnonzero(is_miss)
        rows = token_rows(x)
        y_hit, p_hit = call_pairs(self.inner, rows, hit_pos, stream.cache.slot_of[flat[hit_pos]], k, False, plan)
        mx.async_eval(y_hit)
        stream.finish_reads(reads, pending=y_hit)
        y_miss, p_miss = call_pairs(self.inner, rows, miss_pos, stream.cache.slot_of[flat[miss_pos]], k, False, plan)
        return unflatten_pairs(stitch(y_hit + y_miss, p_hit + p_miss, axis=0), ids.shape)

    def _skip_light_misses(self, x, ids, needed):
        """Lossy: positions of the token's experts to keep, or None when nothing is skipped."""
        absent = needed[~self.stream.cache.resident(needed)]
        if absent.size == 0:
            return None
        flat = ids.reshape(-1)
        skip = self.skipper.light(x, ids) & np.isin(flat, absent)
        if not skip.any():
            return None
        self.stream.cache.stats.skipped_misses += int(skip.sum())
        return np.flatnonzero(~skip)

    def _positions_only(self, x, ids, kept, look, guess):
        """Compute only the kept positions; dropped experts contribute zeros."""
        stream = self.stream
        k = ids.shape[-1]
        axis = ids.ndim - 1
        needed = np.unique(ids[..., kept])
        missing = stream.cache.access(needed)
        reads = stream.start_reads(missing, protected=needed) if missing.size else None
        if guess is not None:
            look.issue(np.array(guess))
        if reads is not None:
            stream.finish_reads(reads)
        stream.last_path = "skip"
        y = self.inner(x, stream.slot_indices(ids[..., kept]))
        dropped = np.setdiff1d(np.arange(k), kept)
        zeros = mx.zeros((*y.shape[:axis], dropped.size, *y.shape[axis + 1:]), dtype=y.dtype)
        return stitch([y, zeros], [kept, dropped], axis)
