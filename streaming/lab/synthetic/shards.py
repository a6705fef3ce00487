"""The safetensors shards: which tensor goes in which file (mlx-lm's `make_shards` rule and file
names), and writing them with bounded memory. Every shard's header is known from shapes alone,
so the files are laid out first and then filled by positioned writes, one tensor group (and for
big tensors one chunk) at a time: memory never holds more than one chunk, whatever the shard
size. Headers look like MLX's own: sorted keys, compact JSON, {"format": "mlx"} metadata."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx

_ST_DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
}
# Shards at least this large are flushed and dropped from the page cache once complete, so a
# benchmark that follows reads the disk, not RAM (posix_fadvise DONTNEED evicts 1 GiB in 7.6 ms
# here); smaller ones stay cached.
_DROP_CACHE_BYTES = 64 << 20
_CLEAR_CACHE_BYTES = 16 << 20


@dataclass
class TensorGroup:
    """Tensors produced together: make(i) returns chunk i of each, in `names` order (lazy MLX
    arrays or NumPy arrays); chunks concatenate along axis 0. A plain tensor is a group of one
    with one chunk; a big or quantized expert stack is (weight, scales[, biases]) made chunk
    by chunk."""

    names: list[str]
    n_chunks: int
    make: Callable[[int], list[mx.array]]


def plan_shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """mlx-lm's `make_shards` rule: tensors in order, a new shard when the next tensor would
    pass the limit (but never an empty shard)."""
    shards, current, size = [], [], 0
    for name, nbytes in sizes.items():
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """mlx-lm's file names: one file is model.safetensors, more are model-0000i-of-0000n."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(shard: list[str], specs: dict[str, tuple]) -> tuple[bytes, dict[str, int]]:
    header: dict = {"__metadata__": {"format": "mlx"}}
    offsets, pos = {}, 0
    for name in shard:
        shape, dtype, nbytes = specs[name]
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [pos, pos + nbytes]}
        offsets[name] = pos
        pos += nbytes
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode(), offsets


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    data = data.cast("B")
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def write_shards(
    folder: Path,
    specs: dict[str, tuple],
    groups: list[TensorGroup],
    max_bytes: int,
    on_bytes: Optional[Callable[[int], None]] = None,
) -> dict[str, str]:
    """Write every tensor of `specs` (name -> (shape, dtype, nbytes), in shard order) into
    shards of at most `max_bytes`; `groups` produce the data. Returns the weight map."""
    sizes = {k: v[2] for k, v in specs.items()}
    shards = plan_shards(sizes, max_bytes)
    names = shard_names(len(shards))
    where: dict[str, tuple[int, int]] = {}  # tensor -> (shard index, file offset)
    fds, remaining = [], []
    try:
        for i, (shard, fname) in enumerate(zip(shards, names)):
            header, offsets = _header(shard, specs)
            fd = os.open(folder / fname, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds.append(fd)
            _pwrite_all(fd, memoryview(struct.pack("<Q", len(header)) + header), 0)
            data_start = 8 + len(header)
            total = sum(sizes[n] for n in shard)
            os.ftruncate(fd, data_start + total)
            remaining.append(total)
            for n in shard:
                where[n] = (i, data_start + offsets[n])

        for group in groups:
            cursor = {n: 0 for n in group.names}
            for c in range(group.n_chunks):
                parts = group.make(c)
                mx.eval([p for p in parts if isinstance(p, mx.array)])
                for name, part in zip(group.names, parts):
                    shard, base = where[name]
                    cursor[name] += _write_array(fds[shard], part, base + cursor[name])
                    remaining[shard] -= part.nbytes
                    if on_bytes is not None:
                        on_bytes(part.nbytes)
                    if remaining[shard] == 0:
                        _finish(fds[shard], sum(sizes[n] for n in shards[shard]))
                big = sum(p.nbytes for p in parts) >= _CLEAR_CACHE_BYTES
                del parts, part
                if big:  # give the freed buffers back instead of keeping them in MLX's cache
                    mx.clear_cache()
            for name in group.names:
                if cursor[name] != sizes[name]:
                    raise AssertionError(f"{name}: wrote {cursor[name]} of {sizes[name]} bytes")
        if any(remaining):
            missing = [n for s, r in zip(shards, remaining) if r for n in s]
            raise AssertionError(f"tensors never written: {missing[:5]}")
    finally:
        for fd in fds:
            os.close(fd)
    return {name: names[where[name][0]] for name in specs}


def _write_array(fd: int, array, offset: int) -> int:
    """Write an evaluated MLX array (or a NumPy array) at `offset`; return its byte count."""
    view = memoryview(array)
    if not view.c_contiguous:
        view = memoryview(mx.contiguous(array) if isinstance(array, mx.array) else array.copy())
    _pwrite_all(fd, view, offset)
    return view.nbytes


def _finish(fd: int, nbytes: int) -> None:
    if nbytes < _DROP_CACHE_BYTES or not hasattr(os, "posix_fadvise"):
        return
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
