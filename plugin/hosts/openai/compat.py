"""Every mlx-openai-server internal the adapter touches, and nowhere else: the start-up check of
all of them (`check`), the patches (in the parent the model process's entry, the remote-error
path and the multi-model lifespan; in a model process the handler's stats method), what the
host's lifespan leaves on its app, and the reads and writes of private attributes (the model
registry's routing table, a model process proxy's pending requests, process and RPC).
A host version whose internals differ is refused by `check` before anything starts, with a
message naming the version and each internal that does not fit."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from types import SimpleNamespace

from expert_stream.plugin.hosts.base import HostError, parameter_names, refuse, source

# Entry values that make a model serve one request at a time, by host version: 1.6 caps the
# queue's concurrency, 1.8 replaced that with continuous batching, which it can switch off.
ONE_AT_A_TIME = {"max_concurrency": 1, "disable_batching": True}
READY_ID = "__ready__"  # the proxy's pending entry for its start-up handshake, not a request


def check(host: str, version: str) -> SimpleNamespace:
    """Import and check every host internal the adapter touches; refuse a host that differs."""
    problems: list[str] = []
    try:
        import app.cli as cli
        import app.config as config
        import app.handler.mlx_lm as handler_mlx_lm
        import app.models.mlx_lm as models_mlx_lm
        import app.server as server
        from app.core import handler_process
        from app.core.model_registry import ModelRegistry
    except ImportError as exc:
        raise HostError(f"{host} {version}: cannot import its modules ({exc})") from None
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
    for attr in ("_pending", "_process"):
        need(attr in source(getattr(proxy, "__init__", None)), f"HandlerProcessProxy.{attr} is missing")
    need(parameter_names(getattr(ModelRegistry, "register_model", None))[:5]
         == ["self", "model_id", "handler", "model_type", "context_length"],
         "ModelRegistry.register_model(model_id, handler, model_type, context_length) is missing")
    need(all(a in source(ModelRegistry.__init__) for a in ("_handlers", "_metadata", "_lock")),
         "ModelRegistry._handlers/_metadata/_lock are missing")
    for method in ("get_handler", "cleanup_all", "list_models"):
        need(hasattr(ModelRegistry, method), f"ModelRegistry.{method} is missing")
    need(inspect.isclass(getattr(handler_mlx_lm, "MLXLMHandler", None)), "app.handler.mlx_lm.MLXLMHandler is missing")
    need(hasattr(ModelRegistry, "has_model"), "ModelRegistry.has_model is missing")
    need(getattr(models_mlx_lm, "load", None) in (mlx_lm.utils.load, getattr(mlx_lm, "load", None)),
         "app.models.mlx_lm does not load through mlx_lm.utils.load")
    problems += interception.check()
    refuse(host, version, problems)
    return SimpleNamespace(
        version=version, cli=cli, launch=launch, ModelEntryConfig=entry_cls, entry_fields=fields,
        id_key=id_key, server=server, handler_process=handler_process, Proxy=proxy,
        proxy_id_param="served_model_name" if "served_model_name" in proxy_params else "model_id",
        ModelRegistry=ModelRegistry, ServerConfig=getattr(config, "MultiModelServerConfig", None),
    )


# -- the patches (in the parent) -------------------------------------------------------------
def install(internals, make_lifespan, child_worker) -> None:
    """Replace the model process's entry function with `child_worker` (child.py), wrap the one
    function through which a model process's error reaches the HTTP client, and replace the
    multi-model lifespan with `make_lifespan(multi_config)`."""
    from expert_stream.plugin.redact import redacting

    internals.handler_process._handler_worker = child_worker
    raise_redacted = redacting(internals.Proxy._raise_remote_error)

    def raise_remote_error(self, response):  # called as self._raise_remote_error: the proxy's model
        return raise_redacted(naming_model(response, getattr(self, internals.proxy_id_param, None)))

    internals.Proxy._raise_remote_error = raise_remote_error
    internals.server.create_multi_lifespan = make_lifespan


def naming_model(response: dict, model_id) -> dict:
    """A model process's error response whose texts name its model: the host's own say only
    "Failed to generate text response: ..." (the soak found such errors naming no model). The
    text sits under detail / message, or deeper under detail.error.message."""
    def named(value):
        if isinstance(value, str):
            return value if repr(model_id) in value else f"model {model_id!r}: {value}"
        if isinstance(value, dict):
            return {k: named(v) if k in ("detail", "error", "message") else v for k, v in value.items()}
        return value

    if model_id is None:
        return dict(response)
    return {k: named(v) if k in ("detail", "message") else v for k, v in response.items()}


def drop_prompt_cache_on_errors() -> bool:
    """In a streamed model's process. A generation that fails mid-step (a read error) leaves its
    KV cache updated in some layers and not others, and the host keeps it (1.6.3 stores it in
    its prompt cache in generate_text_stream's `finally`): a later request with the same prefix
    continued from it and answered wrong (the soak found it). The same after a client leaves a
    stream early: the cache stored holds tokens the client never got. Empty the prompt cache
    whenever a generation does not finish. False where this host version has no such methods."""
    import inspect

    import app.handler.mlx_lm as handler_mlx_lm

    handler = getattr(handler_mlx_lm, "MLXLMHandler", None)
    stream = getattr(handler, "generate_text_stream", None)
    response = getattr(handler, "generate_text_response", None)
    if not (inspect.isasyncgenfunction(stream) and inspect.iscoroutinefunction(response)):
        return False

    def forget(self) -> None:
        cache = getattr(self, "prompt_cache", None)
        if callable(getattr(cache, "trim_to", None)):
            cache.trim_to(n_sequences=0)

    async def generate_text_stream(self, *args, **kwargs):
        chunks, finished = stream(self, *args, **kwargs), False
        try:
            async for chunk in chunks:
                yield chunk
            finished = True
        finally:  # failed, or the client left (its cache may hold tokens it never got)
            await chunks.aclose()  # the host's own finally stores the cache first; then it goes
            if not finished:
                forget(self)

    async def generate_text_response(self, *args, **kwargs):
        try:
            return await response(self, *args, **kwargs)
        except BaseException:  # an error, or the request cancelled
            forget(self)
            raise

    handler.generate_text_stream, handler.generate_text_response = generate_text_stream, generate_text_response
    return True


def host_worker():
    """The host's own model-process entry function (in a child, which never patched it)."""
    from app.core import handler_process

    return handler_process._handler_worker


def run_host_cli(argv: list[str]) -> None:
    """mlx-openai-server's own command line, unchanged."""
    import sys

    from app.main import main

    sys.argv = ["mlx-openai-server", *argv]
    main()


# -- the app the host made (its lifespan's conventions) --------------------------------------
def publish_registry(app, registry, default_model_id: str) -> None:
    """What the host's own multi-model lifespan leaves on the app for its routes: the registry,
    and the default model's handler (its routes' single-model fallback)."""
    app.state.registry = registry
    if registry.has_model(default_model_id):
        app.state.handler = registry.get_handler(default_model_id)


# -- the model registry's routing table ------------------------------------------------------
def is_routed(registry, model_id: str) -> bool:
    return model_id in registry._metadata


def swap_handler(registry, model_id: str, handler) -> None:
    """Route a registered id to another handler in one assignment (no await: atomic)."""
    registry._handlers[model_id] = handler


def unroute(registry, model_id: str) -> None:
    registry._handlers.pop(model_id, None)
    registry._metadata.pop(model_id, None)


def handler_type(Proxy, model_type: str) -> str:
    return getattr(Proxy, "_MODEL_TYPE_TO_HANDLER_TYPE", {}).get(model_type, model_type)


# -- a model process proxy -------------------------------------------------------------------
def pending_requests(proxy) -> list[str]:
    """Ids of the requests waiting on the proxy for an answer from its process."""
    return [rid for rid in list(proxy._pending) if rid != READY_ID]


def fail_pending(proxy, message: str, error_type: str) -> int:
    """Answer every request waiting on `proxy` with an error; returns how many there were."""
    busy = pending_requests(proxy)
    for rid in busy:
        queue = proxy._pending.get(rid)
        if queue is None:
            continue
        reply = {"id": rid, "type": "error", "status_code": 503, "error_type": error_type, "message": message}
        while True:
            try:
                queue.put_nowait(reply)
                break
            except asyncio.QueueFull:  # a stream's queue full of chunks: the error goes first
                queue.get_nowait()
    return len(busy)


def process_alive(proxy) -> bool:
    process = getattr(proxy, "_process", None)
    return process is not None and process.is_alive()


def process_ended(proxy) -> bool:
    """The proxy's process started and exited (not: not started yet)."""
    process = getattr(proxy, "_process", None)
    return process is not None and process.exitcode is not None


def exit_code(proxy):
    return getattr(proxy._process, "exitcode", None)


async def call(proxy, method: str, *args):
    """Call a method of the model process's handler through the proxy's RPC."""
    return await proxy._call(method, *args)


# -- the model process's handler (in a child) ------------------------------------------------
def add_handler_methods(**methods) -> None:
    """Methods the parent calls on the model process's handler by name, through the host's own
    RPC (`call`): the status endpoint's stats, a new budget."""
    from app.handler.mlx_lm import MLXLMHandler

    for name, method in methods.items():
        setattr(MLXLMHandler, name, method)


async def on_compute_thread(handler, fn) -> bool:
    """Run `fn` on the thread where the handler runs its model (its inference worker), after
    the request in flight; False, without running it, on a host version without that worker."""
    worker = getattr(handler, "inference_worker", None)
    if worker is None or not inspect.iscoroutinefunction(getattr(worker, "submit", None)):
        return False
    await worker.submit(fn)
    return True
