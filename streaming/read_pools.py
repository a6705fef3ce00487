"""The two pools that read a planned batch's spans: NativePool on native/reader.c's persistent
pthreads, PythonPool on a thread pool with os.preadv (where the extension is not built). The
reader picks one at construction and treats both alike:

    plan = pool.plan(requests)                       # validate, sort, merge (read_plan.py's rule)
    started = pool.start(plan, fds, dfds, mode)      # the pool's threads read it; returns at once
    started.wait(timeout=None) -> None | (bytes, syscalls, err, seconds)
    pool.run(plan, fds, dfds, mode) -> (bytes, syscalls, err, seconds)   # the caller reads too
    pool.close(wait)

`err` is None or (file, span_offset, span_length, errno, pos), errno 0 for a file that ended
before the span did; a batch stops taking new spans once one failed. `seconds` runs from the
batch's first span taken to its last done. Both pools give the same bytes for the same plan."""

from __future__ import annotations

import concurrent.futures
import errno as _errno
import mmap
import os
import threading
import time

from .errors import ReadError
from .read_plan import ALIGN, SpanPlan, _Span, plan_spans
from .shard_files import MODE_CODE

try:
    from expert_stream.native import _reader as _native  # type: ignore
except ImportError:  # pragma: no cover - depends on the build
    _native = None


def pool_type(backend: str):
    """The pool class for the `reader` setting: native where built ("auto"), or as asked."""
    if backend not in ("auto", "native", "python"):
        raise ValueError(f"backend must be 'auto', 'native' or 'python', got {backend!r}")
    if backend == "native" and _native is None:
        from expert_stream import native as _pkg
        raise ReadError(f"the native reader is not built ({_pkg.import_error}); reinstall mlx-expert-stream "
                        f"with a C compiler available, or use backend='python'")
    return NativePool if (backend != "python" and _native is not None) else PythonPool


class NativePool:
    """Spans read by the C extension's pthreads with the GIL released for the whole batch.
    start() wakes them itself, so a busy caller holding the GIL does not delay the reads, and a
    started batch is waited for on them directly, so the waiter wakes when the last read lands."""

    name = "native"

    def __init__(self, nfiles: int, threads: int, bounce_bytes: int, max_span: int, min_span: int, iov_max: int):
        self._limits = (nfiles, threads, max_span, min_span, iov_max)
        self._pool = _native.Pool(threads, bounce_bytes)

    def plan(self, requests):
        return _native.plan(requests, *self._limits)

    def start(self, plan, fds, dfds, mode: str):
        return self._pool.start(plan, fds, dfds, MODE_CODE[mode])

    def run(self, plan, fds, dfds, mode: str) -> tuple:
        t0 = time.perf_counter()
        nbytes, syscalls, err = self._pool.run(plan, fds, dfds, MODE_CODE[mode])
        return nbytes, syscalls, err, time.perf_counter() - t0

    def close(self, wait: bool = True) -> None:
        self._pool.close()  # joins the workers; a batch they still read finishes first


