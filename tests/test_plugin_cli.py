"""The `plan` and `demo` commands, as a user runs them."""

from __future__ import annotations

import json
import subprocess

import pytest

from plugin_fixtures import ENGINE_SETTINGS, expert_stream_argv, make_moe


def test_plan_reports_sizes_and_budgets(tmp_path, capsys):
    from expert_stream.plugin.cli import main

    moe = make_moe(tmp_path)
    assert main(["plan", str(moe), "--json", "--memory-gib", "16", "--context", "4096"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["moe_layers"] == 2 and plan["experts_per_layer"] == 8 and plan["top_k"] == 2
    assert plan["trunk_gib"] + plan["expert_gib"] == pytest.approx(plan["total_gib"], abs=0.002)
    assert plan["disk_gbps"] > 0 and plan["budgets"][0]["slots_per_layer"] == 2
    assert plan["budgets"][-1]["io_bound_tok_s"] == "no reads (all resident)"
    assert main(["plan", str(moe), "--bandwidth-gbps", "2"]) == 0
    assert "smallest" in capsys.readouterr().out


def test_plan_refuses_a_dense_checkpoint(tmp_path, capsys):
    from expert_stream.plugin.cli import main
    from plugin_fixtures import make_dense

    assert main(["plan", str(make_dense(tmp_path)), "--bandwidth-gbps", "1"]) == 2
    assert "no routed-expert layers" in capsys.readouterr().err


@pytest.mark.server
def test_demo_end_to_end(tmp_path):
    pytest.importorskip("app.server", reason="mlx-openai-server is not installed")
    sets = [a for k, v in ENGINE_SETTINGS.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    env = {"EXPERT_STREAM_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(expert_stream_argv("demo", "--max-tokens", "8", *sets), capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "answer:" in result.stdout and "cache: hit rate" in result.stdout and "server stopped" in result.stdout
    assert (tmp_path / "cache" / "demo" / "config.json").exists()


def test_status_line_shows_a_model_whose_experts_all_fit_as_resident(tmp_path):
    import mlx_lm

    import expert_stream
    from expert_stream.plugin.cli.server_commands import model_line
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
