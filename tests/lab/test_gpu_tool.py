"""streaming/lab/gpu/gpu_tool.py keeps working: its `bench` and `exact` subcommands end to end on a tiny
checkpoint on this machine's backend (the figures mean nothing here; the tool's plumbing does)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import SHARED
from expert_stream.streaming.traces import RoutingTrace, save_trace

TOOL = Path(__file__).resolve().parents[2] / "streaming" / "lab" / "gpu" / "gpu_tool.py"


@pytest.fixture(scope="module")
def gpu_tool():
    spec = importlib.util.spec_from_file_location("gpu_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def model(checkpoints):
    return checkpoints("qwen3_moe", layers=2, experts=16, top_k=4, shard_size_mb=1)


def _trace(tmp_path):
    rng = np.random.default_rng(5)
    ids = np.stack([[rng.permutation(16)[:4] for _ in range(2)] for _ in range(200)]).astype(np.int16)
    phase = (np.arange(200) >= 60).astype(np.uint8)
    return save_trace(tmp_path / "t.npz", RoutingTrace(ids=ids, phase=phase, num_experts=16, name="t"))


@pytest.mark.slow  # two expert-stream bench processes: about 40 s on the 2-core CI machine
def test_bench_runs_and_reports_a_failed_variant(gpu_tool, model, tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "--out", str(out), "--checkpoint", str(model), "--trace", str(_trace(tmp_path)),
            "--runs", "0.5", "--prompt-tokens", "16", "--gen-tokens", "4", "--disk-gb", "0.005",
            "--variant", "lru:policy=lru", "--variant", "bad:policy=nonsense"]
    assert gpu_tool.main(argv) == 1  # the bad variant's run failed, and the tool says so
    runs = json.loads((out / "bench.json").read_text())["runs"]
    good, bad = runs
    assert (good["variant"], good["rc"], good["variant_settings"]) == ("lru", 0, {"policy": "lru"})
    assert good["slots_target"] == 8 and good["slots_per_layer"] == [8, 8]  # half of 16 experts
    assert good["settings"] == {"policy": "lru"} and good["decode_tok_s"] > 0
    assert good["routing"]["trace_name"] == "t" and good["misses_per_token"] > 0
    assert good["page_cache"]["resident_share_after"] in (0.0, None)
    assert bad["rc"] != 0 and "policy" in bad["error"]
    text = (out / "bench.txt").read_text()
    assert text.count("\n0.5 ") == 2 and "cap: " in text
    assert (out / "runs" / "0.5-lru.log").read_text().startswith("$ ")


def test_exact_checks_bits_and_catches_a_lossy_setting(gpu_tool, model, tmp_path):
    base = ["exact", "--checkpoint", str(model), "--slot-write", "staged,copy",
            "--prompt-tokens", "12", "--chunk", "4", "--decode-steps", "3"]
    assert gpu_tool.main([*base, "--out", str(tmp_path / "a")]) == 0
    cases = json.loads((tmp_path / "a" / "exact.json").read_text())["cases"]
    assert [c["case"] for c in cases] == ["stock vs stock (control)", "slot_write=staged", "slot_write=copy"]
    assert all(c["result"] == "exact" for c in cases)
    assert all(c["misses"] > 0 for c in cases[1:])  # slots = top-k: experts were evicted and read back
    # Routing to fewer experts than the checkpoint's top-k changes the logits: the check sees it.
    assert gpu_tool.main([*base, "--out", str(tmp_path / "b"), "--set", "prefetch=false,top_k_override=2"]) == 1
    doc = json.loads((tmp_path / "b" / "exact.json").read_text())
    assert doc["mismatches"] == 2 and doc["cases"][1]["result"].startswith("MISMATCH")


def test_runs_are_checked_before_anything_runs(gpu_tool, model, tmp_path):
    with pytest.raises(SystemExit, match="'0.3x' is not a share"):
        gpu_tool.main(["bench", "--out", str(tmp_path / "o"), "--checkpoint", str(model), "--runs", "auto,0.3x"])
    assert not (tmp_path / "o" / "runs").exists()


def test_a_required_cap_is_refused_where_none_can_be_set(gpu_tool, model, tmp_path):
    from expert_stream.streaming.lab.memory_cap import unavailable_reason

    if unavailable_reason() is None:
        pytest.skip("this machine can cap memory (cgroup v2 as root)")
    with pytest.raises(SystemExit, match="--require-cap: no cap: "):
        gpu_tool.main(["bench", "--out", str(tmp_path / "o"), "--checkpoint", str(model), "--runs", "auto",
                       "--cap-gib", "6", "--require-cap"])


def test_profile_splits_the_step_on_a_copied_checkpoint(gpu_tool, model, tmp_path):
    """profile on a copy (as on /dev/shm): read wait + host syncs + the rest make the step, one
    sync per streamed layer and token, the bound from the disk measured on the copy."""
    out, copy = tmp_path / "out", tmp_path / "shm"
    argv = ["profile", "--out", str(out), "--checkpoint", str(model), "--copy-to", str(copy), "--trace",
            str(_trace(tmp_path)), "--share", "0.25", "--prompt-tokens", "16", "--gen-tokens", "6",
            "--disk-gb", "0.005", "--top", "0"]
    assert gpu_tool.main(argv) == 0
    f = json.loads((out / "profile.json").read_text())
    assert f["checkpoint"] == str(copy / model.name) and (copy / model.name / "config.json").is_file()
    assert f["syncs_per_token"] == 2 and f["sync_ms"] > 0 and f["read_wait_ms"] > 0 and f["misses_per_token"] > 0
    assert f["read_wait_ms"] + f["sync_ms"] + f["rest_ms"] == pytest.approx(f["step_ms"])
    assert f["disk_gbps"] > 0 and f["bound_ms"] == max(f["stock_step_ms"], f["t_disk_ms"])
    assert f["ratio_to_bound"] == pytest.approx(f["bound_ms"] / f["step_ms"])
    assert f["cprofile_on"] is False and not (out / "profile.pstats").exists()
    assert "host syncs" in (out / "profile.txt").read_text()


@pytest.mark.slow  # one expert-stream bench process
def test_bench_runs_an_auto_budget(gpu_tool, model, tmp_path):
    """`auto` in --runs: the bench process sizes its budget itself (here to this machine's memory,
    uncapped: every expert, so the layers stay stock's and none streams), and the row shows what
    it resolved."""
    out = tmp_path / "out"
    argv = ["bench", "--out", str(out), "--checkpoint", str(model), "--trace", str(_trace(tmp_path)),
            "--runs", "auto", "--prompt-tokens", "16", "--gen-tokens", "4", "--disk-gb", "0.005"]
    assert gpu_tool.main(argv) == 0
    (r,) = json.loads((out / "bench.json").read_text())["runs"]
    assert (r["run"], r["budget_gib"], r["share"], r["slots_target"]) == ("auto", "auto", None, None)
    assert r["slot_gib"] > 0 and r["slots_per_layer"] == [] and r["decode_tok_s"] > 0
    assert r["misses_per_token"] == 0
    assert "\nauto  default  auto" in (out / "bench.txt").read_text() and " all " in (out / "bench.txt").read_text()


TINY = Path(os.environ.get("EXPERT_STREAM_MODELS", SHARED / "models")) / "tiny-code-moe"


@pytest.mark.slow  # one bench process: two variants and stock on the trained fixture
@pytest.mark.skipif(not TINY.is_dir(), reason=f"the trained fixture {TINY} is not present")
def test_corpus_runs_variants_on_a_copy_of_the_fixture(gpu_tool, tmp_path):
    out, copy = tmp_path / "out", tmp_path / "shm"
    corpus = Path(__file__).resolve().parents[2] / "streaming" / "lab" / "series.py"
    argv = ["corpus", "--out", str(out), "--checkpoint", str(TINY), "--copy-to", str(copy), "--corpus", str(corpus),
            "--variant", "off:prefetch=false", "--variant", "on:prefetch=true", "--share", "0.25", "--rounds", "1",
            "--prompt-tokens", "8", "--gen-tokens", "4", "--warmup-steps", "1", "--disk-gb", "0.002"]
    assert gpu_tool.main(argv) == 0
    doc = json.loads((out / "corpus.json").read_text())
    assert doc["checkpoint"] == str(copy / "tiny-code-moe")
    (series,) = doc["series"]
    assert [v["name"] for v in series["variants"]] == ["off", "on"]
    for v in series["variants"]:
        e = v["summary"]["exactness"]
        assert e["steps_equal"] == e["steps_compared"] > 0  # every step's logits equal stock's
    assert series["variants"][1]["summary"]["guesses_per_token"] > 0 == series["variants"][0]["summary"]["guesses_per_token"]
    text = (out / "corpus.txt").read_text()
    assert "series.py  off" in text and "series.py  on" in text


@pytest.mark.slow  # one bench process, one run, stock off
@pytest.mark.skipif(not TINY.is_dir(), reason=f"the trained fixture {TINY} is not present")
def test_corpus_without_variants_reports_its_one_run(gpu_tool, tmp_path):
    # bench prints a series only for variants; the tool once lost a lone run's report to a KeyError
    out = tmp_path / "out"
    corpus = Path(__file__).resolve().parents[2] / "streaming" / "lab" / "series.py"
    argv = ["corpus", "--out", str(out), "--checkpoint", str(TINY), "--corpus", str(corpus), "--share", "0.25",
            "--rounds", "1", "--prompt-tokens", "8", "--gen-tokens", "4", "--warmup-steps", "0", "--stock", "no",
            "--disk-gb", "0.002"]
    assert gpu_tool.main(argv) == 0
    (series,) = json.loads((out / "corpus.json").read_text())["series"]
    (run,) = series["variants"]
    assert run["name"] == "default" and run["summary"]["misses_per_token"] is not None
