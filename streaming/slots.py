"""Slot memory of one MoE layer: for each stacked expert tensor (weight, scales, biases, bias) an
MLX array with `num_slots` rows in place of `num_experts`, so the stock SwitchGLU / SwitchMLP
computes on slots exactly as it computes on experts (the kernels only gather rows).

Four ways to fill a slot; MLX arrays are made and evaluated on the compute thread only:
- direct: the reader writes the expert's bytes straight into the slot rows through a writable
  byte view of the evaluated slot array; zero copies. For memory the CPU owns or shares
  coherently with the GPU (CPU backend, Metal's unified memory).
- staged: the reader fills plain host buffers; the compute thread copies them into the slot
  rows (one memcpy) once no kernel reads the arrays. For CUDA, whose host-visible arrays are
  managed memory: reader threads writing managed pages while kernels run stalled every sync
  (measured on an H200: 28 ms per host read of a routing result, decode 9.4 vs 15.7 tok/s).
- cuda: page-locked host buffers, then a CUDA driver copy into the slot rows, which stay on the
  GPU (streaming/cuda_copy.py): a staged write moves the slot's pages to the host and back,
  about 25 times slower per expert on an H200. The default on CUDA; bitwise exact there
  (`streaming/lab/gpu/gpu_tool.py exact`), as staged is. (The mismatches an earlier check found came from
  calls with fewer rows than stock's taking another kernel, with either write: kernel_match.py.)
- copy: staging buffers, then an MLX scatter into the slot arrays (portable fallback).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from . import cuda_copy
from .checkpoint import TensorInfo
from .errors import SettingsError

# safetensors dtype -> MLX dtype
MX_DTYPES = {
    "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16,
    "U32": mx.uint32, "I32": mx.int32, "U8": mx.uint8, "I8": mx.int8,
    "U16": mx.uint16, "I16": mx.int16, "U64": mx.uint64, "I64": mx.int64, "BOOL": mx.bool_,
    # MLX has no 8-bit float type: mx.load gives these bytes as uint8, and so do the slots.
    "F8_E4M3": mx.uint8, "F8_E5M2": mx.uint8, "F64": mx.float64,
}


@dataclass(frozen=True)
class ExpertTensor:
    """One stacked expert tensor of a block: `leaf` is its path inside the block
    (e.g. "gate_proj.scales"); expert e's bytes are info.start + e * row_bytes, row_bytes long."""

    leaf: str
    info: TensorInfo

    @property
    def num_experts(self) -> int:
        return self.info.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.info.nbytes // self.num_experts

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.info.shape[1:]

    @property
    def mx_dtype(self):
        return MX_DTYPES[self.info.dtype]

    def offset_of(self, expert: int) -> int:
        return self.info.start + int(expert) * self.row_bytes


def expert_bytes(tensors: list[ExpertTensor]) -> int:
    """Bytes one expert takes across all tensors of a block."""
    return sum(t.row_bytes for t in tensors)


def resolve_slot_write(mode: str) -> str:
    """'auto' -> 'cuda' on CUDA ('staged' when the CUDA driver library cannot be used),
    'direct' elsewhere (see the module docstring)."""
    if mode == "cuda" and cuda_copy.copier() is None:
        raise SettingsError(f"slot_write 'cuda' needs the CUDA driver: {cuda_copy.why_unavailable()}")
    if mode != "auto":
        return mode
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda" if cuda_copy.copier() is not None else "staged"
    return "direct"


class Staging:
    """Host rows of a batch of experts on their way into slots: `blocks[t]` is tensor t's
    (count, row_bytes) array; `buffer` the page-locked memory they are cut from (cuda mode)."""

    __slots__ = ("blocks", "buffer")

    def __init__(self, blocks: list[np.ndarray], buffer: Optional[np.ndarray] = None):
        self.blocks, self.buffer = blocks, buffer


