"""The expert reader: batches of byte ranges from the checkpoint's shards into caller-owned memory.

    reader = ExpertReader(paths, threads=4)
    reader.read([ReadRequest(file, offset, length, dest), ...])      # blocking
    fut = reader.submit(requests)                                    # runs in the background
    fut.result()                                                     # -> ReadResult

- Requests come unsorted; they are sorted by (file, offset) and adjacent ranges of one file
  (offset + length == next offset) become one read with one destination per request (preadv),
  cut into spans of at most `cap` bytes, `cap = clamp(ceil(total / threads), 1 MiB, 16 MiB)`, so
  that a batch keeps `threads` reads in flight, and at most IOV_MAX destinations per span
  (read_plan.py; native/reader.c applies the same rule).
- Spans run in parallel on one of two pools with the same shape (read_pools.py), chosen once:
  the C extension's persistent pthreads (the GIL released for the whole batch) or, where it is
  not built, a thread pool with `os.preadv` (which releases the GIL per call). Same bytes.
- submit() starts the batch on the pool's threads and returns a StartedRead; the first thread
  that asks for its result collects it (waiting on the pool's threads directly), and close()
  collects the batches nobody asked for.
- Page cache bypass (`cache_bypass`: direct, fadvise, nocache, none, auto; shard_files.py);
  where the OS or filesystem refuses a mode (O_DIRECT on tmpfs) the reader falls back and
  records what it uses in `.cache_bypass` and why in `.cache_bypass_note`.
- Errors: a missing file, a short read (truncated shard), EIO... raise `ReadError` naming the file,
  offset and length; a bad request (size mismatch, read-only destination) raises ValueError at
  once, also from submit(). With `identities`, a shard that changed since it was indexed fails
  that read and every later one (ShardChangedError).
"""

from __future__ import annotations

import concurrent.futures
import errno as _errno
import threading
from typing import Optional, Sequence

from .errors import ReadError
from .read_plan import ALIGN, MAX_SPAN, MIN_SPAN, ReadRequest, ReadResult, plan_spans, system_iov_max
from .read_pools import _native, pool_type
from .shard_files import MODES, ShardFiles

__all__ = ["ReadRequest", "ReadResult", "ExpertReader", "native_available", "plan_spans", "ALIGN"]

BOUNCE_BYTES = 4 << 20


def native_available() -> bool:
    return _native is not None


