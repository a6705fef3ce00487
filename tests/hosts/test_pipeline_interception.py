"""The plugin's sharded_load (what mlx_lm.server --pipeline calls), in this process with a
pipeline of one rank: a streamed folder loads through the engine's pipeline load, exactly as
stock; a folder the config does not stream gets mlx-lm's own sharded_load and its own answer."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm.utils
import numpy as np
import pytest

from plugin_fixtures import make_dense

from expert_stream.plugin.hosts import interception
from expert_stream.plugin.hosts.mlx_lm import pipeline_mode
from expert_stream.streaming.footprint import checkpoint_footprint


@pytest.fixture
def sharded_load():
    interception.install()
    yield pipeline_mode._streaming_sharded_load(mlx_lm.utils.sharded_load)
    interception.set_targets({})


def _logits(model, ids):
    out = model(mx.array([ids]))
    mx.eval(out)
    return np.array(out)


def test_a_streamed_folder_loads_streamed_and_exact(checkpoints, sharded_load):
    moe = checkpoints("deepseek_v3", layers=4, bits=0, shard_size_mb=1)
    fp = checkpoint_footprint(moe)
    settings = {"budget_gib": fp.budget_gib_for_slots(fp.top_k), "policy": "lru"}
    interception.set_targets({moe: interception.Target("moe", settings)})
    model, tokenizer, config = sharded_load(str(moe), pipeline_group=mx.distributed.init(), return_config=True)
    handle = interception.handles()["moe"]
    try:
        assert handle.model is model and handle.streams and config["model_type"] == "deepseek_v3"
        with interception.stock_loads():  # else the patched load_model would stream this one too
            stock, _ = mlx_lm.utils.load_model(Path(moe))
        ids = [5, 9, 33, 2, 17, 41, 8]
        assert np.array_equal(_logits(model, ids), _logits(stock, ids))
    finally:
        interception.forget("moe")


def test_a_streamed_folder_refuses_tensor_parallelism(checkpoints, sharded_load):
    from expert_stream.plugin.hosts.base import HostError

    moe = checkpoints("deepseek_v3", layers=4, bits=0, shard_size_mb=1)
    interception.set_targets({moe: interception.Target("moe", {"budget_gib": 1.0})})
    with pytest.raises(HostError, match="moe: a streamed model runs only in mlx_lm.server's pipeline mode"):
        sharded_load(str(moe), tensor_group=mx.distributed.init())


def test_other_folders_get_mlx_lms_own_sharded_load(tmp_path, checkpoints, sharded_load):
    moe = checkpoints("deepseek_v3", layers=4, bits=0, shard_size_mb=1)
    interception.set_targets({moe: interception.Target("moe", {"budget_gib": 1.0})})
    dense = make_dense(tmp_path)  # qwen3: mlx-lm has no pipeline for it, and says so itself
    with pytest.raises(ValueError, match="does not support pipelining") as ours:
        sharded_load(str(dense), pipeline_group=mx.distributed.init())
    with pytest.raises(ValueError) as stock:
        mlx_lm.utils.sharded_load(str(dense), pipeline_group=mx.distributed.init())
    assert str(ours.value) == str(stock.value)
    assert "moe" not in interception.handles()
