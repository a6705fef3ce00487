"""The Python reader's span reads (the path where the native extension is not built): each span
with os.preadv on a thread pool, buffered (dropping its pages after, for "fadvise") or through
an aligned bounce buffer with O_DIRECT."""

from __future__ import annotations

import concurrent.futures
import errno as _errno
import mmap
import os
import threading

from .read_plan import ALIGN, _Span


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


class _SpanFailure(Exception):
    def __init__(self, file, offset, length, err, pos):
        super().__init__(file, offset, length, err, pos)
        self.file, self.offset, self.length, self.err, self.pos = file, offset, length, err, pos


class PythonSpans:
    """ExpertReader's Python path (a mixin: it uses the reader's descriptors, pools and modes)."""

    def _run_python(self, plan, mode):
        spans, total, nreq = plan
        self._ensure_open(sorted({s.file for s in spans}))
        mode = self.cache_bypass if mode == "direct" else mode
        failed = threading.Event()
        if len(spans) <= 1 or self.threads == 1:
            results = [self._py_span(s, mode, failed) for s in spans]
        else:
            ex = self._span_executor()
            futs = [ex.submit(self._py_span, s, mode, failed) for s in spans]
            concurrent.futures.wait(futs)
            results = [f.result() for f in futs]
        first = None
        for r in results:
            if isinstance(r, _SpanFailure) and first is None:
                first = r
        if first is not None:
            raise first
        return total, len(spans), sum(results), nreq

    def _py_span(self, s: _Span, mode: str, failed: threading.Event):
        """Read one span; returns the syscall count or a _SpanFailure (never raises)."""
        if failed.is_set():
            return 0
        try:
            if mode == "direct":
                return self._py_span_direct(s)
            return self._py_span_buffered(s, mode)
        except _SpanFailure as fail:
            failed.set()
            return fail
        except OSError as exc:
            failed.set()
            return _SpanFailure(s.file, s.offset, s.length, exc.errno or _errno.EIO, s.offset)

    def _py_span_buffered(self, s: _Span, mode: str) -> int:
        fd = self._fds[s.file]
        bufs = list(s.dests)
        pos, end, calls = s.offset, s.offset + s.length, 0
        while pos < end:
            try:
                r = _preadv(fd, bufs, pos)
            except InterruptedError:
                continue
            except OSError as exc:
                raise _SpanFailure(s.file, s.offset, s.length, exc.errno, pos) from None
            calls += 1
            if r == 0:
                raise _SpanFailure(s.file, s.offset, s.length, 0, pos)
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
                self._dropper().submit(_drop_pages, fd, a, b - a)
            except RuntimeError:  # closing
                _drop_pages(fd, a, b - a)
        return calls

    def _bounce(self):
        buf = getattr(self._local, "bounce", None)
        if buf is None or len(buf) != self.bounce_bytes:
            buf = mmap.mmap(-1, self.bounce_bytes)  # page aligned
            self._local.bounce = buf
        return buf

    def _py_span_direct(self, s: _Span) -> int:
        fd = self._dfds[s.file]
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
                raise _SpanFailure(s.file, s.offset, s.length, exc.errno, max(pos, off)) from None
            calls += 1
            if r == 0:
                raise _SpanFailure(s.file, s.offset, s.length, 0, max(pos, off))
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
                raise _SpanFailure(s.file, s.offset, s.length, 0, max(pos, off))
        return calls
