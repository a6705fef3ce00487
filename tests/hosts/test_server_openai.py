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
    ENGINE_SETTINGS, HostProcess, assert_metrics_are_status_counters, assert_monotonic, chat, chat_text, control_endpoint_refusals, counters_of,
    expert_stream_argv, free_port, http_json, make_dense, make_moe, needs_openai_server, scrape, stock_greedy,
    scrapes_around_a_request, stream_chat, wait_for,
)

pytestmark = pytest.mark.server
needs_openai_server()

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


def test_metrics_while_a_request_runs(server):
    """Issue 27: a scrape parsed by prometheus_client's parser while a request streams. The model
    process answers the parent's RPC only between requests; its counters reach the parent through
    shared memory, so they grow while it generates."""
    host, _, _ = server
    first, after = scrapes_around_a_request(host.base, "moe", PROMPT, settle_s=1.0)  # counters: every 0.5 s
    assert first[("expert_stream_model_state", (("model", "dense"), ("state", "ready")))] == 1
    status = http_json(host.base + "/expert-stream/status")[1]
    moe_status = status["models"]["moe"]
    assert_metrics_are_status_counters(after, moe_status["counters"], "moe")
    # One process served the model since start: its counters are the handle's own.
    assert moe_status["counters"]["hits"] == moe_status["stats"]["totals"]["hits"]
    assert moe_status["counters"]["decode_tokens"] == moe_status["stats"]["decode"]["tokens"]
    assert moe_status["memory"]["rss_bytes"] > 0 and after[("expert_stream_restarts_total", (("model", "moe"),))] == 0
    # The terminal's view of the same document.
    from expert_stream.plugin.cli.status_command import frame

    rows = frame(status, host.base, 2, time.time()).splitlines()
    moe_row = next(line for line in rows if line.startswith("moe "))
    assert moe_row.split()[1:4] == ["ready", "53.7", "KB"] and "%" in moe_row  # budget_gib 0.00005
    assert next(line for line in rows if line.startswith("dense ")).split()[1:3] == ["ready", "stock"]


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
    assert scrape(host.base)[("expert_stream_reloads_total", (("outcome", "refused"),))] == 1
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
    before = counters_of(scrape(host.base), "moe")
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
    # Issue 27: moe's counters go on from the old process's (it finished its request after the
    # switch), the new one's added; nothing fell.
    time.sleep(1.0)  # the process writes its counters every half second
    after = scrape(host.base)
    assert_monotonic(before, counters_of(after, "moe"))
    hits = ("expert_stream_expert_hits_total", (("model", "moe"),))
    new_process = http_json(host.base + "/expert-stream/status")[1]["models"]["moe"]["stats"]["totals"]["hits"]
    assert after[hits] > new_process > 0
    assert after[("expert_stream_reloads_total", (("outcome", "applied"),))] >= 1


@pytest.mark.slow
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
    from expert_stream.plugin.hosts.openai.server import MLX_OPENAI_SERVER

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


# -- issue 14: serving never stops silently, local security (same server, later state) --------

def test_control_endpoints_trust_the_socket_peer_only(server):
    host, _, port = server
    control_endpoint_refusals(host.base, port)


def _status(host):
    return http_json(host.base + "/expert-stream/status")[1]


