"""mlx-openai-server with expert streaming: `expert-stream serve --config FILE [host flags]`.

How it works (multi-model mode, the host's `--config`):
- The plugin reads FILE itself, validates all of it (config.py), and hands the host a copy with
  its `expert_stream:` blocks removed (the bare host crashes on an unknown per-model key), long
  queue timeouts and one request at a time for streamed entries, and the server flags given on
  the command line (--host, --port, --log-level, ...) written into `server:`.
- The host spawns one child process per model. The plugin replaces the host's lifespan with one
  that spawns the same children through the host's own HandlerProcessProxy, so the first load and
  every hot reload take one path, and replaces the child's entry function with
  `openai_child.child_worker`: the entry's settings travel in the queue_config dict the proxy
  already sends to the child, and the child intercepts `mlx_lm.utils.load_model` for that one
  folder (interception.py). Dense and draft models load as they always do.
- Every host internal used is checked before anything starts (`internals`); a host version whose
  internals differ is refused with a message naming the version.
- Routes added to the host's app: GET /expert-stream/status, POST /expert-stream/reload (both
  answer loopback clients only). SIGHUP and file changes (when `watch: true`) reload too.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import logging
import shutil
import signal
import tempfile
import time
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from expert_stream.plugin import run_files
from expert_stream.plugin.config import (
    HostConfig,
    HostSchema,
    diff,
    load_host_config,
    room_for_both,
)
from expert_stream.plugin.endpoint_guard import ControlGuard
from expert_stream.plugin.host_schema_check import dataclass_check, section_check
from expert_stream.plugin.hosts.base import (
    HostError,
    installed_version,
    parameter_names,
    refuse,
)
from expert_stream.plugin.redact import redact_errors, redacting
from expert_stream.plugin.request_queue import WaitingHandler
from expert_stream.plugin.supervision import ProcessSupervisor, fail_pending
from expert_stream.plugin.reload import (
    FileWatcher,
    ModelState,
    ReloadRecord,
)

log = logging.getLogger("expert_stream")

STATUS_PATH = "/expert-stream/status"
RELOAD_PATH = "/expert-stream/reload"
TESTED_VERSIONS = ("1.6.3", "1.8.1")
# Flags of `launch` that multi-model mode ignores but belong in the YAML's `server:` section.
SERVER_FLAGS = {"--host": "host", "--port": "port", "--log-level": "log_level", "--log-file": "log_file"}
# Entry values that make a model serve one request at a time, by host version.
ONE_AT_A_TIME = {"max_concurrency": 1, "disable_batching": True}
STATS_TIMEOUT_S = 2.0  # a child busy generating answers the stats call after its request
# Host entry numbers that become timeouts and queue sizes in the model process.
ENTRY_BOUNDS = {"queue_timeout": (1, 30 * 86400), "queue_size": (1, 1 << 20), "max_concurrency": (1, 1024),
                "context_length": (1, 1 << 32)}


class OpenAIServerHost:
    name = "mlx-openai-server"
    distribution = "mlx-openai-server"
    install_hint = "pip install mlx-openai-server==1.6.3 (the newest that installs on Linux; 1.8.x on macOS)"

    def version(self) -> str:
        return installed_version(self.distribution, self.install_hint)

    def internals(self) -> SimpleNamespace:
        """Import and check every host internal the adapter touches; refuse a host that differs."""
        version = self.version()
        problems: list[str] = []
        try:
            import app.cli as cli
            import app.config as config
            import app.models.mlx_lm as models_mlx_lm
            import app.server as server
            from app.core import handler_process
            from app.core.model_registry import ModelRegistry
        except ImportError as exc:
            raise HostError(f"{self.name} {version}: cannot import its modules ({exc})") from None
        import mlx_lm.utils
        from expert_stream.plugin.hosts import interception

        def need(ok: bool, what: str):
            if not ok:
                problems.append(what)

        launch = getattr(getattr(cli, "cli", None), "commands", {}).get("launch")
        need(launch is not None and "config_file" in {p.name for p in launch.params},
             "app.cli has no `launch --config` command")
        entry_cls = getattr(config, "ModelEntryConfig", None)
        fields = {f.name for f in dataclasses.fields(entry_cls)} if dataclasses.is_dataclass(entry_cls) else set()
        need({"model_path", "model_type", "queue_timeout"} <= fields,
             "app.config.ModelEntryConfig lacks model_path/model_type/queue_timeout")
        # One request at a time for streamed models: 1.6 caps the queue's concurrency, 1.8
        # replaced that with continuous batching, which it can switch off per model.
        need(bool(fields & set(ONE_AT_A_TIME)),
             "app.config.ModelEntryConfig has neither max_concurrency nor disable_batching")
        id_key = "served_model_name" if "served_model_name" in fields else "model_id"
        need(id_key in fields, "app.config.ModelEntryConfig has neither served_model_name nor model_id")
        need(parameter_names(getattr(server, "create_multi_lifespan", None))[:1] == ["config"],
             "app.server.create_multi_lifespan(config) is missing")
        worker = getattr(handler_process, "_handler_worker", None)
        need(parameter_names(worker)[:2] == ["model_cfg_dict", "queue_config"],
             "app.core.handler_process._handler_worker(model_cfg_dict, queue_config, ...) is missing")
        proxy = getattr(handler_process, "HandlerProcessProxy", None)
        proxy_params = set(parameter_names(getattr(proxy, "__init__", None)))
        need({"model_cfg_dict", "model_type", "model_path"} <= proxy_params
             and bool({"model_id", "served_model_name"} & proxy_params),
             "HandlerProcessProxy(model_cfg_dict, model_type, model_path, model_id) is missing")
        need(callable(getattr(proxy, "_raise_remote_error", None)), "HandlerProcessProxy._raise_remote_error is missing")
        for method in ("start", "cleanup", "_call"):
            need(inspect.iscoroutinefunction(getattr(proxy, method, None)), f"HandlerProcessProxy.{method} is missing")
        need("_pending" in _source(getattr(proxy, "__init__", None)), "HandlerProcessProxy._pending is missing")
        need(parameter_names(getattr(ModelRegistry, "register_model", None))[:5]
             == ["self", "model_id", "handler", "model_type", "context_length"],
             "ModelRegistry.register_model(model_id, handler, model_type, context_length) is missing")
        need(all(a in _source(ModelRegistry.__init__) for a in ("_handlers", "_metadata", "_lock")),
             "ModelRegistry._handlers/_metadata/_lock are missing")
        for method in ("get_handler", "cleanup_all", "list_models"):
            need(hasattr(ModelRegistry, method), f"ModelRegistry.{method} is missing")
        need(getattr(models_mlx_lm, "load", None) in (mlx_lm.utils.load, getattr(mlx_lm, "load", None)),
             "app.models.mlx_lm does not load through mlx_lm.utils.load")
        problems += interception.check()
        refuse(self.name, version, problems)
        return SimpleNamespace(
            version=version, cli=cli, launch=launch, ModelEntryConfig=entry_cls, entry_fields=fields,
            id_key=id_key, server=server, handler_process=handler_process, Proxy=proxy,
            proxy_id_param="served_model_name" if "served_model_name" in proxy_params else "model_id",
            ModelRegistry=ModelRegistry,
        )

    def schema(self, internals: Optional[SimpleNamespace] = None) -> HostSchema:
        internals = internals or self.internals()
        return HostSchema(
            name=self.name,
            version=internals.version,
            entry_keys=frozenset(internals.entry_fields | {"served_model_name", "model_id"}),
            id_key=internals.id_key,
            queue_timeout_key="queue_timeout",
            forced_entry_values={k: v for k, v in ONE_AT_A_TIME.items() if k in internals.entry_fields},
            streamed_entry_check=_lm_only,
            entry_check=dataclass_check(internals.ModelEntryConfig, bounds=ENTRY_BOUNDS),
            top_level_check=_server_section_check(),
        )

    def load_config(self, path, internals=None, **kw) -> HostConfig:
        return load_host_config(path, self.schema(internals), **kw)

    def serve(self, config_path: str, host_args: list[str]) -> int:
        """Start the host on config_path with the plugin; returns the host's exit code."""
        internals = self.internals()
        schema = self.schema(internals)
        server_flags, rest = _split_server_flags(host_args)
        config = load_host_config(config_path, schema)
        _apply_server_flags(config, server_flags)
        state = ServingState(self, internals, schema, config, server_flags)
        workdir = Path(tempfile.mkdtemp(prefix="expert-stream-"))
        host_file = workdir / "host-config.yaml"
        host_file.write_text(config.host_yaml())
        _install(internals, state)
        server = config.top_level.get("server") or {}
        run_files.write(run_files.local_url(server.get("host", "0.0.0.0"), int(server.get("port", 8000))),
                        config.path, self.name)
        log.info("expert-stream: serving %s through %s %s", config.path, self.name, internals.version)
        try:
            internals.cli.cli.main(args=["launch", "--config", str(host_file), *rest],
                                   prog_name="expert-stream serve", standalone_mode=False)
        except SystemExit as exc:
            return int(exc.code or 0)
        except Exception as exc:  # click errors: show them as the host would
            import click

            if isinstance(exc, click.exceptions.Abort):  # Ctrl-C / SIGINT while serving
                return 130
            if isinstance(exc, click.ClickException):
                exc.show()
                return exc.exit_code
            raise
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        return 0


