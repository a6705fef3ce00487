"""mlx_lm.server through `expert-stream mlx-lm-server`: a streamed model answers, then reloads."""

from __future__ import annotations

import json

import pytest

from plugin_fixtures import (
    ENGINE_SETTINGS, HostProcess, chat, chat_text, control_endpoint_refusals, expert_stream_argv, free_port,
    http_json, make_moe, stock_greedy, wait_for,
)

pytestmark = pytest.mark.server

PROMPT = "Tell me about solid state drives."
SETTINGS = ", ".join(f"{k}: {json.dumps(v)}" for k, v in ENGINE_SETTINGS.items())


def models_yaml(moe, entries):
    """The checkpoint is written `~/moe`, as the README writes paths (the server's HOME is its folder)."""
    lines = ["expert_stream: {watch: true, poll_seconds: 0.3, debounce_seconds: 0.3}", "models:"]
    for served, budget in entries:
        lines += [f"  - model_path: ~/{moe.name}", f"    served_model_name: {served}",
                  f"    expert_stream: {{budget_gib: {budget:.6f}, {SETTINGS}}}"]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("mlx-lm-server")
    moe = make_moe(work)
    port = free_port()
    path = work / "models.yaml"
    path.write_text(models_yaml(moe, [("moe", 0.00005)]))
    host = HostProcess(expert_stream_argv("mlx-lm-server", "--config", str(path), "--", "--host", "127.0.0.1",
                                          "--port", str(port)),
                       f"http://127.0.0.1:{port}", work / "server.log", work,
                       # no Hugging Face cache: the host's own /v1/models would list nothing
                       env={"HOME": str(moe.parent), "HF_HOME": str(work / "no-hf-cache")})
    try:
        host.wait_ready("/health")
        yield host, path, moe, port
    finally:
        host.stop()


def slots(status, model="moe"):
    return status["models"][model]["stats"]["layers"]["model.layers.0.mlp.switch_mlp"]["slots"]


def test_streamed_model_answers_like_stock(server):
    host, _, moe, _ = server
    assert chat_text(host.base, "moe", PROMPT, 16) == stock_greedy(moe, PROMPT, 16)
    status = http_json(host.base + "/expert-stream/status")[1]
    assert status["models"]["moe"]["state"] == "loaded" and slots(status) == 3
    assert status["models"]["moe"]["stats"]["totals"]["misses"] > 0
    code, listed = http_json(host.base + "/v1/models")
    assert code == 200 and [m["id"] for m in listed["data"]] == ["moe"]


def test_budget_change_reloads_at_the_next_request(server):
    host, path, moe, _ = server
    path.write_text(models_yaml(moe, [("moe", 0.0001)]))
    status = wait_for(lambda: (s := http_json(host.base + "/expert-stream/status")[1])["reloads"] >= 1 and s,
                      timeout=60, what="the watcher to apply the edit")
    assert status["last_reload"]["changed"] == ["moe"]
    assert status["models"]["moe"]["state"] == "pending reload"
    assert chat_text(host.base, "moe", PROMPT, 16) == stock_greedy(moe, PROMPT, 16)
    status = http_json(host.base + "/expert-stream/status")[1]
    assert status["models"]["moe"]["state"] == "loaded" and slots(status) == 6


def test_alias_added_then_removed(server):
    host, path, moe, _ = server
    path.write_text(models_yaml(moe, [("moe", 0.0001), ("other", 0.00005)]).replace(
        f"  - model_path: ~/{moe.name}\n    served_model_name: other", f"  - model_path: {moe}/.\n    served_model_name: other"))
    code, body = http_json(host.base + "/expert-stream/reload", method="POST")
    # one folder, two entries: mlx_lm.server keys models by folder, so the file is refused
    assert code == 422 and "streams the same folder" in body["error"]
    path.write_text(models_yaml(moe, [("renamed", 0.0001)]))
    code, body = http_json(host.base + "/expert-stream/reload", method="POST")
    assert code == 200 and body["last_reload"]["removed"] == ["moe"] and body["last_reload"]["added"] == ["renamed"]
    assert chat_text(host.base, "renamed", PROMPT, 8) == stock_greedy(moe, PROMPT, 8)
    assert chat(host.base, "moe", PROMPT, 4)[0] != 200
    assert [m["id"] for m in http_json(host.base + "/v1/models")[1]["data"]] == ["renamed"]

def test_control_endpoints_trust_the_socket_peer_only(server):
    host, _, _, port = server
    control_endpoint_refusals(host.base, port)



def test_sigint_stops_the_server_within_seconds_and_cuts_the_request_in_flight(server):
    """Last in the file: it stops the module's server."""
    import os
    import signal
    import threading
    import time

    from plugin_fixtures import stream_chat

    host, _, _, _ = server
    started, result = threading.Event(), {}

    def stream():
        try:
            result["out"] = stream_chat(host.base, "renamed", PROMPT, 30000, on_first=started.set)
        except Exception as exc:  # the connection cut mid-stream
            result["error"] = exc

    client = threading.Thread(target=stream)
    client.start()
    assert started.wait(120), "the streaming request never started"
    t0 = time.perf_counter()
    os.kill(host.process.pid, signal.SIGINT)
    host.wait_exit(timeout=30)
    stopped = time.perf_counter() - t0
    client.join(30)
    assert not client.is_alive(), "the request in flight hangs"
    assert stopped < 10, f"SIGINT took {stopped:.1f} s"
    assert "error" in result or not result["out"][3], result  # no [DONE]: cut, not finished
