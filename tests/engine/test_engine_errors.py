"""Bad input gets a clear error naming the file, tensor or setting."""

from __future__ import annotations

import json
import shutil
import struct

import mlx.core as mx
import pytest

import expert_stream
from exactness import prompt_ids
from expert_stream.streaming.errors import (
    BudgetError,
    CheckpointError,
    NotMoEError,
    ReadError,
    SettingsError,
)
from expert_stream.streaming.footprint import checkpoint_footprint


def _shards(path):
    return sorted(path.glob("model*.safetensors"))


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def test_missing_shard(ckpt):
    victim = _shards(ckpt)[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        expert_stream.load(ckpt, budget_gib=1)


def test_truncated_shard_names_file_and_tensor(ckpt):
    victim = _shards(ckpt)[0]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(CheckpointError, match=rf"{victim.name}: truncated: tensor \S+ ends at byte"):
        expert_stream.load(ckpt, budget_gib=1)


def test_header_that_does_not_parse(ckpt):
    victim = _shards(ckpt)[0]
    data = bytearray(victim.read_bytes())
    data[8:20] = b"{not json!!!"
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{victim.name}: safetensors header does not parse"):
        expert_stream.load(ckpt, budget_gib=1)


def test_not_a_safetensors_file(ckpt):
    victim = _shards(ckpt)[0]
    victim.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=rf"{victim.name}: header length"):
        expert_stream.load(ckpt, budget_gib=1)


def test_unstacked_experts(checkpoints, tmp_path):
    """A Hugging Face layout (one tensor per expert) must be converted first."""
    src = checkpoints("qwen3_moe", layers=2, bits=0)
    dst = tmp_path / "hf"
    shutil.copytree(src, dst)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in _shards(dst):
        tensors = mx.load(str(shard))
        out = {}
        for name, value in tensors.items():
            if ".switch_mlp." in name:
                for e in range(value.shape[0]):
                    out[name.replace(".switch_mlp.", f".experts.{e}.")] = value[e]
            else:
                out[name] = value
        mx.save_safetensors(str(shard), out, metadata={"format": "mlx"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".switch_mlp." not in k}
        index["weight_map"].update({k: shard.name for k in out})
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="experts are not stacked"):
        expert_stream.load(dst, budget_gib=1)


def test_unsupported_quantization(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization"]["bits"] = 7
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: quantization asks for mode=affine bits=7"):
        expert_stream.load(ckpt, budget_gib=1)


def test_budget_below_one_tokens_experts(ckpt):
    fp = checkpoint_footprint(ckpt)
    with pytest.raises(BudgetError, match=rf"smallest budget is {fp.min_budget_gib:.4g} GiB"):
        expert_stream.load(ckpt, budget_gib=fp.min_budget_gib * 0.9)
    expert_stream.load(ckpt, budget_gib=fp.min_budget_gib)[2].close()  # exactly enough works


def test_non_moe_checkpoint_is_refused(checkpoints):
    dense = checkpoints("qwen3_moe", layers=2, overrides={"mlp_only_layers": [0, 1]})
    with pytest.raises(NotMoEError, match="no routed-expert layers.*mlx_lm.load"):
        expert_stream.load(dense, budget_gib=1)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"budget_gib": 0}, "budget_gib must be > 0"),
        ({"budget_gib": "8"}, "budget_gib must be float"),
        ({"budget_gib": 1, "polcy": "lru"}, "unknown setting.*polcy"),
        ({"budget_gib": 1, "reader": "fast"}, "reader must be one of"),
        ({"budget_gib": 1, "prefetch": "yes"}, "prefetch must be bool"),
        # Removed settings are refused with the reason, not ignored (nor called unknown).
        ({"budget_gib": 1, "speculate": False}, "'speculate' no longer exists: speculative decode was removed.*slower"),
        ({"budget_gib": 1, "speculate_check_every": 4}, "'speculate_check_every' no longer exists"),
        ({"budget_gib": 1, "warm_start": "/nonexistent/trace.npz"}, "warm_start.*does not exist"),
    ],
)
def test_bad_settings(ckpt, settings, message):
    with pytest.raises(SettingsError, match=message):
        expert_stream.load(ckpt, **settings)


@pytest.mark.skipif(hasattr(mx, "cuda") and mx.cuda.is_available(), reason="CUDA is there")
def test_cuda_slot_writes_without_cuda(ckpt):
    with pytest.raises(SettingsError, match="slot_write 'cuda' needs the CUDA driver: .*libcuda"):
        expert_stream.load(ckpt, budget_gib=1, slot_write="cuda")


def test_io_error_during_decode_names_layer_and_file(ckpt):
    fp = checkpoint_footprint(ckpt)
    model, _, handle = expert_stream.load(ckpt, budget_gib=fp.min_budget_gib, prefetch=False)
    for shard in _shards(ckpt):  # the shards shrink under the running model
        with open(shard, "r+b") as f:
            f.truncate(_header(shard)[1] + 16)
    with pytest.raises(ReadError, match=r"model\.layers\.\d+\.mlp\.switch_mlp: .*model\S*\.safetensors"):
        mx.eval(model(prompt_ids(8)))
    handle.close()
