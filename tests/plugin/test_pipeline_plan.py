"""`expert-stream plan MODEL --ranks N`: each rank's layers are the ones mlx-lm's own pipeline()
gives it, and its trunk and expert bytes add up to the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.utils import load_model

from expert_stream.plugin.cli import main
from expert_stream.streaming.checkpoint import CheckpointIndex
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.pipeline_split import LAYER, _Group, rank_shares


@pytest.fixture(scope="module")
def model(checkpoints):
    return checkpoints("deepseek_v3", layers=4, bits=0, shard_size_mb=1)


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_holds_what_mlx_lm_pipeline_gives_it(model, ranks):
    shares = rank_shares(model, ranks)
    for share in shares:
        real, _ = load_model(Path(model), lazy=True, strict=False)
        real.model.pipeline(_Group(share.rank, ranks))  # the real model's own split, rank by rank
        assert (share.first_layer, share.end_layer) == (real.model.start_idx, real.model.end_idx)
    fp = checkpoint_footprint(model)
    assert sum(s.expert_bytes for s in shares) == fp.expert_bytes
    index = CheckpointIndex(model)
    outside_layers = sum(t.nbytes for n, t in index.tensors.items() if LAYER.search(n) is None)
    # every rank keeps the embeddings, final norm and head; the layers' trunk is split
    assert sum(s.trunk_bytes for s in shares) == fp.trunk_bytes + (ranks - 1) * outside_layers
    assert sum(s.moe_layers for s in shares) == len(fp.layer_expert_bytes)


def test_plan_ranks_prints_each_rank(model, capsys):
    assert main(["plan", str(model), "--ranks", "2", "--bandwidth-gbps", "1", "--compute-ms", "10", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["pipeline"]
    by_rank = {r["rank"]: r for r in plan["per_rank"]}
    assert by_rank[0]["layers"] == [2, 4] and by_rank[1]["layers"] == [0, 2]
    assert by_rank[0]["moe_layers"] == 2 and by_rank[1]["moe_layers"] == 1  # deepseek_v3's first layer is dense
    assert plan["layers_without_rank"] == [] and plan["layers_on_two_ranks"] == []
    assert main(["plan", str(model), "--ranks", "2", "--bandwidth-gbps", "1", "--compute-ms", "10"]) == 0
    text = capsys.readouterr().out
    assert "rank 0: layers 2-3 (2 MoE)" in text and "rank 1: layers 0-1 (1 MoE)" in text


def test_plan_ranks_refuses_a_model_mlx_lm_cannot_pipeline(checkpoints):
    from expert_stream.streaming.errors import NotMoEError

    mixtral = checkpoints("mixtral", layers=2, bits=0)
    with pytest.raises(NotMoEError, match="mlx-lm has no pipeline mode for model_type 'mixtral'"):
        rank_shares(mixtral, 2)
