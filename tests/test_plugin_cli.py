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
