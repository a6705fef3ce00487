"""The benchmark and trace commands produce their reports (figures are not asserted: machines
here are shared and noisy; the bench prints ratios from one side-by-side run)."""

from __future__ import annotations

import json

import pytest

from expert_stream.plugin.cli import main
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.traces import load_trace

REQUIRED = ("decode_tok_s", "prefill_tok_s", "miss_rate", "bytes_per_token", "disk_gbps",
            "t_compute_s", "bound_tok_s", "ratio_to_bound", "stock_tok_s")


@pytest.fixture
def small(checkpoints):
    return checkpoints("qwen3_moe", layers=3, experts=32, top_k=4, shard_size_mb=1)


def test_bench_json(small, capsys):
    budget = checkpoint_footprint(small).budget_gib_for_slots(6)
    argv = ["bench", str(small), "--budget-gib", str(budget), "--prompt-tokens", "48",
            "--gen-tokens", "6", "--disk-gb", "0.005", "--stock", "yes", "--json",
            "--set", "prefetch=false"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    for key in REQUIRED:
        assert isinstance(report[key], float) and report[key] >= 0, key
    assert report["token_agreement_with_stock"] == 1.0  # exact: the same greedy tokens
    assert report["bound_tok_s"] == pytest.approx(1 / max(report["t_compute_s"], report["t_disk_s"]))
    # The prompt needs more experts than the 6 slots: the sweep read each missing one once.
    # (The first decode step runs before the first token is out; without lookahead its reads
    # are all misses too.)
    assert report["prefill_reads_per_missed_expert"] == pytest.approx(1.0)
    assert report["miss_rate"] > 0


def test_bench_forced_hits_and_lossy_agreement(small, capsys):
    budget = checkpoint_footprint(small).budget_gib_for_slots(4)
    argv = ["bench", str(small), "--budget-gib", str(budget), "--prompt-tokens", "8",
            "--gen-tokens", "4", "--disk-gb", "0.005", "--stock", "no", "--json",
            "--set", "skip_miss_below=0.2"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["t_compute_source"] == "forced_hits" and "stock_tok_s" not in report
    assert 0.0 <= report["token_agreement_with_exact"] <= 1.0


def test_trace_command_records_the_shared_format(small, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The first document is short.\n\nA second one, also short.\n")
    out = tmp_path / "routing.npz"
    budget = checkpoint_footprint(small).budget_gib_for_slots(8)
    assert main(["trace", str(small), "--out", str(out), "--budget-gib", str(budget),
                 "--corpus", str(corpus), "--gen-tokens", "3"]) == 0
    trace = load_trace(out)
    assert trace.ids.shape[1:] == (3, 4) and len(trace.seq_start) == 2
    assert (out.with_suffix(".json")).is_file()
