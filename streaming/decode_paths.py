"""The ways a streamed layer computes one call; StreamedSwitch picks one path object per call.
Each path holds the parts it uses: the layer's ExpertStore (slots, reads, pins, counters), its
ExpertCompute (the stock block on the slot arrays, stock's kernel rule) and, where it reads
outside the cache, the model's ScratchPool.

- ResidentPath: every expert of the layer in a slot; stock's call on the device slot table.
- ComputeFloor: benchmark only, every lookup made a hit (no reads) to time compute alone.
- LayerByLayer: the call's routing comes to the host (`route`), its misses are read (hits
  computing meanwhile), and the lookahead starts reading the next layer's guessed experts. A
  decode token's misses the policy does not admit are read into a scratch buffer for that call
  only.
- LossySkip: skip_miss_below; a decode token's light misses are dropped instead of read.
The prefill sweep (more experts than slots) is prefill_sweep.PrefillSweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

from .cache import among
from .expert_calls import ExpertCompute, stitch, token_rows, unflatten_pairs
from .expert_store import ExpertStore



def stock_sorts(indices_size: int) -> bool:
    """Stock SwitchGLU's rule. We evaluate it on the call's whole index array, never on a
    subset, so the kernel path (sorted or not) is always stock's."""
    return indices_size >= 64


@dataclass
class RoutedCall:
    """A call's routing, on the host after the layer's one sync."""

    ids: np.ndarray  # routed expert ids, shaped like the call's indices
    needed: np.ndarray  # the distinct experts of the call
    sorts: bool  # whether stock sorts this call's pairs
    # (lookahead.Lookahead, its guess) for each later layer guessed with this call
    guesses: list = field(default_factory=list)
    kept: Optional[np.ndarray] = None  # LossySkip: positions of the token's experts to compute

    @property
    def single_token(self) -> bool:
        return self.ids.size == self.ids.shape[-1]

    def issue_guess(self) -> None:
        """Start the later layers' reads of the guesses, nearest layer first. Paths call it
        after their own reads started, so that a guess is queued behind them and never delays
        a real miss."""
        for lookahead, guess in self.guesses:
            lookahead.issue(np.array(guess))


def route(store: ExpertStore, lookaheads, x: mx.array, indices: mx.array) -> RoutedCall:
    """The layer's one sync point: its routing (and the lookahead's guesses for later layers,
    evaluated with it) to the host."""
    store.await_prefetch()
    guesses = []
    if indices.size == indices.shape[-1]:
        for look in lookaheads:
            guess = look.guess(x)
            if guess is not None:
                guesses.append((look, guess))
    store.sync([indices] + [g for _, g in guesses])
    ids = np.array(indices)
    store.record(ids)
    # The distinct experts, ascending: np.unique's result, in a third of its Python calls.
    needed = np.bincount(ids.reshape(-1), minlength=store.cache.num_experts).nonzero()[0]
    store.score_guess(needed)
    return RoutedCall(ids, needed, stock_sorts(indices.size), guesses)


def route_chunks(store: ExpertStore, indices: list[mx.array]) -> list[RoutedCall]:
    """`route` for a prompt pass's chunks at one layer (no lookahead: guesses are a decode
    token's). One sync per chunk, in chunk order: evaluated together, MLX would hold every
    chunk's attention temporaries at once; one at a time, the peak is stock's one chunk. Each
    later chunk's temporaries are larger (more keys), so MLX's buffer cache could not reuse the
    earlier ones and kept them all: it is emptied after each chunk, as stock's loop empties it.
    As each chunk but the last arrives, the experts it needs start reading (`read_ahead`) while
    the next chunks' attention computes; they land before the layer computes."""
    calls = []
    for n, ind in enumerate(indices, start=1):
        store.sync(ind)
        mx.clear_cache()
        ids = np.array(ind)
        store.record(ids)
        calls.append(RoutedCall(ids, np.unique(ids), stock_sorts(ind.size)))
        if n < len(indices):  # the last chunk's experts have no compute left to hide behind
            store.read_ahead(calls[-1].needed)
    store.await_prefetch()
    store.score_guess(np.unique(np.concatenate([c.needed for c in calls])))
    return calls


