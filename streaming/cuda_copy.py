"""Copies of read expert bytes into GPU slot memory on CUDA, through the CUDA driver (ctypes).

MLX's CUDA arrays live in managed memory, and the slot arrays' pages sit on the GPU. Writing a
slot through its host view (the "staged" slot write) makes the driver move the touched pages to
the host, and the next kernel faults them back. A copy by the driver from page-locked host
memory into the same pointer moves the bytes by DMA and leaves the pages on the GPU, many
times faster per expert (streaming/lab/MEASUREMENTS.md).

The copies run on a stream of their own and are waited for before `copy_rows` returns, so MLX
kernels launched afterwards see the bytes. The caller guarantees that no kernel reads the
destination rows meanwhile (the slot contract of streaming/slots.py).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import numpy as np

# Page-locked buffers kept for reuse once returned, at most this many bytes in all.
IDLE_POOL_BYTES = 512 << 20
_NON_BLOCKING_STREAM = 1


class CudaError(RuntimeError):
    pass


class CudaCopier:
    """Page-locked host buffers and host-to-device copies on the device MLX computes on."""

    def __init__(self, device: int = 0):
        self._lib = ctypes.CDLL("libcuda.so.1")
        lib = self._lib
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
        lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self._check(lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        # The primary context is the one MLX (through the runtime API) computes in.
        self._ctx = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev), "cuDevicePrimaryCtxRetain")
        self._enter()
        self._stream = ctypes.c_void_p()
        self._check(lib.cuStreamCreate(ctypes.byref(self._stream), _NON_BLOCKING_STREAM), "cuStreamCreate")
        self._lock = threading.Lock()
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._pointers: dict[int, int] = {}  # id(buffer) -> its page-locked allocation

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise CudaError(f"{what} failed with CUDA error {code}")

    def _enter(self) -> None:
        # The compute thread may not be the thread that loaded the model.
        self._check(self._lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    # -- page-locked buffers ---------------------------------------------------------------
    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A page-locked uint8 buffer of `nbytes`; hand it back with `give_back`."""
        with self._lock:
            free = self._idle.get(nbytes)
            if free:
                self._idle_bytes -= nbytes
                return free.pop()
        self._enter()
        ptr = ctypes.c_void_p()
        self._check(self._lib.cuMemHostAlloc(ctypes.byref(ptr), nbytes, 0), f"cuMemHostAlloc({nbytes})")
        buf = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr.value))
        with self._lock:
            self._pointers[id(buf)] = ptr.value
        return buf

    def give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._idle_bytes + buf.nbytes <= IDLE_POOL_BYTES:
                self._idle.setdefault(buf.nbytes, []).append(buf)
                self._idle_bytes += buf.nbytes
                return
            ptr = self._pointers.pop(id(buf))
        del buf
        self._check(self._lib.cuMemFreeHost(ptr), "cuMemFreeHost")

    # -- copies ----------------------------------------------------------------------------
    def copy_rows(self, copies) -> None:
        """`copies`: (device address, host uint8 row) pairs. Returns once every byte landed."""
        self._enter()
        lib = self._lib
        for address, row in copies:
            self._check(
                lib.cuMemcpyHtoDAsync_v2(address, row.ctypes.data, row.nbytes, self._stream),
                "cuMemcpyHtoDAsync",
            )
        self._check(lib.cuStreamSynchronize(self._stream), "cuStreamSynchronize")


_copier: Optional[CudaCopier] = None
_unavailable: Optional[str] = None


def copier() -> Optional[CudaCopier]:
    """The process's copier, or None where the CUDA driver cannot be used (no CUDA backend, no
    libcuda); `why_unavailable()` then says why."""
    global _copier, _unavailable
    if _copier is None and _unavailable is None:
        try:
            _copier = CudaCopier()
        except (OSError, AttributeError, CudaError) as exc:
            _unavailable = str(exc)
    return _copier


def why_unavailable() -> Optional[str]:
    return _unavailable