def _requests_during_reload(host, path, text, count=30, clients=5):
    """Send `count` short chat requests from `clients` threads while a reload applies `text`."""
    codes, lock = [], threading.Lock()

    def client(n):
        for _ in range(n):
            code = chat(host.base, "moe", PROMPT, 2)[0]
            with lock:
                codes.append(code)

    threads = [threading.Thread(target=client, args=(count // clients,)) for _ in range(clients)]
    path.write_text(text)
    reload = threading.Thread(target=lambda: http_json(host.base + "/expert-stream/reload", method="POST", timeout=900))
    reload.start()
    time.sleep(0.5)  # the reload has started
    for t in threads:
        t.start()
    for t in threads + [reload]:
        t.join(900)
    return {c: codes.count(c) for c in set(codes)}


@pytest.mark.slow
def test_failed_reloads_are_reported_and_requests_during_a_reload_wait(server, models):
    """Issue: `budget_gib: 1e+300` killed the watch task silently (later edits never applied,
    POST reload 500), and 41 of 150 requests sent during one reload got 503."""
    host, path, port = server
    # The drain timeout in force is the applied config's: back to 300 s (no model changes).
    path.write_text(config_text(models, port, [("moe", "moe", _status(host)["models"]["moe"]["settings"]["budget_gib"])]))
    code, body = http_json(host.base + "/expert-stream/reload", method="POST", timeout=300)
    assert code == 200 and not body.get("applied"), body
    path.write_text(config_text(models, port, [("moe", "moe", None)]).replace(
        "served_model_name: moe\n", "served_model_name: moe\n    expert_stream: {budget_gib: 1e+300}\n"))
    status = wait_for(lambda: (s := _status(host))["last_error"] and s, timeout=60, what="the error in status")
    assert "models[0] (moe).expert_stream: budget_gib must be between 0 and" in status["last_error"]
    assert str(path.parent) not in status["last_error"] and "host.yaml" in status["last_error"]  # no absolute path
    assert http_json(host.base + "/expert-stream/reload", method="POST")[0] == 422
    # The next edit is applied (the watcher and the endpoint race for it; one applies it). Room
    # for both: the new model loads beside the old one, which serves until the switch.
    codes = _requests_during_reload(host, path, config_text(models, port, [("moe", "moe", 0.00005)]))
    TIMINGS["codes_make_before_break"] = codes
    assert codes == {200: 30}, codes
    status = _status(host)
    assert status["models"]["moe"]["settings"]["budget_gib"] == 0.00005 and status["last_error"] is None
    # No room for both (memory_gib): the old one unloads first, requests wait for the new one.
    text = config_text(models, port, [("moe", "moe", 0.00006)]).replace(
        "drain_timeout_s: 300}", "drain_timeout_s: 300, memory_gib: 3.0}")  # one model (2 GiB of MLX cache and headroom), not two
    codes = _requests_during_reload(host, path, text)
    TIMINGS["codes_unload_first"] = codes
    assert codes == {200: 30}, codes
    status = _status(host)
    assert status["models"]["moe"]["settings"]["budget_gib"] == 0.00006 and status["last_error"] is None
    assert chat_text(host.base, "moe", PROMPT, 12) == stock_greedy(models["moe"], PROMPT, 12)


def test_a_killed_model_process_is_detected_and_restarted(server, models):
    import psutil

    host, path, port = server

    def model_processes():
        return [p for p in psutil.Process(host.process.pid).children(recursive=True)
                if "spawn_main" in " ".join(p.cmdline())]

    # The moe model alone (earlier tests may have left other entries), then its one process.
    budget = _status(host)["models"]["moe"]["settings"]["budget_gib"]
    path.write_text(config_text(models, port, [("moe", "moe", budget)]))
    assert http_json(host.base + "/expert-stream/reload", method="POST", timeout=900)[0] == 200
    children = wait_for(lambda: (c := model_processes()) and len(c) == 1 and c, timeout=120,
                        what="one model process")
    before = counters_of(scrape(host.base), "moe")
    started = threading.Event()
    result = {}

    def stream():
        t0 = time.perf_counter()
        result["out"] = stream_chat(host.base, "moe", PROMPT, 30000, on_first=started.set)
        result["seconds"] = time.perf_counter() - t0

    client = threading.Thread(target=stream)
    client.start()
    assert started.wait(120)
    children[0].kill()  # SIGKILL, mid-stream
    t0 = time.perf_counter()
    client.join(60)
    assert not client.is_alive(), "the in-flight request hangs on a dead process"
    TIMINGS["in_flight_error_after_kill_s"] = round(time.perf_counter() - t0, 1)
    text, chunks, errors, done = result["out"]
    assert errors and "model process exited" in json.dumps(errors), errors
    t0 = time.perf_counter()
    code, body = chat(host.base, "moe", PROMPT, 4)
    TIMINGS["new_request_after_kill_s"] = round(time.perf_counter() - t0, 1)
    assert code == 503 and "model process exited" in json.dumps(body) and time.perf_counter() - t0 < 10
    assert "/" not in body["detail"]["error"]["message"].split("model process exited")[0]
    assert _status(host)["models"]["moe"]["state"] != "ready"
    status = wait_for(lambda: (s := _status(host))["models"]["moe"]["state"] == "ready" and s, timeout=300,
                      what="the model to be restarted")
    assert status["models"]["moe"]["restarts"] == 1
    assert chat_text(host.base, "moe", PROMPT, 12) == stock_greedy(models["moe"], PROMPT, 12)
    # Issue 27: the killed process's counters stay in the served name's (monotonic), and the
    # restart is counted.
    time.sleep(1.0)
    after = scrape(host.base)
    assert_monotonic(before, counters_of(after, "moe"))
    assert after[("expert_stream_restarts_total", (("model", "moe"),))] == 1


def test_an_error_while_generating_names_the_model(server, models):
    """A shard truncated under the loaded streamed model: the request fails naming the model (the
    host's own text is "Failed to generate text response: ..."; the soak found it naming none),
    and once the shard is back, the same prompts answer like stock (the soak found the host's
    prompt cache continuing from the failed generation's KV cache: wrong answers)."""
    import os

    host, path, port = server
    path.write_text(config_text(models, port, [("moe", "moe", 0.00005)]))
    assert http_json(host.base + "/expert-stream/reload", method="POST", timeout=900)[0] == 200
    assert chat_text(host.base, "moe", PROMPT, 12) == stock_greedy(models["moe"], PROMPT, 12)
    shard = next(models["moe"].glob("*.safetensors"))
    original, stat = shard.read_bytes(), shard.stat()
    try:
        with open(shard, "r+b") as f:
            f.truncate(len(original) // 2)
        code, body = chat(host.base, "moe", "another prompt, other experts", 40)
        assert code == 500 and "model 'moe': " in json.dumps(body) and "model.safetensors" in json.dumps(body), body
        text, _, errors, _ = stream_chat(host.base, "moe", "yet another prompt", 40)
        assert errors and "model 'moe': " in json.dumps(errors), (text, errors)
    finally:
        with open(shard, "r+b") as f:
            f.write(original)
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    # The shard is back as it was loaded (a short read does not stop the model): the prompts whose
    # generations failed answer like stock, not from the half-updated KV cache the host kept.
    for prompt in ("another prompt, other experts", "yet another prompt"):
        for _ in range(2):
            code, body = chat(host.base, "moe", prompt, 40)
            if code == 200:
                assert body["choices"][0]["message"]["content"] == stock_greedy(models["moe"], prompt, 40), prompt
    path.write_text(config_text(models, port, [("moe", "moe", 0.00006)]))  # a changed entry loads afresh
    assert http_json(host.base + "/expert-stream/reload", method="POST", timeout=900)[0] == 200
    assert chat_text(host.base, "moe", PROMPT, 12) == stock_greedy(models["moe"], PROMPT, 12)



