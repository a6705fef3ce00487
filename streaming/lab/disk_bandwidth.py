"""Measured SSD read bandwidth, for `plan` (predicted tok/s) and `bench` (reader vs raw).

    measure_read_bandwidth(paths)  -> {"gbps": ..., "seconds": ..., "bytes": ...}   through ExpertReader
    measure_raw_bandwidth(paths)   -> the same keys: plain O_DIRECT preads, a fio-like reference
    measure_expert_batches(model_dir, experts=1) -> the same keys: one layer's misses at a time,
                                      as decode reads them (random layer and experts, one batch in flight)

Both read random block-aligned blocks of the given files (weighted by file size) after dropping
the files' pages from the page cache (posix_fadvise DONTNEED, where the OS has it), so they
measure the disk, not RAM. gbps is 1e9 bytes per second; gibps is 2**30 bytes per second.
"""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import sys
import time
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from ..read_pools import _preadv
from ..reader import ALIGN, ExpertReader, ReadRequest

try:
    from expert_stream.native import _reader as _native  # type: ignore
except ImportError:  # pragma: no cover
    _native = None

__all__ = ["measure_read_bandwidth", "measure_raw_bandwidth", "measure_expert_batches", "drop_page_cache"]

_DEST_CAP = 256 << 20  # destination memory for measure_read_bandwidth (two batches in flight)


def drop_page_cache(paths: Sequence) -> bool:
    """Ask the OS to drop the files' cached pages; False where it cannot (macOS: the reader's
    F_NOCACHE reads bypass the cache instead)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    ok = True
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            ok = False
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def _blocks(paths: Sequence[Path], block: int, total: int, seed: int) -> List[Tuple[int, int]]:
    sizes = [os.stat(p).st_size for p in paths]
    usable = [max(0, (s - block) // ALIGN + 1) for s in sizes]  # aligned start positions per file
    if not any(usable):
        raise ValueError(f"no file is at least {block} bytes long: nothing to measure")
    weights = np.array(usable, dtype=np.float64)
    weights /= weights.sum()
    n = max(1, total // block)
    rng = np.random.default_rng(seed)
    files = rng.choice(len(paths), size=n, p=weights)
    return [(int(f), int(rng.integers(0, usable[f])) * ALIGN) for f in files]


def _result(nbytes: int, seconds: float, **extra) -> dict:
    seconds = max(seconds, 1e-9)
    return dict(gbps=nbytes / seconds / 1e9, gibps=nbytes / seconds / 2**30, seconds=seconds, bytes=nbytes, **extra)


def measure_read_bandwidth(paths: Sequence, *, block_bytes: int = 4 << 20, total_bytes: int = 1 << 30,
                           threads: int = 4, cache_bypass: str = "auto", backend: str = "auto",
                           seed: int = 0) -> dict:
    """Random `block_bytes` reads through ExpertReader, batches of 2*threads blocks with two batches
    in flight (as the cache keeps lookahead reads in flight)."""
    paths = [Path(p) for p in paths]
    block = -(-int(block_bytes) // ALIGN) * ALIGN
    blocks = _blocks(paths, block, int(total_bytes), seed)
    per_batch = max(1, min(2 * threads, _DEST_CAP // (2 * block)))
    dests = [[np.empty(block, np.uint8) for _ in range(per_batch)] for _ in range(2)]
    batches = [blocks[i:i + per_batch] for i in range(0, len(blocks), per_batch)]
    dropped = drop_page_cache(paths)
    with ExpertReader(paths, threads=threads, cache_bypass=cache_bypass, backend=backend) as reader:
        t0 = time.perf_counter()
        pending: List[concurrent.futures.Future] = []
        nbytes = 0
        for k, batch in enumerate(batches):
            reqs = [ReadRequest(f, off, block, dests[k % 2][i]) for i, (f, off) in enumerate(batch)]
            if len(pending) == 2:
                nbytes += pending.pop(0).result().bytes
            pending.append(reader.submit(reqs))
        for fut in pending:
            nbytes += fut.result().bytes
        seconds = time.perf_counter() - t0
        return _result(nbytes, seconds, block_bytes=block, threads=threads, backend=reader.backend,
                       cache_bypass=reader.cache_bypass, page_cache_dropped=dropped)


def measure_expert_batches(model_dir, *, experts: int = 1, batches: int = 200, threads: int = 4,
                           min_span_bytes: int | None = None, gap_ms: float = 0.0, cache_bypass: str = "auto",
                           backend: str = "auto", seed: int = 0) -> dict:
    """Decode's read pattern: `batches` batches of `experts` distinct experts of one random MoE
    layer (every tensor of each), submitted one after another with nothing else in flight and
    `gap_ms` idle between two (a layer's compute). gbps is their bytes over the batches' summed
    wall time; ms_median one batch's wall."""
    from ..footprint import expert_layers
    from ..read_plan import MIN_SPAN

    index, _, _, layers = expert_layers(model_dir)
    min_span = MIN_SPAN if min_span_bytes is None else min_span_bytes
    rng = np.random.default_rng(seed)
    # One destination per (expert of the batch, tensor), wide enough for any layer's row.
    scratch = np.empty((experts, max(len(ts) for ts in layers), max(t.row_bytes for ts in layers for t in ts)),
                       np.uint8)
    plans = []
    for _ in range(batches):
        tensors = layers[int(rng.integers(len(layers)))]
        chosen = rng.choice(tensors[0].num_experts, size=min(experts, tensors[0].num_experts), replace=False)
        plans.append([ReadRequest(t.info.file, t.offset_of(e), t.row_bytes, scratch[i, j, :t.row_bytes])
                      for i, e in enumerate(chosen) for j, t in enumerate(tensors)])
    dropped = drop_page_cache(index.files)
    walls = []
    nbytes = 0
    with ExpertReader(index.files, threads=threads, cache_bypass=cache_bypass, backend=backend,
                      min_span_bytes=min_span) as reader:
        for reqs in plans:
            if gap_ms:
                time.sleep(gap_ms / 1e3)
            t0 = time.perf_counter()
            nbytes += reader.read(reqs).bytes
            walls.append(time.perf_counter() - t0)
        used = (reader.backend, reader.cache_bypass)
    return _result(nbytes, sum(walls), ms_median=1e3 * float(np.median(walls)), experts=experts, threads=threads,
                   min_span_bytes=min_span, gap_ms=gap_ms, backend=used[0], cache_bypass=used[1],
                   page_cache_dropped=dropped)


def _open_raw(path) -> Tuple[int, str]:
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT), "direct"
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    if sys.platform == "darwin":
        try:
            import fcntl
            fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
            return fd, "nocache"
        except OSError:  # pragma: no cover
            pass
    return fd, "buffered"


