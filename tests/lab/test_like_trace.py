"""`expert-stream synth --like-trace`: a checkpoint whose MoE layers, experts and top-k are a
trace's, with the expert sizes of the real model of that routing unless flags say otherwise."""

from __future__ import annotations

import json

import numpy as np

from expert_stream.plugin.cli import main
from expert_stream.streaming.footprint import checkpoint_footprint
from expert_stream.streaming.lab.replay import check_fit
from expert_stream.streaming.traces import RoutingTrace, load_trace, save_trace


def _trace(tmp_path, experts, top_k, layers):
    rng = np.random.default_rng(0)
    ids = np.stack([[rng.permutation(experts)[:top_k] for _ in range(layers)] for _ in range(20)]).astype(np.int16)
    return save_trace(tmp_path / f"t{experts}_{top_k}.npz", RoutingTrace(ids=ids, num_experts=experts, name=f"t{experts}_{top_k}"))


def _synth_json(argv, capsys) -> dict:
    assert main(["synth", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_family_sizes_by_default(tmp_path, capsys):
    """60 experts top-4 is Qwen1.5-MoE: hidden 2048, expert intermediate 1408 (dry run: sizes only)."""
    r = _synth_json(["--like-trace", str(_trace(tmp_path, 60, 4, 3)), "--out", str(tmp_path / "x"), "--dry-run"], capsys)
    like = r["like_trace"]
    assert (like["family"], like["hidden"], like["moe_hidden"], like["sizes_from"]) == ("Qwen1.5-MoE-A2.7B", 2048, 1408, "family")
    assert (r["moe_layers"], r["experts"]) == (3, 60)
    # 4-bit affine, group 64: 3 matrices of 2048 x 1408, 4.5 bits per weight with scales and biases
    assert r["bytes_per_expert"] == 3 * 2048 * 1408 // 2 + 3 * 2 * 2 * (2048 * 1408 // 64)


def test_written_checkpoint_fits_its_trace(tmp_path, capsys):
    trace_path = _trace(tmp_path, 64, 6, 2)
    out = tmp_path / "ck"
    r = _synth_json(["--like-trace", str(trace_path), "--out", str(out), "--hidden", "64",
                     "--expert-intermediate", "32", "--dtype", "float32", "--bits", "0"], capsys)
    assert r["like_trace"]["family"] == "DeepSeek-V2-Lite" and r["like_trace"]["sizes_from"] == "flags"
    fp = checkpoint_footprint(out)
    assert fp.num_experts == (64, 64) and fp.top_k == 6
    check_fit(load_trace(trace_path), str(out), fp.model_type, 64, fp.top_k)  # raises when it does not fit


def test_layout_with_dense_first_layer(tmp_path, capsys):
    """deepseek_v3 keeps a dense first layer: 3 MoE layers take 4 layers."""
    r = _synth_json(["--like-trace", str(_trace(tmp_path, 64, 6, 3)), "--arch", "deepseek_v3", "--out",
                     str(tmp_path / "x"), "--dry-run", "--hidden", "64", "--expert-intermediate", "32"], capsys)
    assert (r["layers"], r["moe_layers"]) == (4, 3)


def test_unknown_routing_needs_sizes(tmp_path, capsys):
    trace_path = _trace(tmp_path, 20, 3, 1)
    assert main(["synth", "--like-trace", str(trace_path), "--out", str(tmp_path / "x"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "20 experts top-3" in err and "--hidden and --expert-intermediate" in err
    r = _synth_json(["--like-trace", str(trace_path), "--out", str(tmp_path / "x"), "--dry-run",
                     "--hidden", "64", "--expert-intermediate", "32"], capsys)
    assert (r["experts"], r["moe_layers"], r["like_trace"]["family"]) == (20, 1, None)


def test_moe_layers_without_a_trace(tmp_path, capsys):
    r = _synth_json(["--arch", "llama4", "--moe-layers", "3", "--out", str(tmp_path / "x"), "--dry-run"], capsys)
    assert (r["layers"], r["moe_layers"]) == (6, 3)  # Llama 4: MoE every other layer
