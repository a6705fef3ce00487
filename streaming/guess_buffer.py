"""Side buffers for the lookahead's guessed experts: host rows outside the slot cache.

A guessed expert's bytes land here, not in a slot. A wrong guess then evicts nothing, and the
cache moves exactly as it does with the lookahead off (on the trained fixture, most of the
extra bytes of guesses read into slots were demand misses of experts those guesses had
evicted). When the layer's call does need a guessed expert, the miss path reserves its slot
(or scratch rows) as for any miss, and the bytes are copied from here instead of read from the
shard: a right guess saves the wait for the read, a wrong one costs its bytes and nothing else.

The rows are plain host memory on every backend; the copy goes where a read would have
written (a slot's bytes in direct mode, staging rows otherwise), so the miss path's commit and
claim stay as they are.

A prompt pass reads into the same rows (a pool of its own, `readahead`): not guesses but the
experts a chunk's routing named, read while the later chunks' attention computes, so that the
layer's sweep copies them instead of waiting for the disk (prompt_pass.py).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from .read_plan import ReadResult
from .reader import ReadRequest

log = logging.getLogger("expert_stream")


class GuessRows:
    """Host rows for up to `capacity` experts of one expert layout: one (capacity, row_bytes)
    array per stacked tensor."""

    def __init__(self, tensors, capacity: int):
        self.key = layout_key(tensors)
        self.capacity = capacity
        self.rows = [np.empty((capacity, t.row_bytes), dtype=np.uint8) for t in tensors]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)


def layout_key(tensors) -> tuple:
    return tuple((t.leaf, t.row_bytes) for t in tensors)


class GuessPool:
    """The side buffers of one model, shared by its layers: a layer borrows one when the first
    guess for it is read and gives it back after its call. At most one buffer per guessed layer
    is out at a time (depth + 1 with the lookahead `depth` layers ahead)."""

    def __init__(self, capacity: int, readahead: bool = False):
        self.capacity = capacity  # experts a buffer holds: guesses read per layer per token
        self.readahead = readahead  # a prompt pass's reads of routed experts, not guesses
        self._free: dict[tuple, list[GuessRows]] = {}
        self.made = 0

    def take(self, tensors) -> GuessRows:
        free = self._free.setdefault(layout_key(tensors), [])
        if free:
            return free.pop()
        self.made += 1
        return GuessRows(tensors, self.capacity)

    def give(self, rows: GuessRows) -> None:
        self._free.setdefault(rows.key, []).append(rows)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for free in self._free.values() for r in free)


class _Copied:
    """The finished 'read' of a batch whose bytes all came from a side buffer."""

    def done(self) -> bool:
        return True

    def result(self, timeout=None) -> ReadResult:
        return ReadResult(0, 0.0, 0, 0, 0)


COPIED = _Copied()


class Guessed:
    """One layer's guessed experts in a borrowed side buffer: the reads filling it, and the
    experts whose bytes have landed (row per expert)."""

    def __init__(self, pool: GuessPool, tensors, num_experts: int):
        self.pool = pool
        self.tensors = tensors
        self.buffer = pool.take(tensors)
        self.row_of = np.full(num_experts, -1, dtype=np.int32)  # landed experts only
        self.used = 0  # rows given to reads
        self.reads: list[tuple[np.ndarray, np.ndarray, object]] = []  # (experts, rows, future)

    def wanted(self, experts: np.ndarray) -> np.ndarray:
        """Of `experts`, those neither landed nor being read into this buffer."""
        taken = np.zeros(self.row_of.size, dtype=bool)
        taken[self.row_of >= 0] = True
        for exp, _, _ in self.reads:
            taken[exp] = True
        return experts[~taken[experts]]

    @property
    def room(self) -> int:
        return self.buffer.capacity - self.used

    def start(self, reader, experts: np.ndarray) -> None:
        """Start reading `experts` (at most `room`) into free rows."""
        rows = np.arange(self.used, self.used + experts.size, dtype=np.int32)
        requests = [
            ReadRequest(t.info.file, t.offset_of(e), t.row_bytes, self.buffer.rows[i][r])
            for e, r in zip(experts, rows)
            for i, t in enumerate(self.tensors)
        ]
        future = reader.submit(requests)
        self.used += experts.size
        self.reads.append((experts, rows, future))

    def land(self, stats) -> None:
        """Wait for the reads; their experts become usable. A failed read's experts are
        dropped (their demand read, if the layer needs them, reports the error properly)."""
        reads, self.reads = self.reads, []
        for experts, rows, future in reads:
            landed = future.done()
            t0 = time.perf_counter()
            try:
                result = future.result()
            except Exception as exc:
                log.debug("guessed experts %s: read failed: %s", experts.tolist(), exc)
                continue
            finally:
                stats.read_seconds += time.perf_counter() - t0
            stats.bytes_read += result.bytes
            if landed:
                stats.reads_landed += len(experts)
            else:
                stats.reads_waited += len(experts)
            self.row_of[experts] = rows

    def copy_out(self, experts: np.ndarray, dests) -> np.ndarray:
        """Copy the landed ones of `experts` into their destinations (`dests[i]`: one writable
        byte row per tensor); returns the mask of those copied."""
        rows = self.row_of[experts]
        hit = rows >= 0
        for i in np.flatnonzero(hit):
            for dest, block in zip(dests[i], self.buffer.rows):
                np.copyto(dest, block[rows[i]])
        return hit

    def close(self) -> None:
        """Wait for reads still running (no thread may write the rows after this), then give
        the buffer back."""
        for _, _, future in self.reads:
            try:
                future.result()
            except Exception:
                pass
        self.reads = []
        self.pool.give(self.buffer)
        self.buffer = None
