"""Everything of one streamed layer that is not MLX module state: the slot table, the slot
memory, reads (demand and speculative), and the pending outputs that pin slots."""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import numpy as np

from .cache import ExpertCache
from .errors import ReadError
from .reader import ExpertReader, ReadRequest
from .slots import ExpertSlots

log = logging.getLogger("expert_stream")


class PendingReads:
    """Reads of `experts` into `slots` of `target`, running on the reader's threads."""

    __slots__ = ("target", "experts", "slots", "staged", "future")

    def __init__(self, target: ExpertSlots, experts, slots, staged, future):
        self.target, self.experts, self.slots, self.staged, self.future = target, experts, slots, staged, future


class LayerStream:
    def __init__(self, name: str, cache: ExpertCache, slots: ExpertSlots, reader: ExpertReader):
        self.name = name
        self.cache = cache
        self.slots = slots
        self.reader = reader
        self.pending: list[mx.array] = []  # outputs not known to be evaluated; they pin slots
        self.prefetching: PendingReads | None = None
        self.in_flight: list[PendingReads] = []  # reads this layer started and did not finish
        self.lookahead = None  # Lookahead into the next streamed layer (set by the loader)
        self.scratch = None  # ScratchPool shared by the model's layers (prefill sweep)
        self.last_guess: np.ndarray | None = None
        self.recorder = None  # TraceRecorder while the handle records routing
        self.position = 0  # index among the model's streamed layers (for the recorder)
        # Benchmark only: compute as if every expert were resident (expert e uses slot
        # e % slots, no reads, no sync) to time the compute floor of a model too big for RAM.
        self.forced_hits = False
        # Once a layer with a slot per expert holds them all, its slot table never changes:
        # the layer maps ids to slots on the device and needs no sync at all (stock's cost).
        self.all_resident = False
        self._table: mx.array | None = None
        self._table_version = -1
        # Set by DecodeSpeculation around a speculative pass (streaming/speculation.py): the
        # layer computes from the device table without a sync, leaves its routing here and
        # tells the pass's checks (streaming/pass_checks.py).
        self.speculative_pass = None
        self.speculated_ids: mx.array | None = None
        self.last_path = None  # "resident" | "overlap" | "sweep" | "skip" | "speculated"

    # -- pins ---------------------------------------------------------------------------------
    def settle(self) -> None:
        """Evaluate pending outputs of this layer: after this no graph reads its slots."""
        if self.pending:
            mx.eval(self.pending)
            self.pending = []

    # -- reads --------------------------------------------------------------------------------
    def read_into(self, target: ExpertSlots, experts: np.ndarray, slots: np.ndarray) -> PendingReads:
        """Start reading `experts` into `slots` of `target` (slot memory or a scratch buffer)."""
        if target.write_mode == "direct":
            staged = None
            dests = [target.destinations(int(s)) for s in slots]
        else:
            staged = target.staging(len(slots))
            dests = [[block[i] for block in staged.blocks] for i in range(len(slots))]
        # Offsets come from this layer's tensors: a scratch target is shared by layers whose
        # tensors have the same shapes, so its own `tensors` may describe another layer.
        requests = [
            ReadRequest(t.info.file, t.offset_of(e), t.row_bytes, d)
            for e, ds in zip(experts, dests)
            for t, d in zip(self.slots.tensors, ds)
        ]
        try:
            future = self.reader.submit(requests)
        except BaseException:
            target.release(staged)
            raise
        reads = PendingReads(target, experts, slots, staged, future)
        self.in_flight.append(reads)
        return reads

    def start_reads(self, experts: np.ndarray, protected: np.ndarray, prefetched: bool = False) -> PendingReads:
        """Reserve cache slots for `experts` (never evicting `protected`) and start reading them."""
        self.settle()
        slots = self.cache.place(experts, protected, prefetched)
        try:
            return self.read_into(self.slots, experts, slots)
        except BaseException:
            self.cache.release(slots)
            raise

    def finish_reads(self, reads: PendingReads, pending=()) -> None:
        """Wait for the reads and make the bytes visible to MLX; only then do their slots claim
        the experts. A read that fails leaves its slots empty."""
        t0 = time.perf_counter()
        try:
            try:
                result = reads.future.result()
                stats = self.cache.stats
                stats.read_seconds += time.perf_counter() - t0
                stats.bytes_read += result.bytes
                if reads.target.write_mode != "direct" and pending:
                    mx.eval(list(pending))  # a slice update on an array a pending graph reads would copy it
                reads.target.commit(reads.slots, reads.staged)
            finally:
                if reads in self.in_flight:
                    self.in_flight.remove(reads)
        except BaseException as exc:
            self._discard(reads)
            if isinstance(exc, ReadError):
                raise type(exc)(f"{self.name}: {exc}") from exc
            raise
        if reads.target is self.slots:
            self.cache.claim(reads.slots)
            if not self.all_resident:
                self.check_all_resident()

    def reap(self) -> None:
        """Before this layer starts new work: the reads a failed call left behind (all in flight
        but the lookahead's) are waited for, so that no thread still writes their slots or
        scratch buffers, and their slots freed."""
        for reads in [r for r in self.in_flight if r is not self.prefetching]:
            self.in_flight.remove(reads)
            try:
                reads.future.result()
            except Exception:
                pass
            self._discard(reads)

    def _discard(self, reads: PendingReads) -> None:
        reads.target.release(reads.staged)
        if reads.target is self.slots:
            self.cache.release(reads.slots)

    def check_all_resident(self) -> None:
        cache = self.cache
        if cache.num_slots == cache.num_experts and bool((cache.slot_of >= 0).all()):
            self.all_resident = True

    def slot_indices(self, ids: np.ndarray) -> mx.array:
        return mx.array(self.cache.slot_of[ids].astype(np.uint32))

    def device_slots(self, indices: mx.array) -> mx.array:
        """Slot numbers for routed `indices`, gathered on the device from a copy of the table
        that is refreshed only when the table changed: a step of hits moves no new array to
        the device (on CUDA each fresh host array costs a page-fault transfer). An expert not
        in a slot maps to slot 0, so that a speculative step's miss computes garbage, not an
        out-of-bounds read; the step is then thrown away."""
        if self._table_version != self.cache.version:
            self._table = mx.array(np.maximum(self.cache.slot_of, 0).astype(np.uint32))
            self._table_version = self.cache.version
        return self._table[indices]

    # -- lookahead ----------------------------------------------------------------------------
    def prefetch(self, guessed: np.ndarray, cap: int) -> None:
        """Start speculative reads of the guessed experts this layer lacks (first `cap`)."""
        self.await_prefetch()
        self.reap()
        wanted = guessed[~self.cache.resident(guessed)][:cap]
        if wanted.size == 0:
            return
        self.cache.stats.prefetch_reads += int(wanted.size)
        self.prefetching = self.start_reads(wanted, protected=guessed, prefetched=True)

    def await_prefetch(self) -> None:
        """Called before this layer computes: speculative bytes must have landed."""
        reads, self.prefetching = self.prefetching, None
        if reads is None:
            return
        try:
            self.finish_reads(reads)
        except Exception as exc:  # the demand read of the same bytes will report it properly
            log.debug("%s: speculative read failed: %s", self.name, exc)

    def record_guess(self, guessed: np.ndarray) -> None:
        self.last_guess = guessed

    def score_guess(self, needed: np.ndarray) -> None:
        """Compare the lookahead's last guess for this layer with what it really needed."""
        if self.last_guess is None:
            return
        stats = self.cache.stats
        stats.guesses += int(self.last_guess.size)
        stats.guess_hits += int(np.isin(self.last_guess, needed).sum())
        self.last_guess = None
