"""Several machines: mlx-lm's pipeline mode over mlx.distributed (two ranks on 127.0.0.1, ring
backend). Each rank keeps its own layers' trunk and streams only its own layers' experts, from
its own copy of the shards; the logits equal one process's stock mlx-lm, bitwise."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from expert_stream.streaming.footprint import checkpoint_footprint

HELPERS = Path(__file__).resolve().parents[1]  # tests/: pipeline_worker.py
LAYERS = 4  # two ranks: rank 0 runs layers 2-3, rank 1 layers 0-1 (mlx-lm gives rank 0 the last)
pytestmark = pytest.mark.slow


def _launch(tmp_path, path_pattern, settings, port, prompt, chunk=8, decode_steps=6):
    args = {"path": path_pattern, "settings": settings, "prompt": prompt, "chunk": chunk,
            "decode_steps": decode_steps, "out": str(tmp_path / "logits-{rank}.npy")}
    cmd = [*_mlx_launch(), "--hosts", "127.0.0.1", "-n", "2", "--backend", "ring", "--starting-port",
           str(port), "--python", sys.executable, str(HELPERS / "pipeline_worker.py"), json.dumps(args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=HELPERS)


def _mlx_launch() -> list[str]:
    """MLX's own launcher (its `mlx.launch` console script), run by this interpreter."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "mlx.launch"][:1]
    return [sys.executable, "-c", f"import sys; from {script.module} import {script.attr}; sys.exit({script.attr}())"]


def _stock_logits(path, prompt, chunk=8, decode_steps=6):
    model, _ = load_model(Path(path))
    cache = make_prompt_cache(model)
    ids = mx.array(np.array(prompt, dtype=np.int32)[None])
    logits = []
    for start in range(0, ids.shape[1], chunk):
        out = model(ids[:, start:start + chunk], cache=cache)
        mx.eval(out)
        logits.append(np.array(out).reshape(-1))
    token = mx.argmax(out[:, -1:], axis=-1)
    for _ in range(decode_steps):
        out = model(token, cache=cache)
        mx.eval(out)
        logits.append(np.array(out).reshape(-1))
        token = mx.argmax(out[:, -1:], axis=-1)
    return np.concatenate(logits)


def _shards_by_layers(path):
    """shard name -> set of decoder layer numbers it holds (None for tensors outside layers)."""
    weight_map = json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"]
    held = {}
    for name, shard in weight_map.items():
        parts = name.split(".")
        layer = int(parts[2]) if name.startswith("model.layers.") else None
        held.setdefault(shard, set()).add(layer)
    return held


@pytest.fixture(scope="module")
def model(tmp_path_factory, checkpoints):
    return checkpoints("deepseek_v3", layers=LAYERS, bits=0, shard_size_mb=1)


def _per_rank_copies(tmp_path, src):
    """Rank 1's copy lacks the shards that hold only rank 0's layers (2-3)."""
    for rank in (0, 1):
        shutil.copytree(src, tmp_path / f"rank{rank}")
    dropped = [s for s, layers in _shards_by_layers(src).items() if layers and layers <= {2, 3}]
    for shard in dropped:
        (tmp_path / "rank1" / shard).unlink()
    return dropped


@pytest.mark.parametrize("decode_path", ["python", "native"])
def test_two_ranks_stream_their_own_layers_exactly(model, tmp_path, decode_path):
    fp = checkpoint_footprint(model)
    budget = fp.budget_gib_for_slots(fp.top_k)  # per rank: 6 slots in rank 0's two MoE layers, 12 in rank 1's one
    dropped = _per_rank_copies(tmp_path, model)
    assert dropped, "the checkpoint has no shard of rank 0's layers only"
    prompt = np.random.default_rng(0).integers(3, 500, 20).tolist()
    settings = {"budget_gib": budget, "policy": "lru", "decode_path": decode_path}
    port = 32400 if decode_path == "python" else 32440
    done = _launch(tmp_path, str(tmp_path / "rank{rank}"), settings, port, prompt)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = {r["rank"]: r for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))}
    assert all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in reports[0]["streamed"])
    assert all(name.startswith(("model.layers.0.", "model.layers.1.")) for name in reports[1]["streamed"])
    assert reports[0]["streamed"] and reports[1]["streamed"] and reports[0]["misses"] > 0
    assert [reports[r]["decode_path"] for r in (0, 1)] == [decode_path] * 2
    stock = _stock_logits(model, prompt)
    for rank in (0, 1):
        assert np.array_equal(np.load(tmp_path / f"logits-{rank}.npy"), stock), f"rank {rank}: logits differ"


def test_a_rank_without_its_shard_names_it(model, tmp_path):
    fp = checkpoint_footprint(model)
    for rank in (0, 1):
        shutil.copytree(model, tmp_path / f"rank{rank}")
    needed = sorted(s for s, layers in _shards_by_layers(model).items() if layers & {0, 1} - {None})
    (tmp_path / "rank1" / needed[0]).unlink()
    done = _launch(tmp_path, str(tmp_path / "rank{rank}"), {"budget_gib": fp.budget_gib_for_slots(fp.top_k)},
                   32420, [5, 6, 7])
    assert f"rank 1 refused: {tmp_path / 'rank1' / needed[0]}: missing, but rank 1 needs it" in done.stdout, (
        done.stdout[-3000:] + done.stderr[-3000:])


def test_budget_by_rank_must_match_the_ranks(model):
    import expert_stream
    from expert_stream.streaming.errors import SettingsError

    alone = mx.distributed.init()  # a pipeline of one rank, in this process
    with pytest.raises(SettingsError, match="budget_gib_by_rank has 2 entries for a pipeline of 1 ranks"):
        expert_stream.load(model, budget_gib=1.0, budget_gib_by_rank=[1.0, 2.0], pipeline_group=alone)
