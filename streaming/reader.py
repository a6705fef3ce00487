"""The expert reader: batches of byte ranges from the checkpoint's shards into caller-owned memory.

    reader = ExpertReader(paths, threads=4)
    reader.read([ReadRequest(file, offset, length, dest), ...])      # blocking
    fut = reader.submit(requests)                                    # runs in the background
    fut.result()                                                     # -> ReadResult

- Requests come unsorted; they are sorted by (file, offset) and adjacent ranges of one file
  (offset + length == next offset) become one read with one destination per request (preadv),
  cut into spans of at most `cap` bytes, `cap = clamp(ceil(total / threads), 1 MiB, 16 MiB)`, so
  that a batch keeps `threads` reads in flight, and at most IOV_MAX destinations per span.
- Spans run in parallel: native path on the C extension's persistent pthreads (the GIL is released
  for the whole batch; submit() wakes them itself, so that a busy caller holding the GIL does
  not delay the reads, and result() waits on them directly, so that the caller wakes when the last
  read lands), Python path on a thread pool with `os.preadv` (releases the GIL per call).
  Both paths plan spans with the same rule and give the same bytes.
- Page cache bypass (`cache_bypass`): "fadvise" reads buffered, then drops the pages of the range
  (posix_fadvise DONTNEED); "direct" reads the aligned covering range with O_DIRECT into an aligned
  bounce buffer and copies out (straight into the destination when everything is aligned);
  "nocache" is macOS F_NOCACHE; "none" leaves the page cache alone. "auto" is direct on Linux
  (the fastest there: README, Measured), nocache on macOS. When the OS refuses a mode (O_DIRECT on tmpfs) the reader falls back silently
  and records what it uses in `.cache_bypass` (and why in `.cache_bypass_note`).
- Errors: a missing file, a short read (truncated shard), EIO... raise `ReadError` naming the file,
  offset and length; a bad request (size mismatch, read-only destination) raises ValueError at
  once, also from submit().
"""

from __future__ import annotations

import concurrent.futures
import errno as _errno
import os
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional, Sequence

from .errors import ReadError
from .python_spans import PythonSpans, _SpanFailure
from .read_plan import ALIGN, MAX_SPAN, MIN_SPAN, ReadRequest, ReadResult, _iov_max, plan_spans

try:
    from expert_stream.native import _reader as _native  # type: ignore
except ImportError:  # pragma: no cover - depends on the build
    _native = None

__all__ = ["ReadRequest", "ReadResult", "ExpertReader", "native_available", "ALIGN"]

BOUNCE_BYTES = 4 << 20

_MODES = ("auto", "direct", "fadvise", "nocache", "none")
_MODE_CODE = {"none": 0, "fadvise": 1, "direct": 2, "nocache": 3}
_F_NOCACHE = 48  # macOS <sys/fcntl.h>


def native_available() -> bool:
    return _native is not None


def _resolve_bypass(requested: str):
    """-> (mode used, note) for this OS."""
    linux = sys.platform.startswith("linux")
    darwin = sys.platform == "darwin"
    has_fadvise = hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")
    if requested == "auto":
        if linux and hasattr(os, "O_DIRECT"):
            return "direct", ""
        if linux and has_fadvise:
            return "fadvise", ""
        if darwin:
            return "nocache", ""
        return "none", f"no page cache bypass on {sys.platform}"
    if requested == "direct":
        if linux and hasattr(os, "O_DIRECT"):
            return "direct", ""
        if darwin:
            return "nocache", "O_DIRECT does not exist on macOS: F_NOCACHE instead"
        if has_fadvise:
            return "fadvise", "O_DIRECT not available: fadvise instead"
        return "none", "O_DIRECT not available"
    if requested == "fadvise":
        if has_fadvise:
            return "fadvise", ""
        if darwin:
            return "nocache", "posix_fadvise does not exist on macOS: F_NOCACHE instead"
        return "none", "posix_fadvise not available"
    if requested == "nocache":
        if darwin:
            return "nocache", ""
        if has_fadvise:
            return "fadvise", "F_NOCACHE is macOS only: fadvise instead"
        return "none", "F_NOCACHE is macOS only"
    return "none", ""


