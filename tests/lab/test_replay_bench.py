"""`expert-stream bench --routing`: the report of a replayed run (figures are not asserted: the
machines here are shared and noisy; relations between them are)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from expert_stream.plugin.cli import main
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.traces import RoutingTrace, save_trace


def _trace(tmp_path, top_k=4, prefill_rows=150, rows=300):
    rng = np.random.default_rng(3)
    ids = np.stack([[rng.permutation(16)[:top_k] for _ in range(2)] for _ in range(rows)]).astype(np.int16)
    phase = (np.arange(rows) >= prefill_rows).astype(np.uint8)
    return save_trace(tmp_path / "t.npz", RoutingTrace(ids=ids, phase=phase, num_experts=16, name="t"))


@pytest.fixture
def model(checkpoints):
    return checkpoints("qwen3_moe", layers=3, experts=16, top_k=4, shard_size_mb=1)


def test_bench_replay_report(model, tmp_path, capsys):
    budget = checkpoint_footprint(model).budget_gib_for_slots(5)
    argv = ["bench", str(model), "--budget-gib", str(budget), "--prompt-tokens", "24", "--gen-tokens", "8",
            "--disk-gb", "0.005", "--stock", "yes", "--json", "--routing", str(_trace(tmp_path))]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    routing = r["routing"]
    # Default start: the timed decode begins at the trace's first decode row (150).
    assert routing["trace_start"] == 150 - 24
    assert routing["decode_rows_from_trace_decode"] == 1.0
    assert (routing["trace_layers"], routing["model_moe_layers"]) == (2, 3)
    assert r["token_agreement_with_stock"] == 1.0  # stock replayed the same rows
    sim = routing["sim_misses_per_token"]
    assert set(sim) >= {"lru", "belady"} and 0 <= sim["belady"] <= sim["lru"]
    assert r["misses_per_token"] > 0 and r["bytes_per_token"] > 0
    assert r["read_gbps_run"] > 0
    assert r["disk_bound_tok_s"] == pytest.approx(r["read_gbps_run"] * 1e9 / r["bytes_per_token"])
    assert r["ratio_to_disk_bound"] == pytest.approx(r["decode_tok_s"] / r["disk_bound_tok_s"])
    assert r["bound_tok_s"] == pytest.approx(1 / max(r["t_compute_s"], r["t_disk_s"]))
    assert r["bound_run_tok_s"] == pytest.approx(min(1 / r["t_compute_s"], r["disk_bound_tok_s"]))
    # Reads in flight per token: the reader's bytes at its own rate; the waited part is no more.
    assert r["read_busy_per_token_s"] == pytest.approx(r["bytes_per_token"] / (r["read_gbps_run"] * 1e9), rel=0.05)
    assert 0 <= r["reads_hidden_share"] <= 1
    assert r["reads_hidden_share"] == pytest.approx(max(0, 1 - r["read_wait_per_token_s"] / r["read_busy_per_token_s"]))
    if sys.platform.startswith("linux"):
        assert r["page_cache"]["method"].startswith("posix_fadvise") and r["page_cache"]["resident_share_after"] == 0.0
    assert "cannot know" in r["lookahead"]["note"]
    assert r["workload"] == "replay of t.npz"


def test_bench_replay_trace_start_and_text(model, tmp_path, capsys):
    budget = checkpoint_footprint(model).budget_gib_for_slots(4)
    argv = ["bench", str(model), "--budget-gib", str(budget), "--prompt-tokens", "8", "--gen-tokens", "4",
            "--disk-gb", "0.005", "--stock", "no", "--routing", str(_trace(tmp_path)), "--trace-start", "10"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "real routing replayed: t from row 10" in out
    assert "; 0% of the timed decode rows are decode rows" in out  # rows 18..21 are prefill rows
    assert "lru" in out and "belady" in out and "page cache" in out
    assert "hidden behind compute" in out


def test_bench_refuses_a_trace_of_another_top_k(model, tmp_path, capsys):
    argv = ["bench", str(model), "--budget-gib", "1", "--routing", str(_trace(tmp_path, top_k=2))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "top-2" in err and "4 experts" in err and "synth --like-trace" in err


def test_capped_child_entry_round_trips_the_report(model, tmp_path):
    """The process that --memory-cap starts inside the cgroup (here without one, which this
    machine cannot make): it takes the config as JSON and prints the streamed side's report."""
    import subprocess

    from expert_stream.streaming.lab.bench import BenchConfig, finish
    from expert_stream.streaming.lab.capped_bench import _config_json

    cfg = BenchConfig(model_dir=model, budget_gib=checkpoint_footprint(model).budget_gib_for_slots(5),
                      prompt_tokens=8, gen_tokens=4, disk_bytes=5_000_000, stock="no",
                      routing=_trace(tmp_path), known_t_compute=(0.01, "earlier run"))
    out = subprocess.run([sys.executable, "-m", "expert_stream.streaming.lab.capped_bench", _config_json(cfg)],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    r = finish(json.loads(out))
    assert r["t_compute_source"] == "earlier run" and r["routing"]["trace_start"] == 150 - 8
    assert r["bound_tok_s"] > 0 and "_tokens" not in r


def test_bench_replay_series_says_replay(model, tmp_path, capsys):
    """Variants side by side under replay: the figures say replay, the lookahead's hit rate is
    reported as measured (its router cannot know the replayed route), ratios to the first."""
    budget = checkpoint_footprint(model).budget_gib_for_slots(5)
    argv = ["bench", str(model), "--budget-gib", str(budget), "--prompt-tokens", "8", "--gen-tokens", "6",
            "--disk-gb", "0.005", "--stock", "yes", "--warmup-steps", "1", "--routing", str(_trace(tmp_path)),
            "--variant", "off:prefetch=false", "--variant", "on:prefetch=true,prefetch_per_layer=2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("workload      replay of t.npz")
    assert "guessed right (replay: cannot know)" in out and "ratio to off" in out
    assert main([*argv, "--json"]) == 0
    (series,) = json.loads(capsys.readouterr().out)["series"]
    off, on = (v["summary"] for v in series["variants"])
    assert on["guess_hit_rate"] is not None and off["guess_hit_rate"] is None
    assert off["replay_belady_misses_per_token"] <= off["replay_lru_misses_per_token"]
    assert off["token_agreement_with_stock"] == on["token_agreement_with_stock"] == 1.0
    assert on["ratio_to_first"]["decode_tok_s_rounds"] == [on["decode_tok_s"] / off["decode_tok_s"]]
