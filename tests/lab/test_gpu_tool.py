"""streaming/lab/gpu/gpu_tool.py keeps working: its `bench` and `exact` subcommands end to end on a tiny
checkpoint on this machine's backend (the figures mean nothing here; the tool's plumbing does)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

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
