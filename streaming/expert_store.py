"""The expert store of one streamed layer: its slot table (ExpertCache), its slot memory
(ExpertSlots), the reader, the reads it has in flight, and the outputs that still pin slots.

A miss is handled here: `start_reads` reserves slots for the missing experts (`cache.place`)
and starts the reader; `finish_reads` waits, makes the bytes visible and only then lets the
slots claim the experts (`cache.claim`); a failed read frees them (`cache.release`). `ensure`
does both in one call. The store is the only writer of this state: the decode paths
(decode_paths.py, prefill_sweep.py) call it, and count their events through its `count_*`
methods (the cache counts its own accesses and evictions).
"""

from __future__ import annotations

import logging
import time

import mlx.core as mx
import numpy as np

from .cache import ExpertCache
from .errors import ReadError
from .guess_buffer import COPIED, Guessed, GuessPool
from .reader import ExpertReader
from .slots import ExpertSlots

log = logging.getLogger("expert_stream")

# Outputs a layer keeps pinned before it evaluates the older ones (ExpertStore.pin).
PIN_BOUND = 4
# A layer's pinned outputs past this size (a prefill chunk's: tokens x top_k x hidden) are
# evaluated at once: held till the layer's next call, every layer's would stay in memory together.
PIN_BYTES = 2 << 20


class PendingReads:
    """Reads of `experts` into `slots` of `target`, running on the reader's threads."""

    __slots__ = ("target", "experts", "slots", "staged", "future", "from_disk")

    def __init__(self, target: ExpertSlots, experts, slots, staged, future, from_disk: int):
        self.target, self.experts, self.slots, self.staged, self.future = target, experts, slots, staged, future
        self.from_disk = from_disk  # experts read from the shards (the rest were copied from the side buffer)


