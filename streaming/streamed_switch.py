"""The streamed expert layer: a drop-in for mlx-lm's SwitchGLU / SwitchMLP whose routed experts
stay on disk. It wraps the stock module itself (its expert tensors swapped for slot arrays) and
calls it with slot numbers instead of expert ids, so the arithmetic, the activation and stock's
sort rule (sort the token-expert pairs when `indices.size >= 64`) are stock's own code.

Two situations need more than one stock call, and both keep every row's computation identical:
- decode with misses: the resident experts compute while the misses are read (overlap), then the
  missing ones; the two outputs are stitched back in routing order (a pure gather).
- a call that needs more experts than the layer has slots (long prefill under a small budget):
  the experts go through the slots in groups; each group computes its (token, expert) pairs with
  the projection layers, sorted exactly when stock would sort the whole call.
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import ExpertCache
from .errors import ReadError
from .reader import ExpertReader, ReadRequest
from .slots import ExpertSlots

# Stock SwitchGLU sorts when indices.size >= 64; we evaluate the same predicate on the same
# array, never on a subset, so the kernel path always matches stock's.
def stock_sorts(indices_size: int) -> bool:
    return indices_size >= 64


class LayerStream:
    """Everything of one streamed layer that is not MLX module state: slot table, slot memory,
    reads, and the pending output that pins the slots it reads."""

    def __init__(self, name: str, cache: ExpertCache, slots: ExpertSlots, reader: ExpertReader):
        self.name = name
        self.cache = cache
        self.slots = slots
        self.reader = reader
        self.pending: list[mx.array] = []  # outputs not known to be evaluated; they pin slots
        self.last_path = None  # "resident" | "overlap" | "sweep", for tests and stats

    def settle(self) -> None:
        """Evaluate pending outputs of this layer: after this no graph reads its slots."""
        if self.pending:
            mx.eval(self.pending)
            self.pending = []

    def start_reads(self, experts: np.ndarray, protected: np.ndarray, prefetched: bool = False):
        """Give `experts` slots (never evicting `protected`) and start reading them."""
        self.settle()
        slots = self.cache.place(experts, protected, prefetched)
        dests = [self.slots.destinations(int(s)) for s in slots]
        requests = [
            ReadRequest(t.info.file, t.offset_of(e), t.row_bytes, d)
            for e, ds in zip(experts, dests)
            for t, d in zip(self.slots.tensors, ds)
        ]
        return _Reads(experts, slots, dests, self.reader.submit(requests))

    def finish_reads(self, reads: "_Reads", pending: list[mx.array] = ()) -> None:
        """Wait for the reads and make the bytes visible to MLX."""
        t0 = time.perf_counter()
        try:
            result = reads.future.result()
        except Exception as exc:
            self.cache.drop(reads.experts)
            if isinstance(exc, ReadError):
                raise ReadError(f"{self.name}: {exc}") from exc
            raise
        stats = self.cache.stats
        stats.read_seconds += time.perf_counter() - t0
        stats.bytes_read += result.bytes
        if self.slots.write_mode != "direct" and pending:
            mx.eval(list(pending))  # a slice update on an array a pending graph reads would copy it
        self.slots.commit(reads.slots, reads.dests)

    def slot_indices(self, ids: np.ndarray) -> mx.array:
        return mx.array(self.cache.slot_of[ids].astype(np.uint32))


class _Reads:
    __slots__ = ("experts", "slots", "dests", "future")

    def __init__(self, experts, slots, dests, future):
        self.experts, self.slots, self.dests, self.future = experts, slots, dests, future


class StreamedSwitch(nn.Module):
    """Called exactly like the SwitchGLU / SwitchMLP it replaces: `layer(x, indices)`."""

    def __init__(self, inner: nn.Module, stream: LayerStream, overlap: bool = True):
        super().__init__()
        self.inner = inner
        self.stream = stream
        self.overlap = overlap

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        stream = self.stream
        ids = np.array(indices)  # the layer's one sync point: the router's choice
        needed = np.unique(ids)
        if needed.size > stream.cache.num_slots:
            y = self._sweep(x, ids, needed, stock_sorts(indices.size))
        else:
            y = self._resident(x, indices, ids, needed)
        stream.pending.append(y)
        return y

    def _resident(self, x, indices, ids, needed):
        stream = self.stream
        missing = stream.cache.access(needed)
        if missing.size == 0:
            stream.last_path = "resident"
            return self.inner(x, stream.slot_indices(ids))
        reads = stream.start_reads(missing, protected=needed)
        single_token = ids.size == ids.shape[-1]
        if self.overlap and single_token and missing.size < needed.size and not stock_sorts(indices.size):
            stream.last_path = "overlap"
            return self._overlapped(x, ids, missing, reads)
        stream.finish_reads(reads)
        stream.last_path = "resident"
        return self.inner(x, stream.slot_indices(ids))

    def _overlapped(self, x, ids, missing, reads):
        """One token: compute its resident experts while the missing ones are read."""
        stream = self.stream
        k = ids.shape[-1]
        is_miss = np.isin(ids.reshape(-1), missing)
        hit_pos, miss_pos = np.flatnonzero(~is_miss), np.flatnonzero(is_miss)
        lead = ids.shape[:-1]
        y_hit = self.inner(x, stream.slot_indices(ids[..., hit_pos]))
        mx.async_eval(y_hit)
        stream.finish_reads(reads, pending=[y_hit])
        y_miss = self.inner(x, stream.slot_indices(ids[..., miss_pos]))
        order = np.concatenate([hit_pos, miss_pos])
        inverse = np.empty(k, dtype=np.int32)
        inverse[order] = np.arange(k, dtype=np.int32)
        y = mx.concatenate([y_hit, y_miss], axis=len(lead))
        return mx.take(y, mx.array(inverse), axis=len(lead))

    def _sweep(self, x, ids, needed, do_sort):
        """More experts than slots: run them through the slots in groups (resident ones first)."""
        stream = self.stream
        cache = stream.cache
        cache.stats.sweep_calls += 1
        stream.last_path = "sweep"
        missing = cache.access(needed)
        order = np.concatenate([needed[cache.resident(needed)], missing])
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        rows_of = mx.expand_dims(x, (-2, -3)).flatten(0, -3)  # one row per token, as stock
        outputs, positions = [], []
        for start in range(0, order.size, cache.num_slots):
            group = order[start : start + cache.num_slots]
            absent = group[~cache.resident(group)]
            if absent.size:
                stream.finish_reads(stream.start_reads(absent, protected=group))
            pos = np.flatnonzero(np.isin(flat, group))
            slot_ids = cache.slot_of[flat[pos]]
            if do_sort:
                by_slot = np.argsort(slot_ids, kind="stable")
                pos, slot_ids = pos[by_slot], slot_ids[by_slot]
            y = self._experts(rows_of[mx.array(pos // k)], mx.array(slot_ids.astype(np.uint32)), do_sort)
            stream.pending.append(y)
            outputs.append(y)
            positions.append(pos)
        stream.settle()
        pos = np.concatenate(positions)
        inverse = np.empty_like(pos)
        inverse[pos] = np.arange(pos.size)
        y = mx.concatenate(outputs, axis=0)[mx.array(inverse)]
        return mx.unflatten(y, 0, ids.shape).squeeze(-2)

    def _experts(self, x, idx, do_sort):
        """The body of SwitchGLU / SwitchMLP between its sort and unsort, on given rows."""
        inner = self.inner
        if "gate_proj" in inner:
            up = inner.up_proj(x, idx, sorted_indices=do_sort)
            gate = inner.gate_proj(x, idx, sorted_indices=do_sort)
            return inner.down_proj(inner.activation(up, gate), idx, sorted_indices=do_sort)
        h = inner.activation(inner.fc1(x, idx, sorted_indices=do_sort))
        return inner.fc2(h, idx, sorted_indices=do_sort)
