"""The expert reader: same bytes as open().read() slices on both backends and every cache bypass
mode the filesystem allows; merging; background submit; errors that name the file."""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import sys
import threading
import time
import zlib

import numpy as np
import pytest

from expert_stream import native
from expert_stream.streaming.errors import ReadError
from expert_stream.streaming.read_plan import system_iov_max
from expert_stream.streaming.reader import ExpertReader, ReadRequest, plan_spans

MiB = 1 << 20
BACKENDS = ["python", pytest.param("native", marks=pytest.mark.skipif(
    not native.available, reason=f"native reader not built: {native.import_error}"))]
MODES = ["none", "fadvise", "direct", "nocache", "auto"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Six files of awkward sizes (not multiples of 4096), random bytes; returns (paths, contents)."""
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(1234)
    sizes = [7 * MiB + 123, 3 * MiB + 4095, 1, 4097, 12 * MiB + 11, 2 * MiB]
    paths, data = [], []
    for i, n in enumerate(sizes):
        b = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        p = d / f"model-{i:05d}-of-00006.safetensors"
        p.write_bytes(b)
        paths.append(p)
        data.append(b)
    return paths, data


def random_requests(data, rng, n=120):
    """Unsorted requests: random ranges (1 byte to several MiB, unaligned), runs of adjacent
    ranges, ranges ending at end of file, zero-length ones; a few overlap each other."""
    reqs = []
    nf = len(data)
    for _ in range(n):
        f = int(rng.integers(nf))
        size = len(data[f])
        kind = rng.integers(4)
        if kind == 0:
            ln = int(rng.integers(1, 64))
        elif kind == 1:
            ln = int(rng.integers(1, 1 << 16))
        else:
            ln = int(rng.integers(1, 5 * MiB))
        ln = min(ln, size)
        off = int(rng.integers(0, size - ln + 1))
        reqs.append((f, off, ln))
    for _ in range(6):  # adjacent runs (a layer's experts in one shard)
        f = int(rng.choice([0, 1, 4]))
        off = int(rng.integers(0, 4096 * 3)) + 17
        for _ in range(int(rng.integers(2, 12))):
            ln = int(rng.integers(1, 900_000))
            if off + ln > len(data[f]):
                break
            reqs.append((f, off, ln))
            off += ln
    reqs.append((4, len(data[4]) - 5, 5))  # the last bytes
    reqs.append((2, 0, 1))  # the only byte of a 1-byte file
    reqs.append((3, 4096, 1))  # the byte after the only full block
    reqs.append((0, 100, 0))  # zero length
    order = rng.permutation(len(reqs))
    return [reqs[i] for i in order]


def make_dests(reqs, rng):
    out = []
    for f, off, ln in reqs:
        kind = rng.integers(3)
        if kind == 0:
            dest = np.full(ln, 0xAB, dtype=np.uint8)
        elif kind == 1:
            dest = memoryview(bytearray(b"\xcd" * ln))
        else:
            dest = np.full(ln, 0xEF, dtype=np.uint8)
            if ln % 2 == 0 and ln:
                dest = dest.reshape(2, ln // 2)  # any C-contiguous shape
        out.append(ReadRequest(f, off, ln, dest))
    return out


def check(requests, data):
    for i, r in enumerate(requests):
        got = bytes(memoryview(r.dest).cast("B")) if r.length else b""
        assert got == data[r.file][r.offset:r.offset + r.length], f"request {i} {r[:3]} differs"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threads", [1, 4])
def test_same_bytes_as_plain_read(shards, backend, mode, threads):
    paths, data = shards
    rng = np.random.default_rng(zlib.crc32(f"{backend}{mode}{threads}".encode()))
    with ExpertReader(paths, threads=threads, cache_bypass=mode, backend=backend) as reader:
        assert reader.backend == backend
        for _ in range(2):
            reqs = make_dests(random_requests(data, rng), rng)
            res = reader.read(reqs)
            check(reqs, data)
            assert res.bytes == sum(r.length for r in reqs)
            assert res.requests == len(reqs)
            assert 1 <= res.spans <= res.syscalls
        used = reader.cache_bypass
    if mode not in ("auto", used):
        pytest.skip(f"cache_bypass={mode!r} refused here, fell back to {used!r} (bytes checked): "
                    f"{reader.cache_bypass_note}")


@pytest.mark.skipif(not native.available, reason="native reader not built")
def test_native_and_python_plan_the_same_spans(shards):
    paths, data = shards
    rng = np.random.default_rng(7)
    for threads in (1, 3, 8):
        reqs = make_dests(random_requests(data, rng, n=200), rng)
        py, total, nreq = plan_spans(reqs, len(paths), threads, min_span=MiB, iov_max=1024)
        batch = native._reader.plan(reqs, len(paths), threads, 16 * MiB, MiB, 1024)
        assert batch.nbytes == total and batch.nrequests == nreq == len(reqs)
        assert batch.span_list() == [(s.file, s.offset, s.length, len(s.dests)) for s in py]


@pytest.mark.skipif(not native.available, reason="native reader not built")
def test_native_submit_reads_while_the_caller_holds_the_gil(shards):
    """The engine builds the layer's graph in Python right after submitting its misses: the
    reads must not wait for the GIL. A switch interval of a minute keeps every other Python
    thread off it while this one spins; only bytes written without the GIL can arrive."""
    paths, data = shards
    reqs = [ReadRequest(4, 5 + i * MiB, MiB, np.zeros(MiB, np.uint8)) for i in range(8)]
    want = [data[4][r.offset + r.length - 1] for r in reqs]
    assert all(want), "pick ranges whose last byte is not zero"
    with ExpertReader(paths, threads=4, cache_bypass="none", backend="native") as reader:
        reader.submit(reqs[:1]).result(timeout=60)  # every thread started, files open
        old = sys.getswitchinterval()
        sys.setswitchinterval(60.0)
        try:
            fut = reader.submit(reqs)
            deadline = time.perf_counter() + 5.0
            landed = False
            while not landed and time.perf_counter() < deadline:  # element reads keep the GIL
                landed = all(r.dest[-1] == w for r, w in zip(reqs, want))
            fut.result(timeout=60)
        finally:
            sys.setswitchinterval(old)
    assert landed, "the batch was read only once the caller let go of the GIL"
    check(reqs, data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_submitted_batch_is_collected_by_whoever_asks(tmp_path, backend):
    """A started batch's future, on either pool: result(timeout) that runs out raises and leaves
    the batch collectable; two threads asking at once get the same result; close() collects the
    batches nobody asked for, so their futures still hold their results afterwards."""
    p = tmp_path / "big.bin"
    blob = np.random.default_rng(6).integers(0, 256, 96 * MiB, dtype=np.uint8)
    blob.tofile(p)
    data = [blob.tobytes()]
    with ExpertReader([p], threads=1, cache_bypass="none", backend=backend) as reader:
        reqs = [ReadRequest(0, 1 + i * MiB, MiB - 3, np.empty(MiB - 3, np.uint8)) for i in range(96)]
        fut = reader.submit(reqs)
        with pytest.raises(concurrent.futures.TimeoutError):
            fut.result(timeout=0)  # 96 MiB on one thread cannot have landed yet
        got = []
        askers = [threading.Thread(target=lambda: got.append(fut.result(timeout=60))) for _ in range(2)]
        for t in askers:
            t.start()
        for t in askers:
            t.join(60)
        assert len(got) == 2 and got[0] is got[1] and got[0].bytes == sum(r.length for r in reqs)
        assert fut.done()
        check(reqs, data)
        late = [ReadRequest(0, 7 + i * MiB, MiB, np.empty(MiB, np.uint8)) for i in range(40)]
        unasked = reader.submit(late)
    assert unasked.done() and unasked.result().bytes == 40 * MiB
    check(late, data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adjacent_requests_merge(shards, backend):
    paths, data = shards
    with ExpertReader(paths, threads=4, cache_bypass="fadvise", backend=backend) as reader:
        # 10 adjacent ranges in file 0, 5 in file 4, given shuffled: two reads
        reqs = [ReadRequest(0, 1000 + 3000 * i, 3000, np.empty(3000, np.uint8)) for i in range(10)]
        reqs += [ReadRequest(4, 77 + 50_001 * i, 50_001, np.empty(50_001, np.uint8)) for i in range(5)]
        reqs = [reqs[i] for i in np.random.default_rng(0).permutation(len(reqs))]
        assert reader.span_count(reqs) == 2
        res = reader.read(reqs)
        assert (res.spans, res.requests) == (2, 15)
        if reader.cache_bypass != "direct":
            assert res.syscalls == 2  # one preadv per span
        check(reqs, data)
        # a gap of one byte, or another file, is not merged
        gap = [ReadRequest(0, 0, 10, np.empty(10, np.uint8)), ReadRequest(0, 11, 10, np.empty(10, np.uint8)),
               ReadRequest(1, 21, 10, np.empty(10, np.uint8))]
        assert reader.read(gap).spans == 3
        check(gap, data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_spans_are_cut_for_parallelism_and_iov_max(shards, backend):
    paths, data = shards
    with ExpertReader(paths, threads=4, backend=backend) as reader:
        # one 12 MiB request over 4 threads: cap 3 MiB -> 4 (or 5, aligned cuts) spans
        big = [ReadRequest(4, 11, 12 * MiB, np.empty(12 * MiB, np.uint8))]
        res = reader.read(big)
        assert 4 <= res.spans <= 5
        check(big, data)
        # 2500 adjacent 16-byte requests: at most IOV_MAX destinations per read
        tiny = [ReadRequest(0, 5 + 16 * i, 16, np.empty(16, np.uint8)) for i in range(2500)]
        res = reader.read(tiny)
        assert res.spans == -(-2500 // system_iov_max())
        check(tiny, data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["direct", "fadvise"])
def test_submit_returns_at_once_and_overlaps(tmp_path, backend, mode):
    p = tmp_path / "big.bin"
    rng = np.random.default_rng(5)
    blob = rng.integers(0, 256, 96 * MiB, dtype=np.uint8)
    blob.tofile(p)
    data = [blob.tobytes()]
    with ExpertReader([p], threads=2, cache_bypass=mode, backend=backend) as reader:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED) if hasattr(os, "posix_fadvise") else None
        os.close(fd)
        reqs = [ReadRequest(0, 3 + i * 4 * MiB, 4 * MiB - 7, np.empty(4 * MiB - 7, np.uint8)) for i in range(23)]
        t0 = time.perf_counter()
        fut = reader.submit(reqs)
        t_submit = time.perf_counter() - t0
        done_at_once = fut.done()
        # the caller can do other work meanwhile, including another read
        other = [ReadRequest(0, 5, 1000, np.empty(1000, np.uint8))]
        reader.read(other)
        res = fut.result(timeout=60)
        t_total = time.perf_counter() - t0
        check(reqs + other, data)
        assert not done_at_once, "submit() waited for the batch"
        assert t_submit < t_total / 2, (t_submit, t_total)
        assert res.bytes == sum(r.length for r in reqs)
        # two batches in flight at once both complete
        a = [ReadRequest(0, i * MiB, MiB, np.empty(MiB, np.uint8)) for i in range(0, 40, 2)]
        b = [ReadRequest(0, i * MiB + 1, MiB, np.empty(MiB, np.uint8)) for i in range(1, 40, 2)]
        fa, fb = reader.submit(a), reader.submit(b)
        fb.result(timeout=60), fa.result(timeout=60)
        check(a + b, data)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["fadvise", "direct", "none"])
def test_truncated_shard_raises_read_error(tmp_path, backend, mode):
    p = tmp_path / "model-00001-of-00002.safetensors"
    p.write_bytes(b"x" * 10_000)
    with ExpertReader([p], threads=2, cache_bypass=mode, backend=backend) as reader:
        for off, ln in [(9_000, 2_000), (20_000, 100), (0, 10_001)]:
            reqs = [ReadRequest(0, off, ln, np.empty(ln, np.uint8)), ReadRequest(0, 0, 10, np.empty(10, np.uint8))]
            with pytest.raises(ReadError) as ei:
                reader.read(reqs)
            msg = str(ei.value)
            assert str(p) in msg and "short read" in msg and str(ln) in msg and str(off) in msg
            with pytest.raises(ReadError):
                reader.submit(reqs).result(timeout=30)
        ok = [ReadRequest(0, 9_990, 10, np.empty(10, np.uint8))]
        reader.read(ok)  # the reader still works after an error
        assert bytes(ok[0].dest) == b"x" * 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_file_raises_read_error(tmp_path, backend):
    good = tmp_path / "a.bin"
    good.write_bytes(b"y" * 100)
    missing = tmp_path / "model-00002-of-00002.safetensors"
    with ExpertReader([good, missing], backend=backend) as reader:  # opening is lazy: no error yet
        reader.read([ReadRequest(0, 0, 10, np.empty(10, np.uint8))])
        with pytest.raises(ReadError, match="does not exist") as ei:
            reader.read([ReadRequest(1, 0, 10, np.empty(10, np.uint8))])
        assert str(missing) in str(ei.value)
        with pytest.raises(ReadError):
            reader.submit([ReadRequest(1, 0, 10, np.empty(10, np.uint8))]).result(timeout=30)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_requests_raise_at_once(shards, backend):
    paths, _ = shards
    with ExpertReader(paths, backend=backend) as reader:
        with pytest.raises(ValueError, match="must match"):
            reader.read([ReadRequest(0, 0, 10, np.empty(11, np.uint8))])
        with pytest.raises(ValueError, match="must match"):
            reader.submit([ReadRequest(0, 0, 10, np.empty(9, np.uint8))])  # raised by submit itself
        with pytest.raises(ValueError, match="writable"):
            reader.read([ReadRequest(0, 0, 4, b"abcd")])
        with pytest.raises(ValueError, match="C-contiguous"):
            reader.read([ReadRequest(0, 0, 4, np.empty(8, np.uint8)[::2])])
        with pytest.raises(TypeError):
            reader.read([ReadRequest(0, 0, 4, 1234)])
        with pytest.raises(ValueError, match="out of range"):
            reader.read([ReadRequest(len(paths), 0, 4, np.empty(4, np.uint8))])
        with pytest.raises(ValueError, match="negative"):
            reader.read([ReadRequest(0, -1, 4, np.empty(4, np.uint8))])
        assert reader.read([]).bytes == 0
    with pytest.raises(ValueError, match="closed"):
        reader.read([ReadRequest(0, 0, 4, np.empty(4, np.uint8))])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("refused_at", ["open", "read"])
def test_direct_falls_back_where_refused(tmp_path, monkeypatch, backend, refused_at):
    """O_DIRECT refused (EINVAL, as on tmpfs before Linux 6.6 and some FUSE/network filesystems),
    at open or at the first read: the reader falls back to fadvise, records it, and reads right."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this OS (direct maps to the platform's own bypass)")
    import errno

    p = tmp_path / "d.bin"
    data = os.urandom(300_000)
    p.write_bytes(data)
    real_open = os.open

    def refusing_open(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *a, **kw)

    with ExpertReader([p], cache_bypass="direct", backend=backend) as reader:
        if refused_at == "open":
            monkeypatch.setattr(os, "open", refusing_open)
        else:
            run = reader.pool.run

            def refusing_run(plan, fds, dfds, mode):
                if mode == "direct":
                    return 0, 1, (0, 12_345, 200_000, errno.EINVAL, 12_345), 0.0
                return run(plan, fds, dfds, mode)

            monkeypatch.setattr(reader.pool, "run", refusing_run)
        reqs = [ReadRequest(0, 12_345, 200_000, np.empty(200_000, np.uint8))]
        reader.read(reqs)
        check(reqs, [data])
        assert reader.shards.requested == "direct"
        assert reader.cache_bypass == "fadvise" and "O_DIRECT" in reader.cache_bypass_note