class ExpertSlots:
    def __init__(self, tensors: list[ExpertTensor], num_slots: int, write_mode: str):
        self.tensors = tensors
        self.num_slots = num_slots
        self.write_mode = write_mode
        self.arrays = {t.leaf: mx.zeros((num_slots, *t.row_shape), dtype=t.mx_dtype) for t in tensors}
        mx.eval(list(self.arrays.values()))
        self._copier = None
        if write_mode == "cuda":
            self._copier = cuda_copy.copier()
            if self._copier is None:
                raise SettingsError(f"slot_write 'cuda' needs the CUDA driver: {cuda_copy.why_unavailable()}")
        self._make_views()

    def _make_views(self) -> None:
        self._views = {}
        if self.write_mode in ("direct", "staged", "cuda"):
            for t in self.tensors:
                raw = self.arrays[t.leaf].reshape(self.num_slots, -1).view(mx.uint8)
                mx.eval(raw)
                view = np.array(raw, copy=False)
                if not view.flags.writeable or view.shape != (self.num_slots, t.row_bytes):
                    raise RuntimeError("direct slot writes need a writable host view of MLX memory")
                self._views[t.leaf] = view

    def resize(self, rows: np.ndarray) -> None:
        """New slot arrays of len(rows) slots: new slot i holds old slot rows[i] (-1: an empty
        slot, any bytes). Graphs still pending keep the old arrays alive, and nothing writes
        those again; the caller hands the new arrays to the module (online budgets)."""
        where = mx.array(np.maximum(rows, 0).astype(np.uint32))
        self.arrays = {leaf: a[where] for leaf, a in self.arrays.items()}
        mx.eval(list(self.arrays.values()))
        self.num_slots = len(rows)
        self._make_views()

    @property
    def nbytes(self) -> int:
        return self.num_slots * expert_bytes(self.tensors)

    def destinations(self, slot: int) -> list[np.ndarray]:
        """Direct mode: the slot's own bytes, one writable buffer per tensor."""
        return [self._views[t.leaf][slot] for t in self.tensors]

    def staging(self, count: int) -> Staging:
        """Staged, cuda and copy modes: one (count, row_bytes) block per tensor, filled by the
        reader row by row, so that a batch of experts reaches MLX in one transfer per tensor."""
        if self._copier is None:
            return Staging([np.empty((count, t.row_bytes), dtype=np.uint8) for t in self.tensors])
        # Page-locked memory is pooled by size: round the batch up so that sizes repeat.
        rows = 1 << (count - 1).bit_length()
        buffer = self._copier.host_buffer(rows * expert_bytes(self.tensors))
        blocks, start = [], 0
        for t in self.tensors:
            blocks.append(buffer[start:start + count * t.row_bytes].reshape(count, t.row_bytes))
            start += rows * t.row_bytes
        return Staging(blocks, buffer)

    def release(self, staged: Optional[Staging]) -> None:
        """The staged rows are no longer needed (committed, or their reads failed)."""
        if staged is not None and staged.buffer is not None:
            buffer, staged.buffer, staged.blocks = staged.buffer, None, []
            self._copier.give_back(buffer)

    def commit(self, slots: np.ndarray, staged: Optional[Staging]) -> None:
        """After the reads finished: write the staged rows into the slot arrays. Runs on the
        compute thread; no pending graph may read these arrays (the caller settles them)."""
        if self.write_mode == "direct" or staged is None:
            return
        if self.write_mode == "cuda":
            self._copier.copy_rows(
                (self._views[t.leaf].__array_interface__["data"][0] + int(slot) * t.row_bytes, block[i])
                for t, block in zip(self.tensors, staged.blocks)
                for i, slot in enumerate(slots)
            )
            self.release(staged)
            return
        if self.write_mode == "staged":
            for t, block in zip(self.tensors, staged.blocks):
                view = self._views[t.leaf]
                for i, slot in enumerate(slots):
                    view[int(slot)] = block[i]
            return
        where = mx.array(np.asarray(slots, dtype=np.uint32))
        for t, block in zip(self.tensors, staged.blocks):
            rows = mx.array(block).view(t.mx_dtype).reshape(len(slots), *t.row_shape)
            self.arrays[t.leaf][where] = rows
        mx.eval(list(self.arrays.values()))