class ResidentPath:
    """Every expert of the layer in a slot: the stock call with ids mapped on the device, no
    sync and no bookkeeping beyond a counter (stock's cost)."""

    name = "resident"

    def __init__(self, store: ExpertStore, compute: ExpertCompute):
        self.store, self.compute = store, compute

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self.store.count_resident_call()
        self.store.record(indices)
        return self.compute(x, self.store.device_slots(indices))


class ComputeFloor:
    """Benchmark only: compute as if every expert were resident (expert e uses slot e % slots,
    no reads, no sync), to time the compute of a model too big for memory."""

    name = "compute_floor"

    def __init__(self, store: ExpertStore, compute: ExpertCompute):
        self.store, self.compute = store, compute

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self.compute(x, mx.remainder(indices, self.store.cache.num_slots))


class LayerByLayer:
    """Demand reads: read the call's misses into slots, then compute from the slots."""

    name = "layer_by_layer"

    def __init__(self, store: ExpertStore, compute: ExpertCompute, scratch=None, overlap: bool = True):
        self.store, self.compute = store, compute
        self.scratch = scratch  # prefill_sweep.ScratchPool for the misses the policy declines, or None
        self.overlap = overlap  # compute a decode token's hits while its misses are read

    def __call__(self, x: mx.array, indices: mx.array, call: RoutedCall) -> mx.array:
        store = self.store
        cache = store.cache
        missing = cache.access(call.needed)
        passing = self._not_admitted(missing, call)
        if passing.size:
            missing = missing[~among(missing, passing, cache.num_experts)]
        reads = store.start_reads(missing, protected=call.needed) if missing.size else None
        passing_reads = self._read_passing(passing) if passing.size else None
        call.issue_guess()
        if passing_reads is not None:
            return self._in_parts(x, call.ids, missing, reads, passing, passing_reads)
        if reads is None:
            return self._whole(x, indices, call.ids)
        # Overlap only where a read from the shards is left to hide: misses all copied from the
        # side buffer take stock's one call, with less host work than the parts.
        if (self.overlap and call.single_token and missing.size < call.needed.size and not call.sorts
                and reads.from_disk):
            store.count_overlap_call()
            return self._in_parts(x, call.ids, missing, reads)
        store.finish_reads(reads)
        return self._whole(x, indices, call.ids)

    def _whole(self, x, indices, ids):
        """The stock call on the slots (every expert of `ids` resident), or, where the slot
        tensors' smaller expert count would make the backend pick another kernel than stock's
        (Metal), the same pairs in calls that pick stock's."""
        store, compute = self.store, self.compute
        sort = stock_sorts(indices.size)
        plan = compute.row_plan(ids.size, store.cache.num_slots, sort)
        if plan.whole(ids.size):
            return compute(x, store.device_slots(indices))
        flat = ids.reshape(-1)
        pos = np.arange(flat.size)
        ys, ps = compute.pairs(token_rows(x), pos, store.cache.slot_of[flat], ids.shape[-1], sort, plan)
        return unflatten_pairs(stitch(ys, ps, axis=0), ids.shape)

    def _not_admitted(self, missing: np.ndarray, call: RoutedCall) -> np.ndarray:
        """A decode token's misses the policy declines to keep (read into scratch for this
        call only); none where there is no scratch or they would not fit one batch of it."""
        scratch = self.scratch
        if not missing.size or not call.single_token or call.sorts or scratch is None:
            return missing[:0]
        cache = self.store.cache
        passing = missing[~among(missing, cache.admitted(missing, protected=call.needed), cache.num_experts)]
        return passing if passing.size <= scratch.batch else passing[:0]

    def _read_passing(self, passing: np.ndarray):
        store = self.store
        store.count_bypassed(int(passing.size))
        buffer = self.scratch.buffers(store.slots.tensors)[0]
        return store.read_into(buffer, passing, np.arange(passing.size, dtype=np.int32))

    def _in_parts(self, x, ids, missing, reads, passing=None, passing_reads=None):
        """One token computed in parts: its hits (while the reads run, with overlap), then the
        misses read into slots, then the declined ones from their scratch buffer."""
        store, compute = self.store, self.compute
        cache = store.cache
        k = ids.shape[-1]
        flat = ids.reshape(-1)
        rows = token_rows(x)
        plan = compute.row_plan(k, cache.num_slots, False)
        in_scratch = among(flat, passing, cache.num_experts) if passing is not None else np.zeros(flat.size, dtype=bool)
        read_now = among(flat, missing, cache.num_experts)
        hit_pos = np.flatnonzero(~in_scratch & ~read_now)
        if not self.overlap:  # every read in before anything computes
            for pending_reads in (reads, passing_reads):
                if pending_reads is not None:
                    store.finish_reads(pending_reads)
            reads = None
        ys, ps = compute.pairs(rows, hit_pos, cache.slot_of[flat[hit_pos]], k, False, plan)
        if ys:
            mx.async_eval(ys)
        if reads is not None:
            store.finish_reads(reads, pending=ys)
        if read_now.any():
            pos = np.flatnonzero(read_now)
            y, p = compute.pairs(rows, pos, cache.slot_of[flat[pos]], k, False, plan)
            ys, ps = ys + y, ps + p
        if passing_reads is not None:
            if self.overlap:
                store.finish_reads(passing_reads)
            buffer = passing_reads.target
            local = np.full(cache.num_experts, -1, dtype=np.int32)
            local[passing] = np.arange(passing.size, dtype=np.int32)
            pos = np.flatnonzero(in_scratch)
            y, p = compute.pairs(rows, pos, local[flat[pos]], k, False, compute.row_plan(k, buffer.num_slots, False),
                                 buffer)
            store.sync(y)  # the scratch buffer is free for the next layer once this ran
            ys, ps = ys + y, ps + p
        return unflatten_pairs(stitch(ys, ps, axis=0), ids.shape)


