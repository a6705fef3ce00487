"""The disk probes the benchmark and the README's figures use: decode-shaped batches of a
checkpoint's experts read exactly those experts' bytes, and the command prints one row a case."""

from __future__ import annotations

from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.lab.disk_bandwidth import main, measure_expert_batches


def test_expert_batches_read_whole_experts_of_one_layer(checkpoints):
    path = checkpoints("qwen3_moe", layers=2, experts=16, top_k=4)
    per_expert = checkpoint_footprint(path).layer_expert_bytes
    assert len(set(per_expert)) == 1
    r = measure_expert_batches(path, experts=3, batches=7, threads=2, gap_ms=1.0)
    assert r["bytes"] == 7 * 3 * per_expert[0]
    assert r["gbps"] > 0 and r["ms_median"] > 0 and r["gap_ms"] == 1.0
    # more experts than a layer has: every expert of the layer, once
    assert measure_expert_batches(path, experts=99, batches=2)["bytes"] == 2 * 16 * per_expert[0]


def test_expert_batches_command_prints_a_row_per_case(checkpoints, capsys):
    path = checkpoints("qwen3_moe", layers=2, experts=16, top_k=4)
    assert main(["--model", str(path), "--experts", "1,2", "--threads", "2", "--min-spans", "1M", "--gaps", "0"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.strip().splitlines()[1:]]
    assert [row[0] for row in rows] == ["1", "2"] and all(float(row[4]) > 0 for row in rows)
