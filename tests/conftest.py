"""Shared fixtures: synthetic checkpoints made once per test session (real files on disk).

The tests are grouped by what they exercise: engine/ (the runtime engine: `pytest tests/engine`
runs it alone), plugin/ (config, reload, hooks, CLI), hosts/ (real host processes, pipeline
ranks), lab/ (benchmarks, replay, simulation, synthetic checkpoints, the GPU tool). The helpers
beside this file (exactness.py, plugin_fixtures.py, ...) are importable from every group: pytest
puts this folder on sys.path when it loads this conftest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """make(arch, **kwargs) -> Path of a synthetic checkpoint, cached for the session by kwargs."""
    from expert_stream.streaming.lab.synthetic import make_checkpoint

    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[str, Path] = {}

    def make(arch="qwen3_moe", **kwargs) -> Path:
        kwargs.setdefault("dtype", "float32")  # MLX CPU runs fp32 ~10x faster than bf16
        key = json.dumps([arch, kwargs], sort_keys=True, default=str)
        if key not in made:
            out = root / f"{arch}-{len(made)}"
            made[key] = make_checkpoint(out, arch=arch, progress=False, **kwargs)
        return made[key]

    return make


@pytest.fixture(autouse=True, scope="session")
def _quiet_tokenizers():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


@pytest.fixture
def ckpt(checkpoints, tmp_path):
    """A private copy of a small checkpoint that a test may damage."""
    src = checkpoints("qwen3_moe", layers=2, shard_size_mb=1)
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst
