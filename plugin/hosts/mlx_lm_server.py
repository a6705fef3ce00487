"""mlx_lm.server with expert streaming: `expert-stream mlx-lm-server --config models.yaml -- [flags]`.

mlx_lm.server has no config file; the plugin reads a small one of the same shape as the
mlx-openai-server file:

    expert_stream: {watch: true}
    default_model: qwen            # optional; else the first entry
    models:
      - model_path: ~/models/Qwen3-30B-A3B-4bit
        served_model_name: qwen    # the `model` name requests use
        expert_stream: {budget_gib: 8}

The server runs in this process. Aliases go into ModelProvider's own name map; the load is
intercepted at `mlx_lm.utils.load_model` for streamed folders. A reload changes the name map and
the targets at once and marks the loaded model stale when its entry changed; the model is then
reloaded inside `ModelProvider.load`, the point where mlx_lm.server itself swaps models between
requests, on the generation thread. Streamed models are served one request at a time (the
provider's `is_batchable` is cleared for them)."""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from expert_stream.plugin import run_files
from expert_stream.plugin.config import (
    ConfigError,
    HostConfig,
    HostSchema,
    diff,
    load_host_config,
)
from expert_stream.plugin.hosts.base import installed_version, parameter_names, refuse
from expert_stream.plugin.endpoint_guard import refusal
from expert_stream.plugin.redact import redact_errors, redacting_calls
from expert_stream.plugin.reload import (
    FileWatcher,
    ModelState,
    ReloadRecord,
)

log = logging.getLogger("expert_stream")

STATUS_PATH = "/expert-stream/status"
RELOAD_PATH = "/expert-stream/reload"
MODELS_PATH = "/v1/models"
TESTED_VERSIONS = ("0.31.3", "0.32.2")
SHUTDOWN_GRACE_S = 3.0  # after SIGINT, before requests still running are cut off


class MlxLmServerHost:
    name = "mlx_lm.server"
    distribution = "mlx-lm"
    install_hint = "pip install 'mlx-lm>=0.31,<0.33'"

    def version(self) -> str:
        return installed_version(self.distribution, self.install_hint)

    def internals(self) -> SimpleNamespace:
        version = self.version()
        import mlx_lm.server as server
        import mlx_lm.utils
        from expert_stream.plugin.hosts import interception

        problems = []
        provider = getattr(server, "ModelProvider", None)
        if parameter_names(getattr(provider, "load", None))[:4] != ["self", "model_path", "adapter_path", "draft_model_path"]:
            problems.append("ModelProvider.load(model_path, adapter_path, draft_model_path) is missing")
        if not callable(getattr(provider, "_load", None)):
            problems.append("ModelProvider._load is missing")
        init_source = inspect.getsource(provider.__init__) if provider else ""
        for attr in ("_model_map", "_adapter_map", "model_key", "is_batchable"):
            if attr not in init_source:
                problems.append(f"ModelProvider.{attr} is missing")
        handler = getattr(server, "APIHandler", None)
        for method in ("do_GET", "do_POST", "do_OPTIONS"):
            if not callable(getattr(handler, method, None)):
                problems.append(f"APIHandler.{method} is missing")
        generator = getattr(server, "ResponseGenerator", None)
        if not callable(getattr(generator, "generate", None)):
            problems.append("ResponseGenerator.generate is missing")
        if not callable(getattr(server, "main", None)):
            problems.append("mlx_lm.server.main is missing")
        if getattr(server, "load", None) is not mlx_lm.utils.load:
            problems.append("mlx_lm.server does not load through mlx_lm.utils.load")
        problems += interception.check()
        refuse(self.name + " (mlx-lm)", version, problems)
        return SimpleNamespace(version=version, server=server, Provider=provider, APIHandler=handler,
                               ResponseGenerator=generator)

    def schema(self, internals=None) -> HostSchema:
        version = internals.version if internals else self.version()
        return HostSchema(
            name=self.name, version=version,
            entry_keys=frozenset({"model_path", "served_model_name", "model_id", "adapter_path", "trust_remote_code"}),
            id_key="served_model_name", top_level_keys=frozenset({"default_model"}),
        )

    def load_config(self, path, internals=None, **kw) -> HostConfig:
        config = load_host_config(path, self.schema(internals), **kw)
        _check_unique_folders(config)
        return config

    def serve(self, config_path: str, host_args: list[str]) -> int:
        from expert_stream.plugin.hosts.pipeline_mode import PipelineMode, refuse_tensor_parallel

        internals = self.internals()
        pipeline = PipelineMode.detect(host_args)  # each rank checks its own layers' shards when it loads
        config = self.load_config(config_path, internals, check_models=pipeline is None)
        state = LmServerState(self, internals, config)
        state.pipeline = pipeline
        if "--host" in host_args[:-1]:
            state.bind_host = host_args[host_args.index("--host") + 1]
        state.install()
        if pipeline is not None:
            pipeline.install(internals, state)
        else:
            refuse_tensor_parallel(internals)
        default = config.top_level.get("default_model") or config.entries[0].model_id
        if default not in config.by_id():
            raise ConfigError(f"{config.path}: default_model {default!r} is not the served_model_name of any entry")
        argv = list(host_args)
        if "--model" not in argv:
            argv += ["--model", default]
        sys.argv = ["mlx_lm.server", *argv]
        if config.options.watch:
            threading.Thread(target=state.watch, name="expert-stream-watch", daemon=True).start()
        try:
            signal.signal(signal.SIGHUP, lambda *_: threading.Thread(
                target=state.reload, args=("SIGHUP",), daemon=True).start())
            signal.signal(signal.SIGINT, _stop_on_interrupt)
        except (ValueError, AttributeError):
            pass
        if pipeline is None or pipeline.rank == 0:  # only rank 0 serves HTTP
            run_files.write(run_files.local_url(*_listen_address(argv)), config.path, self.name)
        log.info("expert-stream: serving %s through mlx_lm.server (mlx-lm %s)", config.path, internals.version)
        internals.server.main()
        return 0


