"""Page cache honesty for the benchmark: a checkpoint's pages can be dropped and their residency
measured; a memory cap runs a process in a cgroup v2 group where the OS allows it, and is
refused with the reason where it does not (this CI machine has the memory controller on cgroup
v1 only, so there the refusal is what is tested)."""

from __future__ import annotations

import os
import sys

import pytest

from expert_stream.plugin.cli import main
from expert_stream.streaming.lab.memory_cap import run_capped, unavailable_reason
from expert_stream.streaming.lab.page_cache import drop_checkpoint, drop_method, resident_bytes


@pytest.mark.skipif(drop_method() is None, reason="this OS cannot drop a file's pages")
def test_drop_evicts_a_read_file(tmp_path):
    path = tmp_path / "shard.safetensors"
    path.write_bytes(os.urandom(8 << 20))
    path.read_bytes()  # into the page cache (and dirty pages: the drop must sync them first)
    assert resident_bytes(path) > 0
    result = drop_checkpoint([path])
    assert result["files"] == 1 and result["bytes"] == 8 << 20
    assert result["resident_share_after"] == 0.0
    assert resident_bytes(path) == 0


def test_memory_cap_runs_or_is_refused_with_its_reason(checkpoints, capsys):
    reason = unavailable_reason()
    if reason is None:
        small = run_capped([sys.executable, "-c", "print('fits')"], 256 << 20)
        assert small.returncode == 0 and small.stdout.strip() == "fits" and not small.killed
        big = run_capped([sys.executable, "-c", "b = bytearray(1 << 30); b[::4096] = b'x' * len(b[::4096])"], 128 << 20)
        assert big.killed and big.returncode != 0
        return
    path = checkpoints("qwen3_moe", layers=2, experts=16, top_k=4)
    assert main(["bench", str(path), "--budget-gib", "1", "--memory-cap", "2"]) == 2
    err = capsys.readouterr().err
    assert "--memory-cap 2" in err and reason in err