class ExpertReader(PythonSpans):
    """Batch reader over a fixed list of shard files. Thread-safe: several threads may read or
    submit at once. Descriptors open lazily, one buffered (and, in direct mode, one O_DIRECT) per
    file, and stay open until close()."""

    def __init__(self, paths: Sequence, *, threads: int = 4, cache_bypass: str = "auto", backend: str = "auto",
                 max_span_bytes: int = MAX_SPAN, min_span_bytes: int = MIN_SPAN, bounce_bytes: int = BOUNCE_BYTES,
                 identities: Optional[Sequence] = None):
        if cache_bypass not in _MODES:
            raise ValueError(f"cache_bypass must be one of {', '.join(_MODES)}, got {cache_bypass!r}")
        if backend not in ("auto", "native", "python"):
            raise ValueError(f"backend must be 'auto', 'native' or 'python', got {backend!r}")
        threads = int(threads)
        if threads < 1:
            raise ValueError("threads must be >= 1")
        if max_span_bytes < ALIGN:
            raise ValueError(f"max_span_bytes must be >= {ALIGN}")
        self.paths: List[Path] = [Path(p) for p in paths]
        self.threads = threads
        self.max_span_bytes = int(max_span_bytes)
        self.min_span_bytes = max(1, int(min_span_bytes))
        self.bounce_bytes = max(ALIGN, -(-int(bounce_bytes) // ALIGN) * ALIGN)
        self.iov_max = _iov_max()
        if backend == "native" and _native is None:
            from expert_stream import native as _pkg
            raise ReadError(f"the native reader is not built ({_pkg.import_error}); reinstall mlx-expert-stream "
                            f"with a C compiler available, or use backend='python'")
        self.backend = "native" if (backend != "python" and _native is not None) else "python"
        self.cache_bypass_requested = cache_bypass
        self.cache_bypass, self.cache_bypass_note = _resolve_bypass(cache_bypass)
        n = len(self.paths)
        self._fds = [-1] * n
        self._dfds = [-1] * n
        self._open_lock = threading.Lock()
        self._closed = False
        self._closing = False
        self._pool = _native.Pool(threads, self.bounce_bytes) if self.backend == "native" else None
        self._span_exec: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._dispatch: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._drop_exec: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._exec_lock = threading.Lock()
        self._uncollected: set = set()  # StartedRead whose result nobody asked for yet (close() does)
        self._local = threading.local()
        self._inflight = 0
        self._idle = threading.Condition(threading.Lock())
        # running totals (bytes, seconds, batches), for stats
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.total_batches = 0
        # checkpoint.ShardIdentity per file: every shard is opened now and checked against it,
        # and again after each batch; the first change fails this read and every later one.
        self.identities = list(identities) if identities is not None else None
        self.failure: Optional[ReadError] = None
        if self.identities is not None:
            try:
                self._ensure_open(range(n))
                for f, identity in enumerate(self.identities):
                    identity.check_open(self._fds[f])
                    if self._dfds[f] >= 0:
                        identity.check_now(self._dfds[f])
            except BaseException:
                self._close(wait=False)
                raise

    # ---------------------------------------------------------------- public API

    def read(self, requests) -> ReadResult:
        """Read the batch; returns when every destination is filled (or raises)."""
        plan = self._plan(requests)
        return self._execute(plan)

    def submit(self, requests):
        """Start the batch in the background and return at once a future (`result(timeout=None)`,
        `done()`). Bad requests raise here; I/O errors come out of `result()`. The destinations must
        stay alive until it completes."""
        plan = self._plan(requests)
        started = self._start_native(plan)
        if started is None:
            return self._dispatcher().submit(self._execute, plan)
        read = StartedRead(self, plan, started)
        with self._idle:
            self._uncollected.add(read)
        return read

    def close(self) -> None:
        """Wait for submitted batches, stop the threads and close the descriptors."""
        self._close(wait=True)

    def _close(self, wait: bool) -> None:
        if self._closing:
            return
        self._closing = True  # no new batches; queued and running ones finish
        if self._dispatch is not None:
            self._dispatch.shutdown(wait=wait)
        if wait:  # started batches nobody collected: their results stay with their futures
            with self._idle:
                uncollected = list(self._uncollected)
            for read in uncollected:
                read.outcome()
        with self._idle:  # batches read() by other threads finish before their descriptors close
            while self._inflight and wait:
                self._idle.wait()
            self._closed = True
        if self._span_exec is not None:
            self._span_exec.shutdown(wait=wait)
        if self._drop_exec is not None:  # after the spans, which queue the drops
            self._drop_exec.shutdown(wait=wait)
        if self._pool is not None:
            self._pool.close()
        with self._open_lock:
            for lst in (self._fds, self._dfds):
                for i, fd in enumerate(lst):
                    if fd >= 0:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
                        lst[i] = -1

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
        return (f"ExpertReader({len(self.paths)} files, backend={self.backend}, threads={self.threads}, "
                f"cache_bypass={self.cache_bypass})")

    # ---------------------------------------------------------------- planning

    def _plan(self, requests):
        if self._closing:
            raise ValueError("read on a closed ExpertReader")
        if self.backend == "native":
            return _native.plan(requests, len(self.paths), self.threads, self.max_span_bytes, self.min_span_bytes,
                                self.iov_max)
        return plan_spans(requests, len(self.paths), self.threads, max_span=self.max_span_bytes,
                          min_span=self.min_span_bytes, iov_max=self.iov_max)

    def span_count(self, requests) -> int:
        """How many reads `requests` becomes after merging (validates like read())."""
        plan = self._plan(requests)
        return plan.nspans if self.backend == "native" else len(plan[0])

    # ---------------------------------------------------------------- descriptors

    def _ensure_open(self, files) -> None:
        fds, dfds = self._fds, self._dfds
        if all(fds[f] >= 0 for f in files) and (self.cache_bypass != "direct" or all(dfds[f] >= 0 for f in files)):
            return
        with self._open_lock:
            if self._closed:
                raise ValueError("read on a closed ExpertReader")
            for f in files:
                if fds[f] < 0:
                    fds[f] = self._open(f, direct=False)
                if self.cache_bypass == "direct" and dfds[f] < 0:
                    try:
                        dfds[f] = self._open(f, direct=True)
                    except _DirectRefused as exc:
                        self._fall_back_from_direct(str(exc))

    def _open(self, f: int, *, direct: bool) -> int:
        path = self.paths[f]
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        if direct:
            flags |= os.O_DIRECT
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            if direct and exc.errno in (_errno.EINVAL, _errno.EOPNOTSUPP, getattr(_errno, "ENOTSUP", -1)):
                raise _DirectRefused(f"O_DIRECT refused on {path} ({exc.strerror}): fadvise instead") from None
            if exc.errno == _errno.ENOENT:
                raise ReadError(f"shard file {path} does not exist (needed for a read): the checkpoint is incomplete "
                                f"or was moved; re-download it or point model_path at the complete directory") from None
            raise ReadError(f"cannot open shard file {path}: {exc.strerror} (errno {exc.errno}); check that it is a "
                            f"readable file") from None
        if not direct:
            if sys.platform == "darwin" and self.cache_bypass == "nocache":
                try:
                    import fcntl
                    fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", _F_NOCACHE), 1)
                except OSError as exc:  # pragma: no cover - macOS only
                    self.cache_bypass, self.cache_bypass_note = "none", f"F_NOCACHE refused ({exc.strerror})"
        return fd

    def _fall_back_from_direct(self, note: str) -> None:
        if self.cache_bypass != "direct":
            return
        self.cache_bypass, self.cache_bypass_note = _resolve_bypass("fadvise")
        self.cache_bypass_note = note

    # ---------------------------------------------------------------- executing

    def _dispatcher(self):
        if self._dispatch is None:
            with self._exec_lock:
                if self._dispatch is None:
                    self._dispatch = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="expert-read")
        return self._dispatch

    def _dropper(self):
        if self._drop_exec is None:
            with self._exec_lock:
                if self._drop_exec is None:
                    self._drop_exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expert-drop")
        return self._drop_exec

    def _span_executor(self):
        if self._span_exec is None:
            with self._exec_lock:
                if self._span_exec is None:
                    self._span_exec = concurrent.futures.ThreadPoolExecutor(self.threads,
                                                                            thread_name_prefix="expert-span")
        return self._span_exec

    def _start_native(self, plan):
        """Native backend: (ticket, mode) of the batch the pool's workers start reading now, so
        that no Python thread stands between submit() and the disk; None where it cannot start
        here (python backend, a changed shard, a file that does not open: _execute reports it)."""
        if self.backend != "native" or self.failure is not None:
            return None
        try:
            self._ensure_open(plan.files())
        except ReadError:
            return None
        mode = self.cache_bypass
        return self._pool.start(plan, self._fds, self._dfds, _MODE_CODE[mode]), mode

    def _execute(self, plan, started=None) -> ReadResult:
        counted = False
        result = None
        try:
            with self._idle:
                if self._closed:
                    raise ValueError("read on a closed ExpertReader")
                self._inflight += 1
                counted = True
            if self.failure is not None:
                raise self.failure
            result = self._execute_inner(plan, started)
            self._check_unchanged(plan)
            return result
        finally:
            if started is not None:
                started[0].wait()  # whatever happened here, the workers write its destinations until it ends
            if counted:
                with self._idle:
                    self._inflight -= 1
                    if result is not None:
                        self.total_bytes += result.bytes
                        self.total_seconds += result.seconds
                        self.total_batches += 1
                    if not self._inflight:
                        self._idle.notify_all()

    def verify(self) -> None:
        """Raise ShardChangedError if any shard changed since it was indexed (see `identities`)."""
        self._check_files(range(len(self.paths)))

    def _check_unchanged(self, plan) -> None:
        """The bytes just read came from the files the index described."""
        if self.identities is not None:
            self._check_files(plan.files() if self.backend == "native" else sorted({s.file for s in plan[0]}))

    def _check_files(self, files) -> None:
        if self.identities is None:
            return
        if self.failure is not None:
            raise self.failure
        try:
            for f in files:
                self.identities[f].check_now(self._fds[f])
        except ReadError as exc:
            self.failure = exc
            raise

    def _execute_inner(self, plan, started=None) -> ReadResult:
        for attempt in (0, 1):
            mode = self.cache_bypass
            t0 = time.perf_counter()
            try:
                if started is not None and attempt == 0:
                    mode = started[1]
                    return self._collect_native(plan, started[0])
                if self.backend == "native":
                    res = self._run_native(plan, mode)
                else:
                    res = self._run_python(plan, mode)
            except _SpanFailure as fail:
                if mode == "direct" and fail.err == _errno.EINVAL and attempt == 0:
                    # the filesystem accepted O_DIRECT at open but refuses the reads
                    with self._open_lock:
                        self._fall_back_from_direct(f"O_DIRECT reads refused on {self.paths[fail.file]} (EINVAL): "
                                                    f"fadvise instead")
                    continue
                raise self._read_error(fail) from None
            return ReadResult(res[0], time.perf_counter() - t0, res[1], res[2], res[3])
        raise AssertionError("unreachable")

    def _run_native(self, batch, mode):
        self._ensure_open(batch.files())
        mode = self.cache_bypass if mode == "direct" else mode  # may have fallen back while opening
        nbytes, syscalls, err = self._pool.run(batch, self._fds, self._dfds, _MODE_CODE[mode])
        if err is not None:
            raise _SpanFailure(*err)
        return nbytes, batch.nspans, syscalls, batch.nrequests

    def _collect_native(self, batch, ticket) -> ReadResult:
        """A started batch's result; its seconds are timed by the pool, first read to last."""
        nbytes, syscalls, err, seconds = ticket.wait()
        if err is not None:
            raise _SpanFailure(*err)
        return ReadResult(nbytes, seconds, batch.nspans, syscalls, batch.nrequests)

    # ---------------------------------------------------------------- errors

    def _read_error(self, fail: _SpanFailure) -> ReadError:
        path = self.paths[fail.file] if 0 <= fail.file < len(self.paths) else f"<file {fail.file}>"
        where = f"{fail.length} bytes at offset {fail.offset} of {path}"
        if fail.err == 0:
            try:
                size = os.stat(path).st_size
                size_s = f"the file has {size} bytes"
            except OSError:
                size_s = "the file is gone"
            return ReadError(f"short read: {where} were requested but the read stopped at byte {fail.pos} "
                             f"({size_s}). The shard is truncated or changed since the checkpoint was indexed: "
                             f"re-download or re-convert the checkpoint.")
        name = _errno.errorcode.get(fail.err, str(fail.err))
        msg = os.strerror(fail.err)
        if fail.err == _errno.EIO:
            hint = ("the disk or filesystem reported a failure: check the drive (dmesg / Disk Utility) or copy the "
                    "checkpoint to a healthy disk")
        elif fail.err == _errno.EBADF:
            hint = "the file descriptor was closed: was the reader closed while a read was in flight?"
        elif fail.err == _errno.EINVAL and self.cache_bypass == "direct":
            hint = "O_DIRECT alignment was refused: use cache_bypass='fadvise'"
        else:
            hint = "check that the file is readable and the disk healthy"
        return ReadError(f"{name} ({msg}) reading {where} (failed at byte {fail.pos}): {hint}.")


class StartedRead:
    """A batch that submit() started on the native pool's workers. The first thread that asks
    for its result collects it, waiting on the workers without the GIL: the engine's compute
    thread wakes when the last read lands, not through another Python thread."""

    __slots__ = ("_reader", "_plan", "_started", "_lock", "_outcome")

    def __init__(self, reader: ExpertReader, plan, started):
        self._reader, self._plan, self._started = reader, plan, started
        self._lock = threading.Lock()
        self._outcome = None  # (ReadResult, None) or (None, exception), once collected

    def done(self) -> bool:
        return self._outcome is not None or self._started[0].wait(0) is not None

    def result(self, timeout: Optional[float] = None) -> ReadResult:
        if self._outcome is None and timeout is not None and self._started[0].wait(timeout) is None:
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
                with self._reader._idle:
                    self._reader._uncollected.discard(self)
        return self._outcome


class _DirectRefused(Exception):
    pass