class ExpertStore:
    def __init__(self, name: str, cache: ExpertCache, slots: ExpertSlots, reader: ExpertReader):
        self.name = name
        self.cache = cache
        self.slots = slots
        self.reader = reader
        self.pending: list[mx.array] = []  # outputs not known to be evaluated; they pin slots
        self.pending_bytes = 0  # their size, about (pin's bound)
        self.prefetching: PendingReads | None = None  # the previous layer's lookahead reads
        self.in_flight: list[PendingReads] = []  # reads this store started and did not finish
        self.last_guesses: list[tuple[int, np.ndarray]] = []  # (depth, guess) of earlier layers, to score
        self.guess_pool: GuessPool | None = None  # side buffers for guesses (None: guesses go into slots)
        self.readahead_pool: GuessPool | None = None  # a prompt pass's rows for routed experts, while it runs
        self.guessed: Guessed | None = None  # this layer's guessed experts in a side buffer
        self._read_on_demand = False  # the current call read from the shards
        self.recorder = None  # TraceRecorder while the handle records routing
        self.position = 0  # index among the model's streamed layers (for the recorder)
        # (file, start, row bytes) of each expert tensor: expert e's rows are start + e * row bytes
        self._rows = [(t.info.file, t.info.start, t.row_bytes) for t in slots.tensors]
        self._table: mx.array | None = None
        self._table_version = -1

    # -- pins ---------------------------------------------------------------------------------
    def pin(self, outputs) -> None:
        """Outputs computing from this layer's slots, not known to be evaluated: no read may
        overwrite those slots before they are (`settle`). Bounded: past PIN_BOUND the older
        ones are evaluated and let go (in decode they already are, after the routing sync: an
        eval of evaluated arrays costs about a microsecond), so calls that all hit hold no
        outputs (and their memory) without end; past PIN_BYTES all are evaluated at once."""
        self.pending.extend(outputs)
        self.pending_bytes += outputs[-1].nbytes * len(outputs)
        if self.pending_bytes > PIN_BYTES:
            self.settle()
        elif len(self.pending) > PIN_BOUND:
            mx.eval(self.pending[:-1])
            self.pending = self.pending[-1:]
            self.pending_bytes = self.pending[0].nbytes

    def hold(self, outputs) -> None:
        """Outputs of the call running now, pinned until the call evaluates them (`unpin`)."""
        self.pending.extend(outputs)

    def unpin(self) -> None:
        """The caller evaluated every pinned output."""
        self.pending = []
        self.pending_bytes = 0

    def settle(self) -> None:
        """Evaluate pending outputs of this layer: after this no graph reads its slots. Not
        counted as a sync: in decode the host has waited for them already (the last token)."""
        if self.pending:
            mx.eval(self.pending)
            self.pending = []
        self.pending_bytes = 0

    def sync(self, arrays) -> None:
        """Evaluate `arrays`, the compute thread waiting for the device: counted per layer, since
        on a fast GPU the syncs, not the reads, are what a decode token waits for."""
        t0 = time.perf_counter()
        mx.eval(arrays)
        stats = self.cache.stats
        stats.syncs += 1
        stats.sync_seconds += time.perf_counter() - t0

    # -- counters (the cache's LayerStats; the cache counts its accesses and evictions) -------
    def count_resident_call(self) -> None:
        stats = self.cache.stats
        stats.calls += 1
        stats.resident_calls += 1

    def count_overlap_call(self) -> None:
        self.cache.stats.overlap_calls += 1

    def count_sweep_call(self) -> None:
        self.cache.stats.sweep_calls += 1

    def count_bypassed(self, misses: int) -> None:
        self.cache.stats.bypassed += misses

    def count_skipped(self, misses: int) -> None:
        self.cache.stats.skipped_misses += misses

    def record(self, ids) -> None:
        """A call's routing (numpy, or the device's indices), for the recorder while the handle
        records."""
        if self.recorder is not None:
            self.recorder.add(self.position, ids)

    # -- slots --------------------------------------------------------------------------------
    def on_device(self) -> bool:
        """Whether a call can map ids to slots on the device, with no sync: every expert of the
        layer sits in a slot (its table no longer changes)."""
        return self.cache.holds_all()

    def slots_for(self, ids: np.ndarray) -> mx.array:
        """Slot numbers of resident experts `ids`, as an MLX index array."""
        return mx.array(self.cache.slot_of[ids].astype(np.uint32))

    def device_slots(self, indices: mx.array) -> mx.array:
        """Slot numbers for routed `indices` (all resident), gathered on the device from a copy
        of the table refreshed only when the table changed: a step of hits moves no new array
        to the device (on CUDA each fresh host array costs a page-fault transfer). Absent
        experts map to slot 0, so that no lookup can leave the slot arrays."""
        if self._table_version != self.cache.version:
            self._table = mx.array(np.maximum(self.cache.slot_of, 0).astype(np.uint32))
            self._table_version = self.cache.version
        return self._table[indices]

    # -- reads --------------------------------------------------------------------------------
    def ensure(self, experts: np.ndarray, protected: np.ndarray) -> None:
        """Make `experts` (not resident, not being read) resident, never evicting `protected`."""
        if experts.size:
            self.finish_reads(self.start_reads(experts, protected))

    def read_into(self, target: ExpertSlots, experts: np.ndarray, slots: np.ndarray) -> PendingReads:
        """Start reading `experts` into `slots` of `target` (slot memory or a scratch buffer)."""
        if target.write_mode == "direct":
            staged = None
            dests = [target.destinations(int(s)) for s in slots]
        else:
            staged = target.staging(len(slots))
            dests = [[block[i] for block in staged.blocks] for i in range(len(slots))]
        copied = self._from_guesses(experts, dests)
        # Offsets come from this layer's tensors: a scratch target is shared by layers whose
        # tensors have the same shapes, so its own `tensors` may describe another layer.
        # Plain (file, offset, length, dest) tuples: the reader's request form, made from the
        # table of (file, start, row bytes) built at load.
        requests = [
            (file, start + e * length, length, d)
            for e, ds, done in zip(experts.tolist(), dests, copied)
            if not done
            for (file, start, length), d in zip(self._rows, ds)
        ]
        self._read_on_demand = self._read_on_demand or bool(requests)
        try:
            future = self.reader.submit(requests) if requests else COPIED
        except BaseException:
            target.release(staged)
            raise
        reads = PendingReads(target, experts, slots, staged, future, int(len(experts) - copied.sum()))
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
        landed = reads.future.done()
        try:
            try:
                result = reads.future.result()
                stats = self.cache.stats
                stats.read_seconds += time.perf_counter() - t0
                stats.bytes_read += result.bytes
                if landed:
                    stats.reads_landed += reads.from_disk
                else:
                    stats.reads_waited += reads.from_disk
                # `copy` writes by an MLX scatter into the slot arrays, which would copy an array a
                # pending graph reads. `staged` and `cuda` write the reserved rows in place, rows
                # no pending graph reads (its hits are protected), and are done before the
                # caller builds on them: no wait for the device.
                if reads.target.write_mode == "copy" and pending:
                    self.sync(list(pending))
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

    def _from_guesses(self, experts: np.ndarray, dests) -> np.ndarray:
        """Copy the experts the side buffer holds into their destinations; the mask of those."""
        if self.guessed is None or not experts.size:
            return np.zeros(len(experts), dtype=bool)
        copied = self.guessed.copy_out(np.asarray(experts), dests)
        n = int(copied.sum())
        stats = self.cache.stats
        if self.guessed.pool.readahead:
            stats.readahead_hits += n
        else:
            stats.prefetch_hits += n
            stats.guess_buffer_hits += n
        return copied

    def _discard(self, reads: PendingReads) -> None:
        reads.target.release(reads.staged)
        if reads.target is self.slots:
            self.cache.release(reads.slots)

    # -- lookahead ----------------------------------------------------------------------------
    def prefetch(self, guessed: np.ndarray, cap: int, depth: int = 1) -> None:
        """Start reading the guessed experts this layer lacks (the first `cap`): into a side
        buffer (guess_pool set) or into slots. `depth`: how many layers ahead the guess was made."""
        self.last_guesses.append((depth, guessed))
        if self.guess_pool is not None:
            self._prefetch_to_buffer(guessed, cap)
            return
        self.await_prefetch()
        self.reap()
        wanted = guessed[~self.cache.resident(guessed)][:cap]
        if wanted.size == 0:
            return
        self.cache.stats.prefetch_reads += int(wanted.size)
        self.prefetching = self.start_reads(wanted, protected=guessed, prefetched=True)

    def _prefetch_to_buffer(self, guessed: np.ndarray, cap: int) -> None:
        """The first `cap` guessed experts that are neither resident nor already guessed by a
        layer further back (prefetch_depth > 1) are read into this layer's side buffer."""
        wanted = guessed[~self.cache.resident(guessed)]
        if self.guessed is not None:
            wanted = self.guessed.wanted(wanted)
        if wanted.size == 0 or cap == 0:
            return
        if self.guessed is None:
            self.guessed = Guessed(self.guess_pool, self.slots.tensors, self.cache.num_experts)
        wanted = wanted[: min(cap, self.guessed.room)]
        if wanted.size == 0:
            return
        self.guessed.start(self.reader, wanted)
        self.cache.stats.prefetch_reads += int(wanted.size)

    def read_ahead(self, needed: np.ndarray) -> None:
        """In a prompt pass, once a chunk's routing is on the host: start reading the experts it
        needs that are neither resident nor already coming into the pass's rows (as many as
        fit); the layer's sweep copies them from there (`_from_guesses`)."""
        pool = self.readahead_pool
        if pool is None or pool.capacity == 0 or (self.guessed is not None and self.guessed.pool is not pool):
            return
        if self.guessed is None:
            self.guessed = Guessed(pool, self.slots.tensors, self.cache.num_experts)
        wanted = self.guessed.wanted(needed[~self.cache.resident(needed)])[: self.guessed.room]
        if wanted.size:
            self.guessed.start(self.reader, wanted)
            self.cache.stats.readahead_reads += int(wanted.size)

    def await_prefetch(self) -> None:
        """Called before this layer computes: the guessed experts' bytes must have landed."""
        if self.guessed is not None:
            self.guessed.land(self.cache.stats)
        reads, self.prefetching = self.prefetching, None
        if reads is None:
            return
        try:
            self.finish_reads(reads)
        except Exception as exc:  # the demand read of the same bytes will report it properly
            log.debug("%s: prefetch read failed: %s", self.name, exc)

    def end_call(self) -> None:
        """After this layer's routed call: counted if it read on demand; the side buffer's
        guesses are spent (a wrong one cost its bytes and nothing else), the buffer goes back."""
        if self._read_on_demand:
            self.cache.stats.demand_calls += 1
            self._read_on_demand = False
        guessed, self.guessed = self.guessed, None
        if guessed is not None:
            guessed.close()

    def score_guess(self, needed: np.ndarray) -> None:
        """Compare the lookahead's guesses for this layer with what it really needed."""
        stats = self.cache.stats
        for depth, guess in self.last_guesses:
            right = int(np.isin(guess, needed).sum())
            if depth == 1:
                stats.guesses += int(guess.size)
                stats.guess_hits += right
            else:
                stats.far_guesses += int(guess.size)
                stats.far_guess_hits += right
        self.last_guesses = []