def _server_section_check():
    import app.config

    cls = getattr(app.config, "MultiModelServerConfig", None)
    return section_check("server", cls, skip=frozenset({"models"}), bounds={"port": (0, 65535)}) if cls else None


def _lm_only(entry: dict) -> Optional[str]:
    model_type = entry.get("model_type", "lm")
    if model_type != "lm":
        return f"model_type {model_type!r} cannot be streamed (only `lm` models load through mlx-lm)"
    return None


def _source(fn) -> str:
    try:
        return inspect.getsource(fn)
    except (TypeError, OSError):
        return ""


def _split_server_flags(args: list[str]) -> tuple[dict, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    for flag, dest in SERVER_FLAGS.items():
        parser.add_argument(flag, dest=dest, default=None, type=int if dest == "port" else str)
    parser.add_argument("--no-log-file", dest="no_log_file", action="store_true", default=None)
    known, rest = parser.parse_known_args(args)
    return {k: v for k, v in vars(known).items() if v is not None}, rest


def _apply_server_flags(config: HostConfig, flags: dict) -> None:
    server = dict(config.top_level.get("server") or {})
    server.update(flags)
    if server:
        config.top_level["server"] = server


class ServingState:
    """Everything the parent process knows while it serves: set before the host starts."""

    def __init__(self, host, internals, schema, config, server_flags):
        self.host = host
        self.internals = internals
        self.schema = schema
        self.config = config  # the applied config
        self.server_flags = server_flags
        self.record = ReloadRecord(str(config.path), host.name, internals.version)


_state: Optional[ServingState] = None


def _install(internals, state: ServingState) -> None:
    """The two patches in the parent: the child entry function and the multi-model lifespan."""
    global _state
    from expert_stream.plugin.hosts.openai_child import child_worker

    _state = state
    internals.handler_process._handler_worker = child_worker
    # A model process's error reaches the HTTP client through this one function.
    internals.Proxy._raise_remote_error = staticmethod(redacting(internals.Proxy._raise_remote_error))
    internals.server.create_multi_lifespan = _make_lifespan


def _make_lifespan(multi_config):
    """Replaces app.server.create_multi_lifespan: the host parsed our stripped copy into
    multi_config; the plugin's own parse of the original file drives the models."""
    state = _state

    @asynccontextmanager
    async def lifespan(app):
        registry = state.internals.ModelRegistry()
        app.state.registry = registry
        reloader = Reloader(state, registry)
        app.state.expert_stream = reloader
        try:
            await reloader.apply(state.config, reason="start")
        except Exception:
            await registry.cleanup_all()
            raise
        first = state.config.entries[0].model_id
        if registry.has_model(first):
            app.state.handler = registry.get_handler(first)
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


def _add_routes(app, reloader: "Reloader") -> None:
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


class Reloader:
    """Applies configs to the running host: the first one at start, then every valid edit."""

    def __init__(self, state: ServingState, registry):
        self.state = state
        self.registry = registry
        self.record = state.record
        self.lock = asyncio.Lock()
        self.proxies: dict = {}  # model_id -> HandlerProcessProxy of a routed, running model
        self.entries: dict = {}  # model_id -> the ModelEntry its process was started with
        self._holds: dict = {}  # model_id -> WaitingHandler routed while it is not there
        self.supervisor = ProcessSupervisor(self)

    # -- triggers ---------------------------------------------------------------------------
    def trigger(self, reason: str = "signal") -> None:
        asyncio.get_running_loop().create_task(self.reload(reason))

    async def watch(self) -> None:
        options = self.state.config.options
        watcher = FileWatcher(self.state.config.path, options.debounce_seconds)
        while True:
            await asyncio.sleep(options.poll_seconds)
            try:
                if watcher.poll():
                    await self.reload("file changed")
            except Exception as exc:  # the watcher outlives any failure: the next edit is applied
                log.exception("expert-stream: watching %s: %s", self.state.config.path, exc)
                self.record.fail(f"watching the config file failed: {type(exc).__name__}: {exc}", None)

    # -- reload -----------------------------------------------------------------------------
    async def reload(self, reason: str) -> dict:
        from expert_stream.plugin import plugins

        async with self.lock:
            path = self.state.config.path
            try:
                new = await asyncio.to_thread(load_host_config, path, self.state.schema)
                _apply_server_flags(new, self.state.server_flags)
            except Exception as exc:  # ConfigError, or a plugin's hook failing: refused either way
                from expert_stream.plugin.reload import refuse_reload

                return refuse_reload(self.record, path, reason, exc)
            if new.text_hash == self.state.config.text_hash:
                self.record.last_error = self.record.failed_hash = None  # back to the applied file
                return {"ok": True, "unchanged": True, "applied": []}
            if new.top_level.get("server") != self.state.config.top_level.get("server"):
                self.record.warnings.append("server: section changed; host and port apply at the next start")
            try:
                applied = await self._apply(new, reason)
            except Exception as exc:  # reported, and the next edit is applied as usual
                message = f"{path}: applying the config failed: {type(exc).__name__}: {exc}"
                log.exception("expert-stream: reload (%s): %s", reason, message)
                self.record.fail(message, new.text_hash)
                plugins.get_plugin_manager().hook.config_reloaded(path=str(path), applied=[], error=message)
                return {"ok": False, "error": message}
            return {"ok": True, "applied": applied, "last_reload": self.record.last_reload}

    async def apply(self, config: HostConfig, reason: str) -> list:
        async with self.lock:
            return await self._apply(config, reason)

    async def _apply(self, new: HostConfig, reason: str) -> list:
        from expert_stream.plugin import plugins

        old = self.state.config if self.proxies or reason != "start" else None
        removed, changed, added = diff(old, new)
        t0 = time.perf_counter()
        self.record.reloading = True
        self.record.last_error = self.record.failed_hash = None  # a model failing to load sets it again
        applied, cut_off = [], 0
        try:
            for model_id in removed:
                cut_off += await self._unload(model_id, placeholder=False)
                self.record.models.pop(model_id, None)
                applied.append(("removed", model_id))
            for model_id in changed:
                if model_id in self.proxies and room_for_both(new, old.by_id()[model_id]):
                    cut_off += await self._replace(new.by_id()[model_id])
                else:  # its requests wait for the new model meanwhile
                    cut_off += await self._unload(model_id, placeholder=True)
                    await self._load(new.by_id()[model_id])
                applied.append(("changed", model_id))
            for model_id in added:
                await self._load(new.by_id()[model_id], fail_hard=(reason == "start"))
                applied.append(("added", model_id))
        finally:
            self.record.reloading = False
        self.state.config = new
        self.record.applied_hash = new.text_hash
        self.record.applied_at = time.time()
        if reason != "start":
            self.record.reloads += 1
        self.record.last_reload = {"reason": reason, "removed": removed, "changed": changed, "added": added,
                                   "seconds": round(time.perf_counter() - t0, 2), "cut_off": cut_off}
        log.info("expert-stream: config applied (%s): %s", reason, self.record.last_reload)
        plugins.get_plugin_manager().hook.config_reloaded(path=str(new.path), applied=applied, error=None)
        return applied

    async def _load(self, entry, fail_hard: bool = False) -> None:
        proxy = await self._start(entry, fail_hard)
        if proxy is not None:
            await self._route(entry.model_id, proxy, entry.host_entry.get("model_type", "lm"),
                              entry.host_entry.get("context_length"))
            self.proxies[entry.model_id] = proxy

    async def _replace(self, entry) -> int:
        """Make before break: the new process loads beside the old one, which serves until
        the switch; if the new one fails to load, the old one keeps serving."""
        model_id = entry.model_id
        old_state = self.record.models.get(model_id)
        proxy = await self._start(entry)
        if proxy is None:
            if old_state is not None:
                failed, self.record.models[model_id] = self.record.models[model_id], old_state
                old_state.error = f"the changed entry failed to load, still serving the previous one: {failed.error}"
            return 0
        old = self.proxies.pop(model_id)
        await self._route(model_id, proxy, entry.host_entry.get("model_type", "lm"),
                          entry.host_entry.get("context_length"))
        self.proxies[model_id] = proxy
        cut_off = await _drain(old, model_id, self.state.config.options.drain_timeout_s)
        await old.cleanup()
        return cut_off

    def hold(self, model_id: str):
        """Route the model's requests to a WaitingHandler until something else is routed."""
        entry = self.entries.get(model_id)
        host_entry = entry.host_entry if entry else {}
        model_type = host_entry.get("model_type", "lm")
        handler_type = getattr(self.state.internals.Proxy, "_MODEL_TYPE_TO_HANDLER_TYPE", {}).get(model_type, model_type)
        waiting = WaitingHandler(model_id, entry.model_path if entry else "", handler_type, self.state.internals.Proxy,
                                 timeout=host_entry.get("queue_timeout", 300),
                                 max_waiting=host_entry.get("queue_size", 100))
        if model_id in self.registry._metadata:
            self.registry._handlers[model_id] = waiting
        previous = self._holds.get(model_id)
        self._holds[model_id] = waiting
        if previous is not None:
            previous.resolve(waiting)  # who waited there waits on, here
        return waiting

    async def _start(self, entry, fail_hard: bool = False):
        """Spawn the entry's model process and wait until it is ready; None if it failed."""
        internals = self.state.internals
        cfg = internals.ModelEntryConfig(**entry.host_entry)
        previous = self.record.models.get(entry.model_id)
        restarting = previous is not None and previous.state == "restarting"  # the supervisor's restart
        model_state = ModelState(entry.model_id, entry.model_path, entry.streamed,
                                 state="restarting" if restarting else "loading",
                                 restarts=previous.restarts if restarting else 0,
                                 settings=entry.settings.to_dict() if entry.streamed else None)
        self.record.models[entry.model_id] = model_state
        kwargs = {"model_cfg_dict": dataclasses.asdict(cfg), "model_type": cfg.model_type,
                  "model_path": cfg.model_path, internals.proxy_id_param: entry.model_id}
        proxy = internals.Proxy(**kwargs)
        queue_config = {"timeout": cfg.queue_timeout, "queue_size": cfg.queue_size}
        if hasattr(cfg, "max_concurrency"):  # 1.6 (1.8 batches instead)
            queue_config["max_concurrency"] = cfg.max_concurrency
        if entry.streamed:
            queue_config["expert_stream"] = {"model_id": entry.model_id, "model_path": entry.model_path,
                                             "settings": entry.settings.to_dict()}
        t0 = time.perf_counter()
        try:
            await proxy.start(queue_config)
        except Exception as exc:
            model_state.state, model_state.error = "error", str(exc)
            self.record.fail(f"{entry.model_id}: {exc}", None)
            held = self._holds.get(entry.model_id)
            if held is not None:
                held.fail(f"failed to load after a config change: {exc}")
            await proxy.cleanup()
            if fail_hard:
                raise
            return None
        self.entries[entry.model_id] = entry
        model_state.state = "ready"
        model_state.loaded_at = time.time()
        model_state.load_seconds = round(time.perf_counter() - t0, 2)
        return proxy

    async def _route(self, model_id, handler, model_type, context_length) -> None:
        """Route the model's requests to `handler`: an atomic swap for a routed id."""
        held = self._holds.pop(model_id, None)
        if model_id in self.registry._metadata:
            self.registry._handlers[model_id] = handler
        else:
            await self.registry.register_model(model_id=model_id, handler=handler, model_type=model_type,
                                               context_length=context_length)
        if held is not None:
            held.resolve(handler)

    async def _unload(self, model_id: str, placeholder: bool) -> int:
        """Stop routing to the model, let its in-flight requests finish (up to the drain
        timeout, then cut them off with an error), then stop its process."""
        proxy = self.proxies.pop(model_id, None)
        if placeholder:
            self.hold(model_id)
        else:
            self.registry._handlers.pop(model_id, None)
            self.registry._metadata.pop(model_id, None)
            self.entries.pop(model_id, None)
            held = self._holds.pop(model_id, None)
            if held is not None:
                held.fail("was removed from the config")
        if proxy is None:
            return 0
        model_state = self.record.models.get(model_id)
        if model_state:
            model_state.state = "draining"
        cut_off = await _drain(proxy, model_id, self.state.config.options.drain_timeout_s)
        await proxy.cleanup()
        return cut_off

    # -- status -----------------------------------------------------------------------------
    async def status(self) -> dict:
        self.supervisor.notice_deaths()  # never report a dead process as ready
        for model_id, proxy in list(self.proxies.items()):
            model_state = self.record.models.get(model_id)
            if not model_state or not model_state.streamed or model_state.state != "ready":
                continue
            try:
                stats = await asyncio.wait_for(proxy._call("expert_stream_stats"), STATS_TIMEOUT_S)
                model_state.stats = stats.get(model_id)
            except Exception:
                pass  # busy generating: report the last stats it gave
        return self.record.as_dict()


async def _drain(proxy, model_id: str, timeout: float) -> int:
    """Wait for the proxy's in-flight requests; past the timeout, answer each with an error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while any(rid != "__ready__" for rid in list(proxy._pending)) and loop.time() < deadline:
        await asyncio.sleep(0.1)
    cut_off = fail_pending(proxy, f"model {model_id!r} was unloaded by a config reload after waiting {timeout:.0f} s "
                                  "for this request; send it again", "ModelUnloaded")
    if cut_off:
        log.warning("expert-stream: %s: cut off %d request(s) after the %.0f s drain timeout", model_id, cut_off, timeout)
    return cut_off


MLX_OPENAI_SERVER = OpenAIServerHost()
