"""What the plugin adds to mlx-openai-server's app: a lifespan that starts the models through
the Reloader (so the first load and every hot reload take one path), the supervisor, the file
watcher, SIGHUP and the counters' sampler, and the control routes GET /expert-stream/status, POST
/expert-stream/reload, GET /expert-stream/metrics and the status page GET /expert-stream/ (all
answer loopback clients only, ControlGuard; the metrics also the addresses of metrics_allow)."""

from __future__ import annotations

import asyncio
import signal
from contextlib import asynccontextmanager

from expert_stream.plugin.endpoint_guard import ControlGuard
from expert_stream.plugin.hosts import operator_view
from expert_stream.plugin.hosts.openai import compat
from expert_stream.plugin.hosts.openai.reloader import Reloader
from expert_stream.plugin.redact import redact_errors

STATUS_PATH = "/expert-stream/status"
RELOAD_PATH = "/expert-stream/reload"


def lifespan_factory(state):
    """What replaces app.server.create_multi_lifespan for this served config."""

    def create_multi_lifespan(multi_config):
        """The host parsed our stripped copy into multi_config; the plugin's own parse of the
        original file (`state.config`) drives the models."""
        return _lifespan(state)

    return create_multi_lifespan


def _lifespan(state):
    @asynccontextmanager
    async def lifespan(app):
        registry = state.internals.ModelRegistry()
        reloader = Reloader(state, registry)
        app.state.expert_stream = reloader
        try:
            await reloader.apply(state.config, reason="start")
        except Exception:
            await registry.cleanup_all()
            raise
        compat.publish_registry(app, registry, state.config.entries[0].model_id)
        _add_routes(app, reloader)
        tasks = [asyncio.create_task(reloader.supervisor.run()), asyncio.create_task(reloader.sample())]
        if state.config.options.watch:
            tasks.append(asyncio.create_task(reloader.watch()))
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, reloader.trigger, "SIGHUP")
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        yield
        for task in tasks:
            task.cancel()
        reloader.supervisor.stop()
        await registry.cleanup_all()

    return lifespan


def _add_routes(app, reloader: Reloader) -> None:
    # Plain Starlette routes (the handler gets the request): FastAPI's parameter inference is not
    # needed, and would misread the postponed annotations of this module.
    from fastapi.responses import JSONResponse, Response

    # Who may call them is ControlGuard's check, outside the host's CORS middleware.
    async def status(request):
        return JSONResponse(redact_errors(await reloader.status()))

    async def reload(request):
        if not reloader.state.config.options.reload_endpoint:
            return JSONResponse({"error": "the reload endpoint is off (expert_stream.reload_endpoint: false)"},
                                status_code=403)
        result = await reloader.reload("endpoint")
        return JSONResponse(redact_errors(result), status_code=200 if result["ok"] else 422)

    async def metrics(request):
        body, headers = operator_view.metrics(await reloader.status())
        return Response(body, headers=headers)

    async def page(request):
        body, headers = operator_view.page()
        return Response(body, headers=headers)

    app.add_route(STATUS_PATH, status, methods=["GET"])
    app.add_route(RELOAD_PATH, reload, methods=["POST"])
    app.add_route(operator_view.METRICS_PATH, metrics, methods=["GET"])
    for path in operator_view.PAGE_PATHS:
        app.add_route(path, page, methods=["GET"])

    def allowed(path):  # read at each request: a reload may change metrics_allow
        return reloader.state.config.options.metrics_allow if path == operator_view.METRICS_PATH else ()

    bind_host = (reloader.state.config.top_level.get("server") or {}).get("host")
    app.middleware_stack = ControlGuard(app.middleware_stack or app.build_middleware_stack(),
                                        (STATUS_PATH, RELOAD_PATH, operator_view.METRICS_PATH,
                                         *operator_view.PAGE_PATHS), bind_host, allowed)