class PythonPool:
    """Spans read with os.preadv (which releases the GIL per call) on a thread pool: buffered
    (their pages dropped after, off the critical path, for "fadvise"), or for "direct" through
    an aligned per-thread bounce buffer on the O_DIRECT descriptor."""

    name = "python"

    def __init__(self, nfiles: int, threads: int, bounce_bytes: int, max_span: int, min_span: int, iov_max: int):
        self._limits = (nfiles, threads, max_span, min_span, iov_max)
        self.threads = threads
        self.bounce_bytes = bounce_bytes
        # (Executors start their threads on first use.)
        self._spans = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="expert-span")
        self._drops = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="expert-drop")  # fadvise's
        self._local = threading.local()  # each thread's bounce buffer

    def plan(self, requests) -> SpanPlan:
        nfiles, threads, max_span, min_span, iov_max = self._limits
        return plan_spans(requests, nfiles, threads, max_span=max_span, min_span=min_span, iov_max=iov_max)

    def start(self, plan: SpanPlan, fds, dfds, mode: str) -> "_StartedSpans":
        failed = threading.Event()
        return _StartedSpans(plan, [self._spans.submit(self._span, s, fds, dfds, mode, failed) for s in plan.spans])

    def run(self, plan: SpanPlan, fds, dfds, mode: str) -> tuple:
        if len(plan.spans) <= 1 or self.threads == 1:
            failed = threading.Event()
            return _outcome(plan, [self._span(s, fds, dfds, mode, failed) for s in plan.spans])
        return self.start(plan, fds, dfds, mode).wait()

    def close(self, wait: bool = True) -> None:
        self._spans.shutdown(wait=wait)
        self._drops.shutdown(wait=wait)  # after the spans, which queue the drops

    def _span(self, s: _Span, fds, dfds, mode: str, failed: threading.Event) -> tuple:
        """Read one span, never raising: (syscalls, start, end, err), err None or the failure's
        (file, offset, length, errno, pos); (0, None, None, None) once another span failed."""
        if failed.is_set():
            return 0, None, None, None
        t0 = time.perf_counter()
        try:
            calls = self._direct(s, dfds[s.file]) if mode == "direct" else self._buffered(s, fds[s.file], mode)
        except _SpanFailure as fail:
            failed.set()
            return 0, t0, time.perf_counter(), fail.args
        except OSError as exc:
            failed.set()
            return 0, t0, time.perf_counter(), (s.file, s.offset, s.length, exc.errno or _errno.EIO, s.offset)
        return calls, t0, time.perf_counter(), None

    def _buffered(self, s: _Span, fd: int, mode: str) -> int:
        bufs = list(s.dests)
        pos, end, calls = s.offset, s.offset + s.length, 0
        while pos < end:
            try:
                r = _preadv(fd, bufs, pos)
            except InterruptedError:
                continue
            except OSError as exc:
                raise _SpanFailure(s, exc.errno, pos) from None
            calls += 1
            if r == 0:
                raise _SpanFailure(s, 0, pos)
            pos += r
            while r > 0 and bufs:
                n = bufs[0].nbytes
                if r >= n:
                    r -= n
                    bufs.pop(0)
                else:
                    bufs[0] = bufs[0][r:]
                    r = 0
        if mode == "fadvise":  # off the critical path (~0.5 ms per 4 MiB), like the native reader
            a = s.offset // ALIGN * ALIGN
            b = -(-end // ALIGN) * ALIGN
            try:
                self._drops.submit(_drop_pages, fd, a, b - a)
            except RuntimeError:  # closing
                _drop_pages(fd, a, b - a)
        return calls

    def _direct(self, s: _Span, fd: int) -> int:
        bounce = memoryview(self._bounce())
        off, end = s.offset, s.offset + s.length
        a1 = -(-end // ALIGN) * ALIGN
        pos = off // ALIGN * ALIGN
        k, kpos, calls = 0, off, 0
        dests = s.dests
        while pos < end:
            want = min(self.bounce_bytes, a1 - pos)
            try:
                r = _preadv(fd, [bounce[:want]], pos)
            except InterruptedError:
                continue
            except OSError as exc:
                raise _SpanFailure(s, exc.errno, max(pos, off)) from None
            calls += 1
            if r == 0:
                raise _SpanFailure(s, 0, max(pos, off))
            c0, c1 = max(pos, off), min(pos + r, end)
            src = c0 - pos
            while c0 < c1:
                d = dests[k]
                inn = c0 - kpos
                m = min(d.nbytes - inn, c1 - c0)
                d[inn:inn + m] = bounce[src:src + m]
                src += m
                c0 += m
                if inn + m == d.nbytes:
                    kpos += d.nbytes
                    k += 1
            pos += r
            if pos < end and pos % ALIGN:
                raise _SpanFailure(s, 0, max(pos, off))
        return calls

    def _bounce(self):
        buf = getattr(self._local, "bounce", None)
        if buf is None or len(buf) != self.bounce_bytes:
            buf = mmap.mmap(-1, self.bounce_bytes)  # page aligned
            self._local.bounce = buf
        return buf


class _StartedSpans:
    """A batch whose spans PythonPool.start handed to its threads."""

    __slots__ = ("_plan", "_futures")

    def __init__(self, plan: SpanPlan, futures):
        self._plan, self._futures = plan, futures

    def wait(self, timeout=None):
        _, pending = concurrent.futures.wait(self._futures, timeout)
        if pending:
            return None
        return _outcome(self._plan, [f.result() for f in self._futures])


def _outcome(plan: SpanPlan, results) -> tuple:
    """(bytes, syscalls, err, seconds) of a batch from its spans' results, the first failure in
    span order."""
    err = next((r[3] for r in results if r[3] is not None), None)
    ran = [r for r in results if r[1] is not None]
    seconds = max(r[2] for r in ran) - min(r[1] for r in ran) if ran else 0.0
    return (0 if err else plan.nbytes), sum(r[0] for r in results), err, seconds


class _SpanFailure(Exception):
    """Raised inside a span's read; args are its err tuple."""

    def __init__(self, s: _Span, err: int, pos: int):
        super().__init__(s.file, s.offset, s.length, err, pos)


def _preadv(fd: int, bufs, pos: int) -> int:
    """os.preadv, or one pread into the first buffer where the OS has no preadv (callers loop)."""
    if _HAVE_PREADV:
        return os.preadv(fd, bufs, pos)
    data = os.pread(fd, bufs[0].nbytes, pos)
    bufs[0][:len(data)] = data
    return len(data)


_HAVE_PREADV = hasattr(os, "preadv")


def _drop_pages(fd: int, off: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
