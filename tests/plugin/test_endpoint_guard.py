"""Issue 14 items 7 and 9: the control endpoints answer programs on this machine only, never a
web page, and errors sent to clients carry no absolute paths or offsets. A real uvicorn server
on 127.0.0.1 with the host's own middleware (CORS allowing every origin, proxy headers trusted
from loopback, as uvicorn does by default), the guard installed as the plugin installs it."""

from __future__ import annotations

import threading
import time
from contextlib import asynccontextmanager

import pytest

from expert_stream.plugin.endpoint_guard import ControlGuard, host_name, loopback_address, refusal
from expert_stream.plugin.redact import redact, redact_errors
from plugin_fixtures import free_port, http_status as get, non_loopback_address

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def server():
    from fastapi.middleware.cors import CORSMiddleware
    from fastapi.responses import JSONResponse

    other = non_loopback_address()
    paths = ["/expert-stream/status", "/expert-stream/metrics"]

    def allowed(path):  # as the hosts do: metrics_allow opens the metrics only
        return (f"{other}/32",) if other and path == "/expert-stream/metrics" else ()

    @asynccontextmanager
    async def lifespan(app):
        for path in paths:
            app.add_route(path, lambda request: JSONResponse({"ok": True}), methods=["GET"])
        app.middleware_stack = ControlGuard(app.middleware_stack, paths, "0.0.0.0", allowed)
        yield

    app = fastapi.FastAPI(lifespan=lifespan)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"],
                       allow_headers=["*"])
    app.add_api_route("/v1/models", lambda: {"data": []})
    port = free_port()
    config = uvicorn.Config(app, host="0.0.0.0", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(10)


def test_control_endpoints_answer_local_programs_only(server):
    base = f"http://127.0.0.1:{server}/expert-stream/status"
    assert get(base)[0] == 200
    assert get(f"http://localhost:{server}/expert-stream/status")[0] == 200
    # uvicorn trusts proxy headers from loopback peers: the client would become "localhost".
    assert get(base, {"X-Forwarded-For": "localhost"})[0] == 403
    assert get(base, {"X-Forwarded-For": "127.0.0.1"})[0] == 403
    assert get(base, {"Forwarded": "for=127.0.0.1"})[0] == 403
    # DNS rebinding: the page's own name reaches 127.0.0.1.
    assert get(base, {"Host": f"evil.example:{server}"})[0] == 403
    # A web page: refused, and nothing lets it read the answer.
    status, headers = get(base, {"Origin": "http://evil.example"})
    assert status == 403 and not any(h.startswith("access-control-") for h in headers)
    status, headers = get(base, {"Origin": "http://evil.example", "Access-Control-Request-Method": "GET"},
                          method="OPTIONS")
    assert status == 403 and not any(h.startswith("access-control-") for h in headers)
    # Other routes keep the host's behaviour, CORS included.
    status, headers = get(f"http://127.0.0.1:{server}/v1/models", {"Origin": "http://evil.example"})
    assert status == 200 and headers.get("access-control-allow-origin")
    other = non_loopback_address()
    if other:  # a peer that is not loopback, even when it says it is
        assert get(f"http://{other}:{server}/expert-stream/status", {"Host": "localhost"})[0] == 403


def test_metrics_allow_opens_the_metrics_only(server):
    other = non_loopback_address()
    if other is None:
        pytest.skip("this machine has no address but loopback: no other peer to allow")
    assert get(f"http://{other}:{server}/expert-stream/metrics")[0] == 200
    assert get(f"http://{other}:{server}/expert-stream/status")[0] == 403
    assert get(f"http://{other}:{server}/expert-stream/metrics", {"Host": f"evil.example:{server}"})[0] == 403
    status, headers = get(f"http://{other}:{server}/expert-stream/metrics", {"Origin": f"http://{other}:{server}"})
    assert status == 403 and not any(h.startswith("access-control-") for h in headers)


def test_refusal_rules():
    local = {"host": "127.0.0.1:8000"}
    assert refusal("127.0.0.1", local, None) is None
    assert refusal("::1", {"host": "[::1]:8000"}, None) is None
    assert refusal("::ffff:127.0.0.1", local, None) is None
    assert refusal("localhost", local, None)  # a peer is an address, never a name
    assert refusal("10.1.2.3", local, None)
    assert refusal("127.0.0.1", {"host": "myhost:8000"}, "myhost") is None  # the bind address
    assert refusal("127.0.0.1", {"host": "myhost:8000"}, "0.0.0.0")
    assert refusal("127.0.0.1", {}, None)  # no Host header at all
    assert host_name("[::1]:80") == "::1" and host_name("LocalHost:1") == "localhost"
    assert loopback_address("127.8.9.10") and not loopback_address("128.0.0.1")


def test_errors_for_clients_carry_no_paths_or_offsets():
    message = ("/home/ann/cfg/host.yaml: models[0] (/home/ann/models/qwen).expert_stream: read of 4096 bytes "
               "at offset 123456 of /home/ann/models/qwen/model-00001.safetensors failed; see /expert-stream/status")
    out = redact(message)
    assert "/home" not in out and "123456" not in out
    assert out.startswith("host.yaml: models[0] (qwen)") and "model-00001.safetensors" in out
    assert "/expert-stream/status" in out
    status = {"config_path": "/home/ann/cfg/host.yaml", "last_error": message,
              "models": {"qwen": {"error": message, "model_path": "/home/ann/models/qwen"}}}
    clean = redact_errors(status)
    assert "/home" not in clean["last_error"] and "/home" not in clean["models"]["qwen"]["error"]
    assert clean["models"]["qwen"]["model_path"] == "/home/ann/models/qwen"  # not an error: kept


def test_host_calls_that_fail_reach_clients_redacted():
    """mlx_lm.server turns an exception of ResponseGenerator.generate into {"error": str(e)}:
    wrapped, the same type comes out with its paths and offsets gone."""
    from expert_stream.plugin.redact import redacting_calls
    from expert_stream.streaming.errors import ReadError

    def generate(_request):
        raise ReadError("short read: 4096 bytes at offset 123456 of /home/me/models/x/model-00001.safetensors")

    with pytest.raises(ReadError) as caught:
        redacting_calls(generate)("request")
    assert "/home/me" not in str(caught.value) and "123456" not in str(caught.value)
    assert "model-00001.safetensors" in str(caught.value)
    with pytest.raises(KeyError):  # nothing to redact: the exception passes untouched
        redacting_calls(lambda: {}["missing"])()
