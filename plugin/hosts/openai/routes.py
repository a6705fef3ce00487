"""What the plugin adds to mlx-openai-server's app: a lifespan that starts the models through
the Reloader (so the first load and every hot reload take one path), the supervisor, the file
watcher and SIGHUP, and the control routes GET /expert-stream/status and POST
/expert-stream/reload (both answer loopback clients only: ControlGuard)."""

from __future__ import annotations

import asyncio
import signal
from contextlib import asynccontextmanager

from expert_stream.plugin.endpoint_guard import ControlGuard
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
        tasks = [asyncio.create_task(reloader.supervisor.run())]
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
    from fastapi.responses import JSONResponse

    # Who may call them is ControlGuard's check, outside the host's CORS middleware.
    async def status(request):
        return JSONResponse(redact_errors(await reloader.status()))

    async def reload(request):
        if not reloader.state.config.options.reload_endpoint:
            return JSONResponse({"error": "the reload endpoint is off (expert_stream.reload_endpoint: false)"},
                                status_code=403)
        result = await reloader.reload("endpoint")
        return JSONResponse(redact_errors(result), status_code=200 if result["ok"] else 422)

    app.add_route(STATUS_PATH, status, methods=["GET"])
    app.add_route(RELOAD_PATH, reload, methods=["POST"])
    bind_host = (reloader.state.config.top_level.get("server") or {}).get("host")
    app.middleware_stack = ControlGuard(app.middleware_stack or app.build_middleware_stack(),
                                        (STATUS_PATH, RELOAD_PATH), bind_host)