class ExpertReader:
    """Batch reader over a fixed list of shard files. Thread-safe: several threads may read or
    submit at once."""

    def __init__(self, paths: Sequence, *, threads: int = 4, cache_bypass: str = "auto", backend: str = "auto",
                 max_span_bytes: int = MAX_SPAN, min_span_bytes: int = MIN_SPAN, bounce_bytes: int = BOUNCE_BYTES,
                 identities: Optional[Sequence] = None):
        if cache_bypass not in MODES:
            raise ValueError(f"cache_bypass must be one of {', '.join(MODES)}, got {cache_bypass!r}")
        pool = pool_type(backend)
        threads = int(threads)
        if threads < 1:
            raise ValueError("threads must be >= 1")
        if max_span_bytes < ALIGN:
            raise ValueError(f"max_span_bytes must be >= {ALIGN}")
        self.threads = threads
        self.pool = pool(len(paths), threads, max(ALIGN, -(-int(bounce_bytes) // ALIGN) * ALIGN),
                         int(max_span_bytes), max(1, int(min_span_bytes)), system_iov_max())
        try:
            self.shards = ShardFiles(paths, cache_bypass, identities)  # checks the identities now
        except BaseException:
            self.pool.close(wait=False)
            raise
        self._state = threading.Condition(threading.Lock())  # guards the four fields below and the totals
        self._closing = False  # no new batches
        self._closed = False  # no batch runs any more
        self._inflight = 0  # batches being read or collected now
        self._uncollected: set = set()  # StartedRead whose result nobody asked for yet (close() does)
        # running totals (bytes, seconds, batches), for stats
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.total_batches = 0

    @property
    def backend(self) -> str:
        return self.pool.name

    @property
    def cache_bypass(self) -> str:
        """The page cache bypass mode in use (may differ from the one asked: cache_bypass_note)."""
        return self.shards.bypass

    @property
    def cache_bypass_note(self) -> str:
        return self.shards.note

    # ---------------------------------------------------------------- public API

    def read(self, requests) -> ReadResult:
        """Read the batch; returns when every destination is filled (or raises)."""
        return self._execute(self._plan(requests))

    def submit(self, requests) -> "StartedRead":
        """Start the batch in the background and return at once a future (`result(timeout=None)`,
        `done()`). Bad requests raise here; I/O errors come out of `result()`. The destinations must
        stay alive until it completes."""
        plan = self._plan(requests)
        read = StartedRead(self, plan, self._start(plan))
        with self._state:
            self._uncollected.add(read)
        return read

    def span_count(self, requests) -> int:
        """How many reads `requests` becomes after merging (validates like read())."""
        return self._plan(requests).nspans

    def verify(self) -> None:
        """Raise ShardChangedError if any shard changed since it was indexed (see `identities`)."""
        self.shards.check(range(len(self.shards.paths)))

    def close(self) -> None:
        """Wait for submitted batches, stop the threads and close the descriptors."""
        self._close(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._close(wait=False)
        except Exception:
            pass

    def __repr__(self):
        return (f"ExpertReader({len(self.shards.paths)} files, backend={self.backend}, threads={self.threads}, "
                f"cache_bypass={self.cache_bypass})")

    # ---------------------------------------------------------------- batches

    def _plan(self, requests):
        if self._closing:
            raise ValueError("read on a closed ExpertReader")
        return self.pool.plan(requests)

    def _start(self, plan):
        """(the pool's started read, its mode); None where it cannot start here (a changed
        shard, a file that does not open): collecting it then reports why."""
        shards = self.shards
        if shards.failure is not None:
            return None
        try:
            shards.open(plan.files())
        except ReadError:
            return None
        mode = shards.bypass
        return self.pool.start(plan, shards.fds, shards.dfds, mode), mode

    def _execute(self, plan, started=None) -> ReadResult:
        """The batch's result, on this thread: collected from its started read, or read here."""
        counted = False
        result = None
        try:
            with self._state:
                if self._closed:
                    raise ValueError("read on a closed ExpertReader")
                self._inflight += 1
                counted = True
            if self.shards.failure is not None:
                raise self.shards.failure
            result = self._read(plan, started)
            self.shards.check(plan.files())  # the bytes came from the files the index described
            return result
        finally:
            if started is not None:
                started[0].wait()  # whatever happened here, the pool writes its destinations until it ends
            if counted:
                with self._state:
                    self._inflight -= 1
                    if result is not None:
                        self.total_bytes += result.bytes
                        self.total_seconds += result.seconds
                        self.total_batches += 1
                    if not self._inflight:
                        self._state.notify_all()

    def _read(self, plan, started) -> ReadResult:
        """Once, or twice where the filesystem accepted O_DIRECT at open but refuses its reads:
        then again in the mode it falls back to."""
        shards = self.shards
        for attempt in (0, 1):
            if started is not None and attempt == 0:
                ticket, mode = started
                nbytes, syscalls, err, seconds = ticket.wait()
            else:
                shards.open(plan.files())
                mode = shards.bypass
                nbytes, syscalls, err, seconds = self.pool.run(plan, shards.fds, shards.dfds, mode)
            if err is None:
                return ReadResult(nbytes, seconds, plan.nspans, syscalls, plan.nrequests)
            if mode == "direct" and err[3] == _errno.EINVAL and attempt == 0:
                shards.refuse_direct(err[0])
                continue
            raise shards.read_error(*err)
        raise AssertionError("unreachable")

    def _close(self, wait: bool) -> None:
        if self._closing:
            return
        self._closing = True  # no new batches; started and running ones finish
        if wait:  # started batches nobody collected: their results stay with their futures
            with self._state:
                uncollected = list(self._uncollected)
            for read in uncollected:
                read.outcome()
        with self._state:  # batches read() by other threads finish before their descriptors close
            while self._inflight and wait:
                self._state.wait()
            self._closed = True
        self.pool.close(wait)
        self.shards.close()


class StartedRead:
    """A batch that submit() started on the pool's threads. The first thread that asks for its
    result collects it, waiting on the pool's threads without the GIL: the engine's compute
    thread wakes when the last read lands, not through another Python thread."""

    __slots__ = ("_reader", "_plan", "_started", "_lock", "_outcome")

    def __init__(self, reader: ExpertReader, plan, started):
        self._reader, self._plan, self._started = reader, plan, started  # started: None if it could not start
        self._lock = threading.Lock()
        self._outcome = None  # (ReadResult, None) or (None, exception), once collected

    def done(self) -> bool:
        return self._outcome is not None or self._started is None or self._started[0].wait(0) is not None

    def result(self, timeout: Optional[float] = None) -> ReadResult:
        if (self._outcome is None and timeout is not None and self._started is not None
                and self._started[0].wait(timeout) is None):
            raise concurrent.futures.TimeoutError(f"the batch was not read within {timeout} s")
        result, exc = self.outcome()
        if exc is not None:
            raise exc
        return result

    def outcome(self) -> tuple:
        """(ReadResult, None) or (None, the exception): collected once, by whichever thread asks.
        An interrupt of the asking thread (KeyboardInterrupt) is not the batch's outcome: it
        propagates and the batch stays to be collected."""
        with self._lock:
            if self._outcome is None:
                try:
                    self._outcome = (self._reader._execute(self._plan, self._started), None)
                except Exception as exc:
                    self._outcome = (None, exc)
                with self._reader._state:
                    self._reader._uncollected.discard(self)
        return self._outcome
