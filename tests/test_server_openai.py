"""mlx-openai-server through `expert-stream serve`: real host processes on 127.0.0.1.

One server for the module (children take 10-60 s each to start on 2 cores); the tests run in
file order and build on each other's state: answer, dense untouched, invalid edit, hot reload."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest

from plugin_fixtures import (
    ENGINE_SETTINGS, HostProcess, chat, chat_text, expert_stream_argv, free_port, http_json, make_dense,
    make_moe, stock_greedy, stream_chat, wait_for,
)

pytestmark = pytest.mark.server
pytest.importorskip("app.server", reason="mlx-openai-server is not installed")

PROMPT = "Tell me about solid state drives."
SETTINGS = ", ".join(f"{k}: {json.dumps(v)}" for k, v in ENGINE_SETTINGS.items())
TIMINGS: dict = {}


def config_text(models, port, entries, drain_timeout_s=300):
    """The models are written as `~/NAME`, as the README writes them: the server runs with
    HOME set to the checkpoints' folder (home_env)."""
    lines = [f"expert_stream: {{watch: true, poll_seconds: 0.3, debounce_seconds: 0.3, drain_timeout_s: {drain_timeout_s}}}",
             f"server: {{host: 127.0.0.1, port: {port}, log_level: WARNING}}", "models:"]
    for served, key, budget in entries:
        lines.append(f"  - model_path: ~/{models[key].name}")
        lines.append(f"    served_model_name: {served}")
        if budget is not None:
            lines.append(f"    expert_stream: {{budget_gib: {budget:.6f}, {SETTINGS}}}")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai-checkpoints")
    return {"moe": make_moe(root), "dense": make_dense(root)}


def home_env(models) -> dict:
    """HOME for `~/NAME`; the run file (for a bare `expert-stream status`) goes under it too."""
    return {"HOME": str(models["moe"].parent), "EXPERT_STREAM_CACHE": str(models["moe"].parent / "cache")}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    work = tmp_path_factory.mktemp("openai-server")
    port = free_port()
    path = work / "host.yaml"
    # 0.00005 GiB = 53 KB: 3 of 8 expert slots per layer, so experts are evicted all the time.
    path.write_text(config_text(models, port, [("moe", "moe", 0.00005), ("dense", "dense", None)]))
    host = HostProcess(expert_stream_argv("serve", "--config", str(path), "--no-log-file"),
                       f"http://127.0.0.1:{port}", work / "server.log", work, env=home_env(models))
    try:
        TIMINGS["start_s"] = host.wait_ready()
        yield host, path, port
    finally:
        host.stop()
        print("mlx-openai-server timings:", TIMINGS)


def test_streamed_model_answers_like_stock(server, models):
    host, _, _ = server
    expected = stock_greedy(models["moe"], PROMPT, 24)
    assert chat_text(host.base, "moe", PROMPT, 24) == expected
    text, chunks, errors, done = stream_chat(host.base, "moe", PROMPT, 24)
    assert (text, errors, done) == (expected, [], True) and chunks > 1
    status = http_json(host.base + "/expert-stream/status")[1]
    moe = status["models"]["moe"]
    assert moe["state"] == "ready" and moe["streamed"]
    assert moe["stats"]["totals"]["misses"] > 0 and moe["stats"]["totals"]["evictions"] > 0


def test_dense_model_is_untouched(server, models):
    host, _, _ = server
    assert chat_text(host.base, "dense", PROMPT, 16) == stock_greedy(models["dense"], PROMPT, 16)
    dense = http_json(host.base + "/expert-stream/status")[1]["models"]["dense"]
    assert dense["streamed"] is False and dense["stats"] is None


def test_status_command(server, models, capsys, monkeypatch):
    from expert_stream.plugin.cli import main

    host, _, _ = server
    assert main(["status", "--url", host.base]) == 0
    out = capsys.readouterr().out
    assert "moe: ready, streamed" in out and "dense: ready, stock" in out
    # Bare: the server's address comes from the run file it wrote (its port is not 8000).
    monkeypatch.setenv("EXPERT_STREAM_CACHE", home_env(models)["EXPERT_STREAM_CACHE"])
    assert main(["status"]) == 0
    assert "moe: ready, streamed" in capsys.readouterr().out


def test_invalid_edit_keeps_serving_and_shows_the_error(server, models):
    host, path, port = server
    good = path.read_text()
    before = http_json(host.base + "/expert-stream/status")[1]
    path.write_text(good.replace("budget_gib: 0.000050", "budget_gib: 0.000050, budjet: 2"))
    status = wait_for(lambda: (s := http_json(host.base + "/expert-stream/status")[1])["last_error"] and s,
                      timeout=60, what="the watcher to report the invalid edit")
    assert "models[0] (moe).expert_stream: unknown setting(s) budjet" in status["last_error"]
    assert status["applied_hash"] == before["applied_hash"]
    assert chat_text(host.base, "moe", PROMPT, 8)  # still serving the old config
    code, body = http_json(host.base + "/expert-stream/reload", method="POST")
    assert code == 422 and "budjet" in body["error"]
    path.write_text(good)
    wait_for(lambda: http_json(host.base + "/expert-stream/status")[1]["last_error"] is None, timeout=60,
             what="the error to clear once the file is valid again")


