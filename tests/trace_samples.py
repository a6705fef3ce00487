"""Routing rows and traces the policy tests share: skewed random rows, a small trace with every
optional field, and the routing traces of the shared workspace (skipped where absent)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from expert_stream.streaming.traces import RoutingTrace, load_trace

# The shared traces sit next to the repository; EXPERT_STREAM_TRACES points elsewhere (worktrees),
# as for tests/lab/test_replay.py.
SHARED_TRACES = Path(os.environ.get("EXPERT_STREAM_TRACES",
                                    Path(__file__).resolve().parents[1] / ".." / "shared" / "moe_traces"))


def random_rows(rng, T, E, K, skew=1.2):
    p = 1.0 / np.arange(1, E + 1) ** skew
    p /= p.sum()
    return np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(T)]).astype(np.int64)


def shared_trace(name: str) -> RoutingTrace:
    path = SHARED_TRACES / f"{name}.npz"
    if not path.is_file():
        pytest.skip(f"shared routing traces not found at {SHARED_TRACES.resolve()} (needs the project's "
                    f"shared/moe_traces folder next to the repository)")
    return load_trace(path)


def small_trace(**kw):
    rng = np.random.default_rng(5)
    ids = np.stack([[rng.choice(16, 2, replace=False) for _ in range(3)] for _ in range(30)])
    args = dict(ids=ids.astype(np.int16), layer_ids=np.array([1, 3, 5], dtype=np.int16),
                seq_start=np.array([0, 12], dtype=np.int64),
                phase=np.array([0] * 4 + [1] * 8 + [0] * 3 + [1] * 15, dtype=np.uint8),
                num_experts=16, name="tiny", meta={"model": "test"})
    args.update(kw)
    return RoutingTrace(**args)
