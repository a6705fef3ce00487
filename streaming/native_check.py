"""Whether the native decode path (native/resolve.cpp) may serve in this process: it is built
for the MLX running here and proves itself before any model uses it, or the Python path serves
and the log says why.

The proof (`self_check`) resolves a miss, a hit and an eviction on a one-slot table over a small
file and gathers through the slots it returns, bitwise against the file's bytes. On CUDA the
proof also fails a read and expects both kinds of evaluation (async, as mlx-lm's loop runs, and
synchronous) to raise it; it runs in a child process, since a fault in a GPU kernel ends the
process it happens in, once per build (its pass is kept beside the build).

`python -m expert_stream.streaming.native_check` is the child's side.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..native import resolve_build
from .cache import EMPTY
from .native_decode import panel_of
from .policy import LRUPolicy

CHILD_SECONDS = 600  # a fresh machine's first MLX CUDA process compiles its kernels for minutes
_why_not: dict = {}


def native_module():
    """(the primitive's module, "") where the native decode path can serve in this process, or
    (None, why not). Decided once a process."""
    if "result" not in _why_not:
        _why_not["result"] = _module()
    return _why_not["result"]


def _cuda() -> bool:
    return bool(getattr(getattr(mx, "cuda", None), "is_available", lambda: False)())


def _module():
    on_gpu = mx.default_device() != mx.cpu
    if on_gpu and not _cuda():
        return None, f"it runs on MLX's CPU and CUDA backends only (this process computes on {mx.default_device()})"
    major_minor = tuple(int(p) for p in mx.__version__.split(".")[:2])
    if major_minor < (0, 32):  # earlier streams do not carry a resolution's failure to the caller
        return None, f"it needs MLX 0.32 or later (this is {mx.__version__})"
    module, why = resolve_build.load(cuda=on_gpu)
    if module is None:
        return None, why
    why = _proven_in_child(module) if on_gpu else self_check(module)
    return (module, "") if not why else (None, why)


def self_check(module, failures: bool = False) -> str:
    """"" when the build resolves and gathers this file's bytes on the default device (and,
    with `failures`, fails both kinds of evaluation on a failed read); else what it did."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows")
        np.arange(8, dtype=np.float32).tofile(path)  # expert e's row: 4e .. 4e+3
        table, counts, slot_rows, _held = _one_slot_table(module, path)
        got = []
        for i, e in enumerate((1, 1, 0)):
            slots, rows = module.resolve(mx.array([e], dtype=mx.uint32), [slot_rows], table)
            picked = mx.take(rows, slots, axis=0)  # a gather behind the resolution, as the block's
            if i == 1:
                mx.async_eval(slots, picked)  # as mlx-lm's loop evaluates (the others: synchronously)
            got.append((np.array(slots).tolist(), np.array(picked).reshape(-1).tolist()))
        want = [([0], [4.0, 5.0, 6.0, 7.0]), ([0], [4.0, 5.0, 6.0, 7.0]), ([0], [0.0, 1.0, 2.0, 3.0])]
        if got != want or counts.tolist()[:4] != [3, 1, 2, 1]:
            return f"its self-check gave {got} (counts {counts.tolist()}), not {want}"
        return _failures_raise(module, path) if failures else ""


def _one_slot_table(module, path: str):
    """(the table, its counts, its slot tensor, the arrays the table points into: keep them)."""
    st = os.stat(path)
    shards = module.Shards([path], [[st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]], False)
    policy = LRUPolicy(2, 1)
    held = [np.full(2, EMPTY, dtype=np.int32), np.full(1, EMPTY, dtype=np.int32), policy, np.zeros(4),
            np.zeros(module.NUM_COUNTS, dtype=np.uint64)]
    slot_of, expert_in, _, state, counts = held
    table = module.LayerTable("self-check", slot_of, expert_in, **panel_of(policy, state), counts=counts,
                              row_bytes=[16], file_of=[0, 0], offset_of=[0, 16], shards=shards)
    slot_rows = mx.zeros((1, 4), dtype=mx.float32)
    mx.eval(slot_rows)
    return table, counts, slot_rows, held


def _failures_raise(module, path: str) -> str:
    """Expert 1's row cut off the file: its read fails, and an async evaluation (the token's
    wait) and a synchronous one must each raise it."""
    os.truncate(path, 16)
    for how in ("async", "sync"):
        table, _, slot_rows, _held = _one_slot_table(module, path)
        slots, rows = module.resolve(mx.array([1], dtype=mx.uint32), [slot_rows], table)
        picked = mx.take(rows, slots, axis=0)
        try:
            if how == "async":
                mx.async_eval(picked)
            mx.eval(picked)
        except RuntimeError as exc:
            if "offset 16" not in str(exc):
                return f"its self-check's failed read ({how}) raised {exc!r}, which does not name it"
            continue
        finally:
            _settle()
        return f"its self-check's failed read did not fail the {how} evaluation"
    return ""


def _settle() -> None:
    """Nothing of a failed evaluation left to surface in a later one."""
    for _ in range(2):
        try:
            mx.synchronize()
        except RuntimeError:
            pass


def _proven_in_child(module) -> str:
    """self_check with failures in a child process, once per build."""
    proven = Path(module.__file__).with_suffix(".proven")
    if proven.exists():
        return ""
    try:
        done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True,
                              timeout=CHILD_SECONDS)
    except subprocess.TimeoutExpired:
        return f"its self-check did not finish in {CHILD_SECONDS} s"
    if done.returncode != 0:
        tail = (done.stdout.strip() or done.stderr.strip() or f"exit status {done.returncode}").splitlines()[-1]
        return f"its self-check in a child process failed: {tail}"
    proven.write_text(done.stdout)
    return ""


def main() -> int:
    module, why = resolve_build.load(cuda=mx.default_device() != mx.cpu)
    why = why or self_check(module, failures=True)
    print(why or "proven")
    return 1 if why else 0


if __name__ == "__main__":
    sys.exit(main())
