"""Stock's kernel for every call we split: the rules by which MLX backends pick a quantized
gather-matmul kernel from a call's shape, and how to shape our calls so they pick stock's.

A streamed layer sometimes computes one stock call's (token, expert) pairs in several calls
(the prefill sweep's expert groups, a decode step's hits then misses), and its expert tensors
are slot arrays with fewer experts than the checkpoint. Both change the call's shape, and the
backends choose their kernel by shape. Different kernels add in different orders, so the bits
change even though each row's arithmetic is "the same":

- CUDA (MLX 0.32): fewer than 8 rows run a vector kernel, 8 or more the tiled matmul
  (`git show d62b5b5:tests/gpu/probe_rows.py`: rows computed alone differ from the same rows in
  a 128-row call below 8 rows and match from 8 rows; padded to 8 they match).
- Metal: a sorted call with at least 16 rows and at least 4 rows per expert of the weight array
  runs the batched `gather_qmm_rhs` kernel, anything else the vector kernel (MLX's
  GatherQMM::eval_gpu). "Experts" is the weight array's leading dimension: the slot count for
  us, the checkpoint's expert count for stock.
- CPU: one kernel; each row's result does not depend on the call.

Within a kernel a row's result does not depend on the other rows of the call (measured on CUDA,
prefixes from 8 to 127 rows; Metal's rhs kernel has fixed tiles). So a call is matched by
padding it with copies of its last row (outputs dropped) or splitting it into smaller calls.
Unquantized gather_mm picks by the sort flag alone, which we always take from stock's whole call.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

CUDA_MATMUL_ROWS = 8  # MLX CUDA gather_qmm: the tiled kernel from this many rows
METAL_RHS_ROWS = 16  # Metal gather_qmm_rhs: at least this many rows ...
METAL_RHS_ROWS_PER_EXPERT = 4  # ... and at least this many per expert of the weight array

UNLIMITED = 1 << 62


def current_backend() -> str:
    """'metal', 'cuda' or 'cpu': the backend MLX computes on by default."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def kernel(backend: str, rows: int, experts: int, sorted_rows: bool) -> str:
    """The kernel family a quantized gather matmul of this shape runs on `backend`."""
    if backend == "cuda":
        return "matmul" if rows >= CUDA_MATMUL_ROWS else "vector"
    if backend == "metal":
        rhs = sorted_rows and rows >= METAL_RHS_ROWS and rows >= METAL_RHS_ROWS_PER_EXPERT * experts
        return "rhs" if rhs else "vector"
    return "any"


@dataclass(frozen=True)
class RowPlan:
    """Run a set of rows in calls of at most `max_rows`, each padded to `min_rows`."""

    max_rows: int = UNLIMITED
    min_rows: int = 1

    def whole(self, rows: int) -> bool:
        """True when one call of `rows` rows, unpadded, takes stock's kernel."""
        return self.min_rows <= rows <= self.max_rows


def plan_rows(backend: str, stock_rows: int, stock_experts: int, experts: int, sorted_rows: bool,
              quantized: bool = True) -> RowPlan:
    """How to shape calls against a weight array of `experts` experts so that each takes the
    kernel of stock's whole call (`stock_rows` rows against `stock_experts` experts)."""
    if not quantized:
        return RowPlan()
    target = kernel(backend, stock_rows, stock_experts, sorted_rows)
    if backend == "cuda":
        return RowPlan(min_rows=CUDA_MATMUL_ROWS) if target == "matmul" else RowPlan(max_rows=CUDA_MATMUL_ROWS - 1)
    if backend == "metal" and sorted_rows:
        rhs_from = max(METAL_RHS_ROWS, METAL_RHS_ROWS_PER_EXPERT * experts)
        return RowPlan(min_rows=rhs_from) if target == "rhs" else RowPlan(max_rows=rhs_from - 1)
    return RowPlan()


def is_quantized(module: nn.Module) -> bool:
    """Does this SwitchGLU / SwitchMLP multiply by quantized experts (a gather_qmm)?"""
    return any(isinstance(child, nn.Module) and "scales" in child for child in module.values())