def measure_raw_bandwidth(paths: Sequence, *, block_bytes: int = 4 << 20, total_bytes: int = 1 << 30,
                          threads: int = 4, seed: int = 0, backend: str = "auto") -> dict:
    """Plain preads of random aligned blocks, O_DIRECT where the filesystem allows (F_NOCACHE on
    macOS), `threads` reads in flight, each into its own aligned buffer: the disk's own figure."""
    paths = [Path(p) for p in paths]
    block = -(-int(block_bytes) // ALIGN) * ALIGN
    blocks = _blocks(paths, block, int(total_bytes), seed)
    dropped = drop_page_cache(paths)
    opened = [_open_raw(p) for p in paths]
    fds = [fd for fd, _ in opened]
    how = sorted({h for _, h in opened})
    use_native = _native is not None and backend != "python"
    try:
        bfds = [fds[f] for f, _ in blocks]
        offs = [off for _, off in blocks]
        if use_native:
            nbytes, seconds, err, where = _native.raw_read(bfds, offs, block, threads)
            if err:
                what = "end of file" if err < 0 else os.strerror(err)
                f, off = blocks[where] if where >= 0 else (0, 0)
                raise OSError(err if err > 0 else 0, f"raw read of {block} bytes at offset {off} of {paths[f]}: {what}")
        else:
            nbytes, seconds = _raw_python(bfds, offs, block, threads)
    finally:
        for fd in fds:
            os.close(fd)
    return _result(nbytes, seconds, block_bytes=block, threads=threads, mode="+".join(how),
                   backend="native" if use_native else "python", page_cache_dropped=dropped)


def _raw_python(fds, offs, block, threads):
    import threading

    lock = threading.Lock()
    state = {"next": 0, "bytes": 0}

    def worker():
        buf = mmap.mmap(-1, block)
        mv = memoryview(buf)
        got = 0
        try:
            while True:
                with lock:
                    i = state["next"]
                    state["next"] += 1
                if i >= len(offs):
                    break
                done = 0
                while done < block:
                    r = _preadv(fds[i], [mv[done:]], offs[i] + done)
                    if r <= 0:
                        raise OSError(0, f"raw read hit end of file at {offs[i] + done}")
                    done += r
                got += done
        finally:
            mv.release()
            buf.close()
        with lock:
            state["bytes"] += got

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
        for f in [ex.submit(worker) for _ in range(threads)]:
            f.result()
    return state["bytes"], time.perf_counter() - t0


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def main(argv=None) -> int:
    """python -m expert_stream.streaming.lab.disk_bandwidth FILE... : reader vs raw, GB/s (1e9 B/s)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m expert_stream.streaming.lab.disk_bandwidth", description=main.__doc__)
    ap.add_argument("paths", nargs="*", help="files to read (or --model)")
    ap.add_argument("--blocks", default="768K,4M")
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--total", default="1G", help="bytes read per measurement")
    ap.add_argument("--modes", default="fadvise,direct", help="cache_bypass modes for the reader")
    ap.add_argument("--backends", default="python,native")
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="instead: decode's batches of this checkpoint's experts (--experts, --min-spans, --threads)")
    ap.add_argument("--experts", default="1,2,4", help="with --model: experts per batch")
    ap.add_argument("--min-spans", default="1M,256K", help="with --model: the reader's smallest span")
    ap.add_argument("--gaps", default="0", help="with --model: ms idle between two batches")
    a = ap.parse_args(argv)
    if a.model is not None:
        return _batches_main(a)
    if not a.paths:
        ap.error("give the files to read, or --model DIR")
    total = _size(a.total)
    cols = [(b, m) for b in a.backends.split(",") for m in a.modes.split(",")]
    if not a.json:
        print(f"{'block':>7} {'thr':>3} {'raw':>6} " + " ".join(f"{b + '/' + m:>15}" for b, m in cols))
    for blk in a.blocks.split(","):
        block = _size(blk)
        for threads in (int(t) for t in a.threads.split(",")):
            raw = measure_raw_bandwidth(a.paths, block_bytes=block, total_bytes=total, threads=threads, seed=threads)
            row = {"block_bytes": block, "threads": threads, "raw": raw["gbps"], "raw_mode": raw["mode"]}
            for b, m in cols:
                r = measure_read_bandwidth(a.paths, block_bytes=block, total_bytes=total, threads=threads,
                                           cache_bypass=m, backend=b, seed=100 + threads)
                key = f"{b}/{m}" + ("" if r["cache_bypass"] == m and r["backend"] == b
                                    else f"(={r['backend']}/{r['cache_bypass']})")
                row[key] = r["gbps"]
            if a.json:
                print(json.dumps(row), flush=True)
            else:
                vals = [v for k, v in row.items() if "/" in k]
                print(f"{blk:>7} {threads:>3} {raw['gbps']:6.2f} " + " ".join(f"{v:15.2f}" for v in vals), flush=True)
    return 0


def _batches_main(a) -> int:
    import itertools
    import json

    if not a.json:
        print(f"{'experts':>7} {'thr':>3} {'min_span':>8} {'gap ms':>6} {'GB/s':>6} {'ms/batch':>8}")
    for experts, threads, span, gap in itertools.product(
            [int(k) for k in a.experts.split(",")], [int(t) for t in a.threads.split(",")],
            a.min_spans.split(","), [float(g) for g in a.gaps.split(",")]):
        r = measure_expert_batches(a.model, experts=experts, threads=threads, min_span_bytes=_size(span),
                                   gap_ms=gap, seed=experts * 1000 + threads)
        if a.json:
            print(json.dumps(r), flush=True)
        else:
            print(f"{experts:>7} {threads:>3} {span:>8} {gap:6g} {r['gbps']:6.2f} {r['ms_median']:8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