def test_hot_reload_while_a_streaming_request_is_in_flight(server, models):
    host, path, port = server
    long_tokens = 600
    expected = stock_greedy(models["moe"], PROMPT, long_tokens)
    started = threading.Event()
    result = {}

    def stream():
        result["out"] = stream_chat(host.base, "moe", PROMPT, long_tokens, on_first=started.set)

    client = threading.Thread(target=stream)
    client.start()
    assert started.wait(120), "the streaming request never started"
    # Change moe's budget, remove dense, add a second streamed entry.
    path.write_text(config_text(models, port, [("moe", "moe", 0.0001), ("moe-b", "moe", 0.00005)]))
    t0 = time.perf_counter()
    code, body = http_json(host.base + "/expert-stream/reload", method="POST", timeout=900)
    TIMINGS["reload_s"] = round(time.perf_counter() - t0, 1)
    assert code == 200, body
    assert body["last_reload"]["removed"] == ["dense"]
    assert body["last_reload"]["changed"] == ["moe"] and body["last_reload"]["added"] == ["moe-b"]
    assert body["last_reload"]["cut_off"] == 0
    client.join(600)
    text, chunks, errors, done = result["out"]
    assert errors == [] and done and text == expected  # finished on the old model, intact

    ids = {m["id"] for m in http_json(host.base + "/v1/models")[1]["data"]}
    assert ids == {"moe", "moe-b"}
    status = http_json(host.base + "/expert-stream/status")[1]
    assert status["models"]["moe"]["settings"]["budget_gib"] == 0.0001
    assert status["reloads"] >= 1
    short = stock_greedy(models["moe"], PROMPT, 12)
    assert chat_text(host.base, "moe", PROMPT, 12) == short
    assert chat_text(host.base, "moe-b", PROMPT, 12) == short
    assert chat(host.base, "dense", PROMPT, 4)[0] == 404


def test_request_cut_off_after_the_drain_timeout_gets_an_error(server, models):
    """A change that cannot wait: the in-flight request ends with an error chunk, not a hang."""
    host, path, port = server
    # First a 1 s drain timeout on its own (the timeout in force is the applied config's).
    path.write_text(config_text(models, port, [("moe", "moe", 0.00005)], drain_timeout_s=1))
    assert http_json(host.base + "/expert-stream/reload", method="POST", timeout=900)[0] == 200
    started = threading.Event()
    result = {}

    def stream():
        result["out"] = stream_chat(host.base, "moe", PROMPT, 30000, on_first=started.set)

    client = threading.Thread(target=stream)
    client.start()
    assert started.wait(120), "the streaming request never started"
    path.write_text(config_text(models, port, [("moe", "moe", 0.00007)], drain_timeout_s=1))
    code, body = http_json(host.base + "/expert-stream/reload", method="POST", timeout=900)
    assert code == 200, body
    client.join(120)
    assert not client.is_alive(), "the cut-off request hangs"
    text, chunks, errors, done = result["out"]
    assert body["last_reload"]["changed"] == ["moe"] and body["last_reload"]["cut_off"] == 1
    assert errors and chunks < 30000, (errors, chunks)
    assert "unloaded by a config reload" in json.dumps(errors)
    assert chat_text(host.base, "moe", PROMPT, 12) == stock_greedy(models["moe"], PROMPT, 12)


def test_bare_host_refuses_the_file(models, tmp_path):
    port = free_port()
    path = tmp_path / "host.yaml"
    # The host's own name for the served id (1.6: model_id, 1.7+: served_model_name), so the only
    # key it does not know is ours.
    from expert_stream.plugin.hosts.openai_server import MLX_OPENAI_SERVER

    id_key = MLX_OPENAI_SERVER.internals().id_key
    path.write_text(config_text(models, port, [("moe", "moe", 0.00005)]).replace("served_model_name", id_key))
    bare = [sys.executable, "-c", "from app.main import main; main()"]
    host = HostProcess([*bare, "launch", "--config", str(path), "--no-log-file"],
                       f"http://127.0.0.1:{port}", tmp_path / "bare.log", tmp_path, env=home_env(models))
    try:
        assert host.wait_exit(300) != 0
        assert "unexpected keyword argument 'expert_stream'" in host.log()
    finally:
        host.stop()


def test_serve_refuses_an_invalid_file_before_starting(tmp_path, capsys):
    from expert_stream.plugin.cli import main

    path = tmp_path / "host.yaml"
    path.write_text("models: [{model_path: /nowhere, expert_stream: {budget_gib: 1}}]\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "models[0] (/nowhere): model_path /nowhere is not a folder" in capsys.readouterr().err