@pytest.mark.parametrize("mode", ["none", "direct"])
def test_python_path_without_preadv(shards, monkeypatch, mode):
    """Where os has no preadv (old macOS), the Python path reads one destination at a time."""
    from expert_stream.streaming import read_pools as reader_mod

    monkeypatch.setattr(reader_mod, "_HAVE_PREADV", False)
    paths, data = shards
    rng = np.random.default_rng(11)
    with ExpertReader(paths, threads=2, cache_bypass=mode, backend="python") as reader:
        reqs = make_dests(random_requests(data, rng, n=60), rng)
        reader.read(reqs)
    check(reqs, data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_direct_into_aligned_destinations(shards, backend):
    """Aligned file ranges into page-aligned destinations (the zero-copy O_DIRECT path)."""
    paths, data = shards
    buf = mmap.mmap(-1, 8 * MiB)
    mv = memoryview(buf)
    reqs = [ReadRequest(0, 4096, 3 * MiB, mv[:3 * MiB]), ReadRequest(0, 4096 + 3 * MiB, MiB, mv[3 * MiB:4 * MiB]),
            ReadRequest(4, 8192, 4 * MiB, mv[4 * MiB:])]
    with ExpertReader(paths, cache_bypass="direct", backend=backend) as reader:
        reader.read(reqs)
    check(reqs, data)
    del reqs, mv
    buf.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_threads_reading_at_once(shards, backend):
    paths, data = shards
    errors = []
    with ExpertReader(paths, threads=3, backend=backend) as reader:
        def work(seed):
            try:
                rng = np.random.default_rng(seed)
                for _ in range(3):
                    reqs = make_dests(random_requests(data, rng, n=40), rng)
                    reader.read(reqs)
                    check(reqs, data)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        ts = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
    assert not errors, errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_descriptor_raises_read_error(tmp_path, backend):
    p = tmp_path / "c.bin"
    p.write_bytes(b"z" * 5000)
    reader = ExpertReader([p], cache_bypass="fadvise", backend=backend)
    reader.read([ReadRequest(0, 0, 10, np.empty(10, np.uint8))])
    os.close(reader.shards.fds[0])  # simulate a descriptor closed under the reader
    try:
        with pytest.raises(ReadError, match="EBADF") as ei:
            reader.read([ReadRequest(0, 0, 10, np.empty(10, np.uint8))])
        assert str(p) in str(ei.value)
    finally:
        reader.shards.fds[0] = -1
        reader.close()


@pytest.mark.skipif(not native.available, reason=f"native reader not built: {native.import_error}")
@pytest.mark.parametrize("mode", ["none", "fadvise", "direct"])
def test_both_pools_give_the_same_bytes_and_failures(shards, tmp_path, mode):
    """The seam ExpertReader stands on: for one plan, NativePool and PythonPool, started or run
    on the calling thread, fill the same bytes and report the same failure (a file that ends
    inside a span, a descriptor that cannot be read)."""
    from expert_stream.streaming.read_pools import NativePool, PythonPool
    from expert_stream.streaming.shard_files import ShardFiles

    paths, data = shards
    short = tmp_path / "short.bin"
    short.write_bytes(data[0][:10_000])
    files = ShardFiles(list(paths) + [short, tmp_path], mode)
    try:
        files.open(range(len(paths) + 1))
        mode = files.bypass  # direct falls back where the filesystem refuses it
        files.fds[-1] = os.open(tmp_path, os.O_RDONLY)  # a directory: reads fail with EISDIR
        if mode == "direct":
            files.dfds[-1] = os.dup(files.fds[-1])
        pools = [cls(len(files.paths), 4, 4 * MiB, 16 * MiB, MiB, 1024) for cls in (NativePool, PythonPool)]
        rng = np.random.default_rng(zlib.crc32(mode.encode()))
        base = random_requests(data, rng, n=80)
        for failing in ([], [(len(paths), 9_000, 2_000)], [(len(paths) + 1, 0, 100)]):
            outcomes = []
            for pool in pools:
                for how in ("start", "run"):
                    reqs = make_dests(base + failing, np.random.default_rng(3))
                    plan = pool.plan(reqs)
                    if how == "start":
                        nbytes, _, err, _ = pool.start(plan, files.fds, files.dfds, mode).wait(60)
                    else:
                        nbytes, _, err, _ = pool.run(plan, files.fds, files.dfds, mode)
                    outcomes.append(err)
                    if err is None:
                        assert nbytes == sum(r.length for r in reqs)
                        check(reqs, data)
            assert len(set(outcomes)) == 1, outcomes  # the same err tuple (or None) from each
            if failing:
                f, off, ln = failing[0]
                assert outcomes[0][0] == f and outcomes[0][3] == (0 if f == len(paths) else errno.EISDIR)
            else:
                assert outcomes[0] is None
        for pool in pools:
            pool.close()
    finally:
        files.close()
