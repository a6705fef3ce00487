"""A checkpoint changed on disk under a loaded model is noticed: the model fails with an error
naming the shard, every request after that fails too, and no output ever mixes two files'
bytes. A shard that is not a regular file is refused at load instead of hanging."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

import expert_stream
from exactness import prompt_ids
from expert_stream.streaming.errors import CheckpointError, ShardChangedError
from expert_stream.streaming.footprint import checkpoint_footprint


def _expert_shard(handle):
    """The shard holding the first streamed layer's first expert tensor."""
    tensor = handle.streams[0].slots.tensors[0]
    return handle.index.files[tensor.info.file], tensor.info


def _overwrite_in_place(path, info):
    with open(path, "r+b") as f:
        f.seek(info.start)
        f.write(os.urandom(info.nbytes))


def _copy_over(path, info):
    changed = path.with_suffix(".new")
    shutil.copyfile(path, changed)
    _overwrite_in_place(changed, info)
    shutil.copyfile(changed, path)  # cp: same inode, other bytes
    changed.unlink()


def _rename_replace(path, info):
    changed = path.with_suffix(".new")
    shutil.copyfile(path, changed)
    _overwrite_in_place(changed, info)
    os.replace(changed, path)  # the path now names another file


@pytest.mark.parametrize("change", [_overwrite_in_place, _copy_over, _rename_replace])
def test_changed_shard_fails_the_model_naming_it(ckpt, change):
    fp = checkpoint_footprint(ckpt)
    model, _, handle = expert_stream.load(ckpt, budget_gib=fp.min_budget_gib, prefetch=False)
    shard, info = _expert_shard(handle)
    change(shard, info)  # before the shard's first expert read
    for _ in range(2):  # the first request fails, and so does every later one
        with pytest.raises(ShardChangedError, match=rf"shard \S*{shard.name} changed on disk"):
            mx.eval(model(prompt_ids(8)))
    handle.close()


def test_change_between_index_and_reader_is_refused(ckpt):
    from expert_stream.streaming.checkpoint import CheckpointIndex
    from expert_stream.streaming.reader import ExpertReader

    index = CheckpointIndex(ckpt)
    shard = index.files[0]
    data = bytearray(shard.read_bytes())
    data[20] ^= 0xFF  # inside the header
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardChangedError, match=shard.name):
        ExpertReader(index.files, identities=index.identities)


def test_fifo_in_place_of_a_shard_is_refused_at_load(ckpt):
    victim = sorted(ckpt.glob("model*.safetensors"))[-1]
    victim.unlink()
    os.mkfifo(victim)
    code = (
        "import expert_stream, sys\n"
        "from expert_stream.streaming.errors import CheckpointError\n"
        "try:\n"
        f"    expert_stream.load({str(ckpt)!r}, budget_gib=1)\n"
        "except CheckpointError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert f"{victim.name}: not a regular file" in done.stdout
    with pytest.raises(CheckpointError, match="not a regular file"):
        from expert_stream.streaming.checkpoint import CheckpointIndex

        CheckpointIndex(ckpt)
