"""What the plugin adds to mlx_lm.server's HTTP handler: GET /expert-stream/status, POST
/expert-stream/reload, GET /expert-stream/metrics and the status page GET /expert-stream/
(loopback programs only, see endpoint_guard; the metrics also the addresses of metrics_allow),
and a /v1/models that lists the configured served names (the host's lists the Hugging Face cache)."""

from __future__ import annotations

import json
import logging

from expert_stream.plugin.endpoint_guard import refusal
from expert_stream.plugin.hosts import operator_view
from expert_stream.plugin.hosts.mlx_lm import compat
from expert_stream.plugin.redact import redact, redact_errors
from expert_stream.streaming.errors import ExpertStreamError

log = logging.getLogger("expert_stream")

STATUS_PATH = "/expert-stream/status"
RELOAD_PATH = "/expert-stream/reload"
MODELS_PATH = "/v1/models"


def send(handler, status: int, body: bytes, headers: dict) -> None:
    handler.send_response(status)
    for name, value in headers.items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
    handler.wfile.flush()


def patch_handler(state) -> None:
    """Answer the control routes and /v1/models in mlx_lm.server's APIHandler (compat wraps its
    methods); everything else goes to the host's own methods."""

    def reply(handler, status: int, payload: dict) -> None:
        send(handler, status, json.dumps(payload).encode(), {"Content-type": "application/json"})

    def refused(handler, path) -> bool:
        # client_address is the socket's peer; see endpoint_guard for the rest.
        headers = {k.lower(): v for k, v in handler.headers.items()}
        allowed = state.config.options.metrics_allow if path == operator_view.METRICS_PATH else ()
        why = refusal(handler.client_address[0], headers, state.bind_host, allowed)
        if why:
            reply(handler, 403, {"error": f"{path} {why}"})
        return bool(why)

    def on_get(handler) -> bool:
        route = handler.path.split("?")[0]
        if route == MODELS_PATH or route.startswith(MODELS_PATH + "/"):
            # The host lists models of the Hugging Face cache; what it serves is the config.
            reply(handler, 200, state.models_list(route[len(MODELS_PATH) + 1:] or None))
        elif route == STATUS_PATH:
            if not refused(handler, STATUS_PATH):
                reply(handler, 200, redact_errors(state.status()))
        elif route == operator_view.METRICS_PATH:
            if not refused(handler, route):
                send(handler, 200, *operator_view.metrics(state.status()))
        elif route in operator_view.PAGE_PATHS:
            if not refused(handler, route):
                send(handler, 200, *operator_view.page())
        else:
            return False
        return True

    def on_post(handler) -> bool:
        if handler.path.split("?")[0] != RELOAD_PATH:
            return False
        if refused(handler, RELOAD_PATH):
            return True
        if not state.config.options.reload_endpoint:
            reply(handler, 403, {"error": "the reload endpoint is off (expert_stream.reload_endpoint: false)"})
        else:
            result = state.reload("endpoint")
            reply(handler, 200 if result["ok"] else 422, redact_errors(result))
        return True

    def on_options(handler) -> bool:  # no CORS preflight answer for the control endpoints
        if handler.path.split("?")[0] not in (STATUS_PATH, RELOAD_PATH, operator_view.METRICS_PATH,
                                              *operator_view.PAGE_PATHS):
            return False
        reply(handler, 403, {"error": "the control endpoints do not answer web pages"})
        return True

    compat.patch_handler(state.internals.APIHandler, on_get, on_post, on_options, answer_error)


def answer_error(handler, exc: Exception, started: bool, stream: bool, body) -> None:
    """An error that escaped mlx_lm.server's request handling reaches the client naming the
    model and why (a status and a JSON body, or an error event in a stream that has begun),
    instead of a connection closed without a word; a client that went away gets nothing."""
    if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
        return
    model = body.get("model") if isinstance(body, dict) else None
    name = model if isinstance(model, str) else "default_model"
    message = str(exc) or type(exc).__name__
    if repr(name) not in message:
        message = f"model {name!r}: {message}"
    log.error("expert-stream: request failed: %s", message)
    message = redact(message)
    try:
        if not started:
            code = 400 if _bad_body(exc) and not isinstance(exc, ExpertStreamError) else 500
            send(handler, code, json.dumps({"error": message}).encode(), {"Content-type": "application/json"})
        elif stream:
            event = json.dumps({"error": {"message": message, "type": "server_error"}})
            handler.wfile.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
            handler.wfile.flush()
    except OSError:
        pass  # the client went away meanwhile


def _bad_body(exc: Exception) -> bool:
    """The host's checks of a request body raise these before anything is generated."""
    return isinstance(exc, (ValueError, AssertionError, TypeError, KeyError, UnicodeDecodeError))