class LossySkip:
    """skip_miss_below: a decode token's missing experts of low routing weight are not read;
    they contribute zeros. Chosen for a call only when `keep` drops something."""

    name = "lossy_skip"

    def __init__(self, store: ExpertStore, compute: ExpertCompute, skipper):
        self.store, self.compute = store, compute
        self.skipper = skipper  # lossy.MissSkipper

    def keep(self, x: mx.array, call: RoutedCall) -> Optional[np.ndarray]:
        """Positions of the token's experts to compute, or None when nothing is skipped."""
        absent = call.needed[~self.store.cache.resident(call.needed)]
        if absent.size == 0:
            return None
        skip = self.skipper.light(x, call.ids) & np.isin(call.ids.reshape(-1), absent)
        if not skip.any():
            return None
        self.store.count_skipped(int(skip.sum()))
        return np.flatnonzero(~skip)

    def __call__(self, x: mx.array, indices: mx.array, call: RoutedCall) -> mx.array:
        store = self.store
        ids, kept = call.ids, call.kept
        k = ids.shape[-1]
        axis = ids.ndim - 1
        needed = np.unique(ids[..., kept])
        missing = store.cache.access(needed)
        reads = store.start_reads(missing, protected=needed) if missing.size else None
        call.issue_guess()
        if reads is not None:
            store.finish_reads(reads)
        y = self.compute(x, store.slots_for(ids[..., kept]))
        dropped = np.setdiff1d(np.arange(k), kept)
        zeros = mx.zeros((*y.shape[:axis], dropped.size, *y.shape[axis + 1:]), dtype=y.dtype)
        return stitch([y, zeros], [kept, dropped], axis)
