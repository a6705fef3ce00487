"""The `plan` and `demo` commands, as a user runs them."""

from __future__ import annotations

import json
import subprocess

import pytest

from plugin_fixtures import ENGINE_SETTINGS, expert_stream_argv, make_moe, needs_openai_server


def test_plan_reports_sizes_and_budgets(tmp_path, capsys):
    from expert_stream.plugin.cli import main

    moe = make_moe(tmp_path)
    assert main(["plan", str(moe), "--json", "--memory-gib", "16", "--context", "4096"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["moe_layers"] == 2 and plan["experts_per_layer"] == 8 and plan["top_k"] == 2
    assert plan["trunk_gib"] + plan["expert_gib"] == pytest.approx(plan["total_gib"], abs=0.002)
    assert plan["disk_gbps"] > 0 and plan["budgets"][0]["slots_per_layer"] == 2
    assert plan["t_compute_ms"] > 0 and plan["t_compute_source"] == "timed with every expert in a slot"
    every = plan["budgets"][-1]
    assert every["miss_rate"] == [0.0, 0.0] and every["tok_s"][0] == every["tok_s"][1]
    assert main(["plan", str(moe), "--bandwidth-gbps", "2", "--compute-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model:    {moe} (qwen3_moe, 2 layers") and "smallest" in out
    assert "uniform routing (conservative)" in out
    assert "prefill:  layer-major, passes of up to" in out


def test_plan_states_the_prefill_activation_term(tmp_path, capsys):
    """plan prints what a layer-major pass holds per prompt token: hidden-size vectors of the
    activation dtype, 2 x top_k + 4 of them (streaming/prompt_pass.activation_bytes)."""
    from expert_stream.plugin.cli import main

    moe = make_moe(tmp_path)
    assert main(["plan", str(moe), "--json", "--bandwidth-gbps", "1", "--compute-ms", "5", "--context", "8192"]) == 0
    plan = json.loads(capsys.readouterr().out)
    hidden = json.loads((moe / "config.json").read_text())["hidden_size"]
    pre = plan["prefill"]
    assert pre["token_bytes"] in (hidden * size * (2 * plan["top_k"] + 4) for size in (2, 4))
    assert pre["pass_gib"] == round(pre["token_bytes"] * 8192 / (1 << 30), 4)
    assert pre["prefill_step"] <= pre["auto_pass_tokens"] <= 8192 and pre["per_chunk"] is None
    assert 0 < pre["readahead_experts"] and pre["readahead_gib"] <= 0.5


def test_plan_predicts_from_compute_and_the_miss_curve(tmp_path, capsys):
    """1 GB/s, 10 ms of compute: a quarter of the experts under uniform routing misses 3 of 4
    of a token's experts; a trace that always routes to two experts misses none at any budget."""
    import numpy as np

    from expert_stream.plugin.cli import main
    from expert_stream.streaming.traces import RoutingTrace, save_trace

    moe = make_moe(tmp_path)
    assert main(["plan", str(moe), "--json", "--bandwidth-gbps", "1", "--compute-ms", "10"]) == 0
    plan = json.loads(capsys.readouterr().out)
    token_bytes = plan["token_expert_gib"] * (1 << 30)
    two = next(b for b in plan["budgets"] if b["slots_per_layer"] == 2)
    assert two["miss_rate"] == [0.0, 0.75]
    assert two["tok_s"][0] == pytest.approx(1 / (0.010 + 0.75 * token_bytes / 1e9), rel=0.01)
    assert two["tok_s"][1] == pytest.approx(100, rel=0.01)  # compute alone
    ids = np.tile(np.array([[0, 1], [2, 3]], dtype=np.int16), (200, 1, 1))
    trace = save_trace(tmp_path / "t.npz", RoutingTrace(ids=ids, layer_ids=np.array([0, 1], dtype=np.int16),
                                                       num_experts=8))
    assert main(["plan", str(moe), "--json", "--bandwidth-gbps", "1", "--compute-ms", "10",
                 "--trace", str(trace)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert all(b["miss_rate"][1] < 0.05 for b in plan["budgets"]), plan["budgets"]
    assert plan["budgets"][0]["miss_curve"].startswith("trace")
    # Where every expert does not fit beside the trunk, compute is timed with forced hits.
    from expert_stream.streaming.footprint import checkpoint_footprint

    fp = checkpoint_footprint(moe)
    room = (fp.trunk_bytes + fp.min_budget_bytes + fp.total_bytes) / 2 / (1 << 30)
    assert main(["plan", str(moe), "--json", "--bandwidth-gbps", "1", "--memory-gib", str(2 + room)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["t_compute_ms"] > 0 and "forced to hit" in plan["t_compute_source"]
    assert not plan["fits_stock"]
    # Where the trunk and the smallest budget do not fit, nothing is timed and nothing predicted.
    assert main(["plan", str(moe), "--json", "--bandwidth-gbps", "1", "--memory-gib", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["t_compute_ms"] is None and all(b["tok_s"] == [0.0, 0.0] for b in plan["budgets"])


def test_plan_prints_what_auto_picks_and_why(tmp_path, capsys):
    """The budget auto would pick here: the limit minus each term, each printed; a limit too
    small for the smallest budget is a refusal that names the terms."""
    from expert_stream.plugin.cli import main
    from expert_stream.streaming.footprint import checkpoint_footprint

    gib = 1 << 30
    moe = make_moe(tmp_path)
    fp = checkpoint_footprint(moe)
    limit = 2 * gib + fp.trunk_bytes + fp.kv.bytes_for(1024) + fp.expert_bytes // 2  # MLX cache, headroom: 1 GiB each
    args = ["plan", str(moe), "--memory-gib", repr(limit / gib), "--context", "1024", "--bandwidth-gbps", "1",
            "--compute-ms", "5"]
    assert main([*args, "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert auto["budget_gib"] == round(fp.expert_bytes / 2 / gib, 4) and auto["limit_source"] == "--memory-gib"
    assert [(t["name"], t["gib"]) for t in auto["terms"]] == [
        ("trunk", round(fp.trunk_bytes / gib, 4)), ("KV cache", round(fp.kv.bytes_for(1024) / gib, 4)),
        ("MLX cache", 1.0), ("headroom", 1.0)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"auto:     budget_gib auto picks {auto['budget_gib']} GiB here:" in out
    for line in ("limit ", "- trunk", "- KV cache", "1024 tokens, measured from the model's caches", "- MLX cache",
                 "- headroom", "= free", "budget "):
        assert line in out, line
    assert main(["plan", str(moe), "--memory-gib", "1", "--bandwidth-gbps", "1", "--compute-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "auto:     refused:" in out and "below the smallest budget" in out and "(--memory-gib)" in out


def test_plan_refuses_a_dense_checkpoint(tmp_path, capsys):
    from expert_stream.plugin.cli import main
    from plugin_fixtures import make_dense

    assert main(["plan", str(make_dense(tmp_path)), "--bandwidth-gbps", "1"]) == 2
    assert "no routed-expert layers" in capsys.readouterr().err


@pytest.mark.server
def test_demo_end_to_end(tmp_path):
    needs_openai_server()
    sets = [a for k, v in ENGINE_SETTINGS.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    env = {"EXPERT_STREAM_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(expert_stream_argv("demo", "--max-tokens", "8", *sets), capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "answer:" in result.stdout and "cache: hit rate" in result.stdout and "server stopped" in result.stdout
    assert "; decode on the python path" in result.stdout
    assert (tmp_path / "cache" / "demo" / "config.json").exists()


def test_status_line_shows_a_model_whose_experts_all_fit_as_resident(tmp_path):
    import mlx_lm

    import expert_stream
    from expert_stream.plugin.cli.status_command import model_line
    from expert_stream.streaming.footprint import checkpoint_footprint

    moe = make_moe(tmp_path)
    every = checkpoint_footprint(moe).budget_gib_for_slots(8)
    lines = {}
    for name, budget, resident in (("slots", every, False), ("stock-layers", every, True), ("small", 0.00005, False)):
        model, tokenizer, handle = expert_stream.load(moe, budget_gib=budget, resident=resident)
        mlx_lm.generate(model, tokenizer, "hello there", max_tokens=4)
        lines[name] = model_line("m", {"state": "ready", "streamed": True, "settings": {"budget_gib": budget},
                                       "stats": handle.stats()})
        handle.close()
    assert "every expert resident (2 MoE layers, nothing read)" in lines["slots"]
    assert "every expert resident (2 MoE layers, nothing read)" in lines["stock-layers"]
    assert "hit rate" in lines["small"] and "resident" not in lines["small"]


def test_bare_status_finds_the_running_server_from_its_run_file(tmp_path, monkeypatch, capsys):
    """A server written by `serve` / `mlx-lm-server` (here: a plain HTTP server in this process
    standing in for one, answering the status endpoint) is found without --url."""
    import http.server
    import threading

    from expert_stream.plugin import run_files
    from expert_stream.plugin.cli import main

    class Status(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"config_path": "host.yaml", "host": "test", "host_version": "0", "reloads": 0,
                               "applied_hash": "ab" * 32, "models": {}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    monkeypatch.setenv("EXPERT_STREAM_CACHE", str(tmp_path / "cache"))
    assert main(["status"]) == 2
    assert "no server started through" in capsys.readouterr().err
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Status)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        run_files.write(run_files.local_url("0.0.0.0", httpd.server_address[1]), tmp_path / "host.yaml", "test")
        dead = run_files.servers_dir() / "999999999.json"  # a server that exited without cleaning up
        dead.write_text(json.dumps({"url": "http://127.0.0.1:1", "config": "x", "pid": 999999999}))
        assert main(["status"]) == 0
        assert "config:   host.yaml (test 0)" in capsys.readouterr().out
        assert main(["status", "--config", str(tmp_path / "other.yaml")]) == 2
        assert not dead.exists()
    finally:
        httpd.shutdown()


def test_help_answers_fast_without_importing_mlx_lm():
    """mlx_lm pulls transformers (and torch where installed): 10-20 s before anything prints."""
    import sys
    import time

    probe = ("import sys; import expert_stream.plugin.cli as cli; cli.build_parser(); "
             "print(sorted(m for m in ('mlx_lm', 'transformers', 'torch', 'mlx.core') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    t0 = time.perf_counter()
    result = subprocess.run(expert_stream_argv("--help"), capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - t0
    assert result.returncode == 0 and "plan" in result.stdout
    assert seconds < 3, f"expert-stream --help took {seconds:.1f} s"


def test_plan_prints_its_header_before_importing_mlx_lm(tmp_path):
    import time

    moe = make_moe(tmp_path)
    t0 = time.perf_counter()
    process = subprocess.Popen(expert_stream_argv("plan", str(moe), "--bandwidth-gbps", "1", "--compute-ms", "5"),
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        first = process.stdout.readline()
        seconds = time.perf_counter() - t0
        assert first.startswith(f"model:    {moe} (qwen3_moe"), first
        assert seconds < 3, f"the header took {seconds:.1f} s"
    finally:
        process.kill()  # the rest of the plan is tested in-process above
        process.wait()
        process.stdout.close()