def _stop_on_interrupt(signum, frame):
    """Ctrl-C: mlx_lm.server stops its HTTP loop, then joins its generation thread, which
    finishes the request in flight first (minutes for a long one). Give it a few seconds, then
    end the process: open connections are cut, so their clients get an error, not a hang."""
    def exit_later():
        time.sleep(SHUTDOWN_GRACE_S)
        log.warning("expert-stream: mlx_lm.server did not stop within %.0f s of SIGINT; cutting off "
                    "the requests in flight", SHUTDOWN_GRACE_S)
        run_files.remove_own()
        os._exit(130)

    threading.Thread(target=exit_later, name="expert-stream-stop", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends it at once
    raise KeyboardInterrupt


def _listen_address(argv: list[str]) -> tuple[str, int]:
    """mlx_lm.server's --host and --port (its defaults: 127.0.0.1, 8080)."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    known, _ = parser.parse_known_args(argv)
    return known.host, known.port


def _check_unique_folders(config: HostConfig) -> None:
    seen: dict = {}
    for entry in config.entries:
        if not entry.streamed:
            continue
        key = str(entry.resolved_path())
        if key in seen:
            raise ConfigError(f"{config.path}: models[{entry.index}] ({entry.model_id}) streams the same folder as "
                              f"{seen[key]}; mlx_lm.server keys models by folder, keep one entry per folder")
        seen[key] = entry.model_id


class LmServerState:
    """The applied config of a running mlx_lm.server, and the patches that consult it."""

    def __init__(self, host: MlxLmServerHost, internals, config: HostConfig):
        self.host = host
        self.internals = internals
        self.config = config
        self.lock = threading.RLock()
        self.reload_lock = threading.Lock()
        self.stale: set[str] = set()  # folders whose loaded model no longer matches its entry
        self.removed: set[str] = set()  # names removed from the config
        self.provider = None
        self.bind_host = "127.0.0.1"  # mlx_lm.server's default; serve() reads --host
        self.pipeline = None  # pipeline_mode.PipelineMode when this process is one rank of --pipeline
        self.record = ReloadRecord(str(config.path), host.name, internals.version,
                                   applied_hash=config.text_hash, applied_at=time.time())
        self._sync_models()

    # -- the config as the provider sees it ---------------------------------------------------
    def aliases(self) -> dict[str, str]:
        return {e.model_id: str(e.resolved_path()) for e in self.config.entries}

    def targets(self) -> dict:
        from expert_stream.plugin.hosts.interception import Target

        return {e.resolved_path(): Target(e.model_id, e.settings.to_dict()) for e in self.config.entries if e.streamed}

    def _sync_models(self) -> None:
        models = {}
        for e in self.config.entries:
            old = self.record.models.get(e.model_id)
            models[e.model_id] = ModelState(e.model_id, e.model_path, e.streamed,
                                            state=old.state if old else "configured",
                                            settings=e.settings.to_dict() if e.streamed else None)
        self.record.models = models

    def _apply_to_provider(self, provider) -> None:
        for alias in self.removed:
            provider._model_map.pop(alias, None)
            provider._adapter_map.pop(alias, None)
        for entry in self.config.entries:
            path = str(entry.resolved_path())
            provider._model_map[entry.model_id] = path
            adapter = entry.host_entry.get("adapter_path")
            # mlx-lm 0.31 looks adapters up by folder, 0.32 by the requested name.
            provider._adapter_map[entry.model_id] = adapter
            provider._adapter_map[path] = adapter

    def install(self) -> None:
        from expert_stream.plugin.hosts import interception

        interception.install()
        interception.set_targets(self.targets())
        state = self
        Provider = self.internals.Provider
        original_init, original_load, original__load = Provider.__init__, Provider.load, Provider._load

        def __init__(self, cli_args):
            original_init(self, cli_args)
            state.provider = self
            with state.lock:
                state._apply_to_provider(self)
                if cli_args.model in state.aliases():
                    self._model_map["default_model"] = state.aliases()[cli_args.model]

        def load(self, model_path, adapter_path=None, draft_model_path=None):
            # mlx_lm.server's own safe point: called on the generation thread between requests.
            with state.lock:
                if model_path in state.removed and model_path not in state.aliases():
                    raise ValueError(f"model {model_path!r} was removed from {state.config.path}")
                if self.model_key is not None and str(Path(self.model_key[0]).resolve()) in state.stale:
                    state.stale.discard(str(Path(self.model_key[0]).resolve()))
                    self.model_key = None  # forces _load with the new settings
            return original_load(self, model_path, adapter_path, draft_model_path)

        def _load(self, model_path, *args, **kwargs):
            t0 = time.perf_counter()
            original__load(self, model_path, *args, **kwargs)
            folder = str(Path(model_path).resolve())
            with state.lock:
                for entry in state.config.entries:
                    model_state = state.record.models.get(entry.model_id)
                    if model_state is None:
                        continue
                    if str(entry.resolved_path()) == folder:
                        model_state.state, model_state.loaded_at = "loaded", time.time()
                        model_state.load_seconds = round(time.perf_counter() - t0, 2)
                    elif model_state.state == "loaded":
                        model_state.state = "configured"
                streamed = any(str(e.resolved_path()) == folder for e in state.config.entries if e.streamed)
            if streamed:
                self.is_batchable = False  # one request at a time: batching collapses the hit rate

        Provider.__init__, Provider.load, Provider._load = __init__, load, _load
        Generator = self.internals.ResponseGenerator
        Generator.generate = redacting_calls(Generator.generate)  # errors reach clients as text
        self._patch_handler()

    def _patch_handler(self) -> None:
        state = self
        Handler = self.internals.APIHandler
        original_get, original_post = Handler.do_GET, Handler.do_POST

        def reply(handler, status: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            handler.send_response(status)
            handler.send_header("Content-type", "application/json")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
            handler.wfile.flush()

        def refused(handler, path) -> bool:
            # client_address is the socket's peer; see endpoint_guard for the rest.
            headers = {k.lower(): v for k, v in handler.headers.items()}
            why = refusal(handler.client_address[0], headers, state.bind_host)
            if why:
                reply(handler, 403, {"error": f"{path} {why}"})
            return bool(why)

        def do_GET(self):
            route = self.path.split("?")[0]
            if route == MODELS_PATH or route.startswith(MODELS_PATH + "/"):
                # The host lists models of the Hugging Face cache; what it serves is the config.
                return reply(self, 200, state.models_list(route[len(MODELS_PATH) + 1:] or None))
            if route == STATUS_PATH:
                return refused(self, STATUS_PATH) or reply(self, 200, redact_errors(state.status()))
            return original_get(self)

        def do_POST(self):
            if self.path.split("?")[0] == RELOAD_PATH:
                if refused(self, RELOAD_PATH):
                    return
                result = state.reload("endpoint")
                return reply(self, 200 if result["ok"] else 422, redact_errors(result))
            return original_post(self)

        def do_OPTIONS(self):  # no CORS preflight answer for the control endpoints
            if self.path.split("?")[0] in (STATUS_PATH, RELOAD_PATH):
                return reply(self, 403, {"error": "the control endpoints do not answer web pages"})
            return original_options(self)

        original_options = Handler.do_OPTIONS
        Handler.do_GET, Handler.do_POST, Handler.do_OPTIONS = do_GET, do_POST, do_OPTIONS

    # -- reload ---------------------------------------------------------------------------------
    def watch(self) -> None:
        watcher = FileWatcher(self.config.path, self.config.options.debounce_seconds)
        while True:
            time.sleep(self.config.options.poll_seconds)
            try:
                if watcher.poll():
                    self.reload("file changed")
            except Exception as exc:  # the watcher outlives any failure: the next edit is applied
                log.exception("expert-stream: watching %s: %s", self.config.path, exc)
                self.record.fail(f"watching the config file failed: {type(exc).__name__}: {exc}", None)

    def reload(self, reason: str, new=None) -> dict:
        """`new`: the config every pipeline rank validated (pipeline_reload asks them all first)."""
        from expert_stream.plugin import plugins
        from expert_stream.plugin.hosts import interception

        if self.pipeline is not None and new is None:
            return self.pipeline.reloads.request(reason)
        with self.reload_lock:
            path = self.config.path
            try:
                new = new or self.host.load_config(path, self.internals)
            except Exception as exc:  # ConfigError, or a plugin's hook failing: refused either way
                from expert_stream.plugin.reload import refuse_reload

                return refuse_reload(self.record, path, reason, exc)
            if new.text_hash == self.config.text_hash:
                self.record.last_error = self.record.failed_hash = None  # back to the applied file
                return {"ok": True, "unchanged": True, "applied": []}
            t0 = time.perf_counter()
            removed, changed, added = diff(self.config, new)
            old_by_id = self.config.by_id()
            with self.lock:
                for model_id in removed + changed:
                    self.stale.add(str(old_by_id[model_id].resolved_path()))
                self.removed = (self.removed | set(removed)) - set(new.by_id())
                self.config = new
                interception.set_targets(self.targets())
                if self.provider is not None:
                    self._apply_to_provider(self.provider)
                self._sync_models()
                for model_id in changed:
                    self.record.models[model_id].state = "pending reload"
            self.record.applied_hash, self.record.applied_at = new.text_hash, time.time()
            self.record.last_error = self.record.failed_hash = None
            self.record.reloads += 1
            self.record.last_reload = {"reason": reason, "removed": removed, "changed": changed, "added": added,
                                       "seconds": round(time.perf_counter() - t0, 3),
                                       "note": "a changed model reloads at its next request"}
            applied = [("removed", m) for m in removed] + [("changed", m) for m in changed] + \
                      [("added", m) for m in added]
            plugins.get_plugin_manager().hook.config_reloaded(path=str(path), applied=applied, error=None)
            return {"ok": True, "applied": applied, "last_reload": self.record.last_reload}

    def models_list(self, only=None) -> dict:
        """/v1/models as mlx_lm.server shapes it, with the configured served names."""
        with self.lock:
            ids = [e.model_id for e in self.config.entries]
        return {"object": "list", "data": [{"id": i, "object": "model", "created": int(self.record.applied_at or 0)}
                                           for i in ids if only is None or i == only]}

    def status(self) -> dict:
        from expert_stream.plugin.hosts import interception

        stats = interception.stats()
        with self.lock:
            for model_id, model_state in self.record.models.items():
                if model_id in stats:
                    model_state.stats = stats[model_id]
                    model_state.settings = stats[model_id].get("settings", model_state.settings)
            out = self.record.as_dict()
        loaded = getattr(self.provider, "model_key", None)
        out["loaded_model"] = loaded[0] if loaded else None
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline.status()
        return out


MLX_LM_SERVER = MlxLmServerHost()
