"""How a batch of expert reads becomes spans: validated, sorted by file and offset, adjacent
ranges merged and cut at a span cap so that a batch keeps every reader thread busy, and at most
IOV_MAX destinations per span. The native reader applies the same rule (native/reader.c)."""

from __future__ import annotations

import os
from typing import List, NamedTuple, Optional

ALIGN = 4096
MIN_SPAN = 1 << 20
MAX_SPAN = 16 << 20


def system_iov_max() -> int:
    try:
        v = os.sysconf("SC_IOV_MAX")
    except (ValueError, OSError, AttributeError):
        v = -1
    if v is None or v <= 0:
        v = 1024
    return int(min(v, 1024))


class ReadRequest(NamedTuple):
    file: int  # index into ExpertReader.paths
    offset: int  # byte offset in that file
    length: int
    dest: object  # writable C-contiguous buffer of exactly `length` bytes


class ReadResult(NamedTuple):
    bytes: int  # bytes read into destinations
    seconds: float  # wall time of the batch (from its start, not counting time queued)
    spans: int  # reads after merging adjacent ranges and cutting at the span cap
    syscalls: int  # pread/preadv calls made
    requests: int


class _Span:
    __slots__ = ("file", "offset", "length", "limit", "dests")

    def __init__(self, file, offset, limit):
        self.file = file
        self.offset = offset
        self.length = 0
        self.limit = limit
        self.dests = []  # memoryviews (uint8), in file order


class SpanPlan(NamedTuple):
    """A validated batch as spans; native/reader.c's Batch has the same `files`, `nspans`, `nbytes`
    and `nrequests`, so that the reader treats both pools' plans alike."""

    spans: List[_Span]
    nbytes: int
    nrequests: int

    @property
    def nspans(self) -> int:
        return len(self.spans)

    def files(self) -> List[int]:
        """Sorted indices of the files the batch reads."""
        return sorted({s.file for s in self.spans})


def _span_cap(total: int, threads: int, max_span: int, min_span: int) -> int:
    cap = -(-total // threads) if total else 0
    cap = min(max(cap, min_span), max_span)
    return -(-cap // ALIGN) * ALIGN


def plan_spans(requests, nfiles: int, threads: int, *, max_span: int = MAX_SPAN, min_span: int = MIN_SPAN,
               iov_max: Optional[int] = None) -> SpanPlan:
    """Validate, sort and merge `requests` (the rule the native `plan` applies too)."""
    if iov_max is None:
        iov_max = system_iov_max()
    iov_max = min(iov_max, 1024)
    items = []
    total = 0
    for i, r in enumerate(requests):
        try:
            file, offset, length, dest = r
        except (TypeError, ValueError):
            raise ValueError(f"request {i}: expected (file, offset, length, dest)") from None
        file, offset, length = int(file), int(offset), int(length)
        if not 0 <= file < nfiles:
            raise ValueError(f"request {i}: file index {file} out of range (the reader has {nfiles} files)")
        if offset < 0 or length < 0:
            raise ValueError(f"request {i}: negative offset ({offset}) or length ({length})")
        try:
            mv = memoryview(dest)
        except TypeError:
            raise TypeError(f"request {i}: dest must be a writable buffer (memoryview, bytearray, numpy uint8 "
                            f"array), got {type(dest).__name__}") from None
        if mv.readonly or not mv.c_contiguous:
            raise ValueError(f"request {i}: dest must be a writable C-contiguous buffer")
        if mv.nbytes != length:
            raise ValueError(f"request {i}: dest holds {mv.nbytes} bytes but length is {length} (they must match)")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        items.append((file, offset, i, length, mv))
        total += length
    items.sort(key=lambda t: (t[0], t[1], t[2]))
    cap = _span_cap(total, threads, max_span, min_span)
    spans: List[_Span] = []
    cur: Optional[_Span] = None
    for file, offset, _, length, mv in items:
        pos, rem, at = offset, length, 0
        while rem > 0:
            if (cur is None or cur.file != file or cur.offset + cur.length != pos
                    or cur.offset + cur.length >= cur.limit or len(cur.dests) >= iov_max):
                limit = (pos + cap) // ALIGN * ALIGN
                if limit <= pos:
                    limit = pos + cap
                cur = _Span(file, pos, limit)
                spans.append(cur)
            take = min(rem, cur.limit - (cur.offset + cur.length))
            cur.dests.append(mv[at:at + take] if (at or take != length) else mv)
            cur.length += take
            pos += take
            at += take
            rem -= take
    return SpanPlan(spans, total, len(items))
