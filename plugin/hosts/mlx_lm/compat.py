"""Every mlx_lm.server internal the adapter touches, and nowhere else: the start-up check of all
of them (`check`), the patches (`ModelProvider` and its private `_load`, the HTTP handler's
methods, `ResponseGenerator.generate`, and in pipeline mode `sharded_load` and the request
loop), and the reads and writes of the provider's name maps, loaded-model key and batching
flag. A mlx-lm whose internals differ is refused by `check` before anything starts, with a
message naming the version and each internal that does not fit."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from expert_stream.plugin.hosts.base import parameter_names, refuse, source


def check(host: str, version: str) -> SimpleNamespace:
    import mlx_lm.server as server
    import mlx_lm.utils
    from expert_stream.plugin.hosts import interception

    problems = []
    provider = getattr(server, "ModelProvider", None)
    if parameter_names(getattr(provider, "load", None))[:4] != ["self", "model_path", "adapter_path", "draft_model_path"]:
        problems.append("ModelProvider.load(model_path, adapter_path, draft_model_path) is missing")
    if not callable(getattr(provider, "_load", None)):
        problems.append("ModelProvider._load is missing")
    init_source = source(provider.__init__) if provider else ""
    for attr in ("_model_map", "_adapter_map", "_draft_model_map", "model_key", "is_batchable"):
        if attr not in init_source:
            problems.append(f"ModelProvider.{attr} is missing")
    handler = getattr(server, "APIHandler", None)
    for method in ("do_GET", "do_POST", "do_OPTIONS"):
        if not callable(getattr(handler, method, None)):
            problems.append(f"APIHandler.{method} is missing")
    generator = getattr(server, "ResponseGenerator", None)
    if parameter_names(getattr(generator, "generate", None))[:3] != ["self", "request", "generation_args"]:
        problems.append("ResponseGenerator.generate(request, generation_args) is missing")
    if not callable(getattr(server, "main", None)):
        problems.append("mlx_lm.server.main is missing")
    if getattr(server, "load", None) is not mlx_lm.utils.load:
        problems.append("mlx_lm.server does not load through mlx_lm.utils.load")
    problems += interception.check()
    refuse(host, version, problems)
    return SimpleNamespace(version=version, server=server, Provider=provider, APIHandler=handler,
                           ResponseGenerator=generator)


def patch_provider(Provider, on_init, before_load, dropping, after_load) -> None:
    """Wrap ModelProvider: `on_init(provider, cli_args)` after its __init__;
    `before_load(provider, requested, draft)` before `load`, mlx_lm.server's own safe point
    between requests on the generation thread (`draft`: the draft model's folder or hub id the
    request gets, None without one); `dropping(provider)` when `_load` starts (it drops the
    model it held, to load another: one at a time); `after_load(provider, folder, seconds)`
    after `_load`, which actually loads a model (`folder` resolved)."""
    original_init, original_load, original__load = Provider.__init__, Provider.load, Provider._load

    def __init__(self, cli_args):
        original_init(self, cli_args)
        on_init(self, cli_args)

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        before_load(self, model_path, self._draft_model_map.get(draft_model_path, draft_model_path))
        return original_load(self, model_path, adapter_path, draft_model_path)

    def _load(self, model_path, *args, **kwargs):
        t0 = time.perf_counter()
        dropping(self)
        original__load(self, model_path, *args, **kwargs)
        after_load(self, str(Path(model_path).resolve()), round(time.perf_counter() - t0, 2))

    Provider.__init__, Provider.load, Provider._load = __init__, load, _load


def wrap_generate(Generator, wrap) -> None:
    """ResponseGenerator.generate becomes `wrap(generate)` (the plugin's errors reach clients as
    text through it)."""
    Generator.generate = wrap(Generator.generate)


def requested_model(args, kwargs):
    """The model a `ResponseGenerator.generate(self, request, generation_args, ...)` call asks for
    (its served name, "default_model", or None)."""
    generation_args = kwargs.get("generation_args", args[2] if len(args) > 2 else None)
    return getattr(getattr(generation_args, "model", None), "model", None)


def patch_handler(Handler, on_get, on_post, on_options, on_post_error) -> None:
    """APIHandler's do_GET, do_POST and do_OPTIONS first offer the request to `on_*(handler)`,
    which answers it and returns True, or returns False: the host's own method answers. An
    exception out of the host's do_POST (mlx_lm.server lets body checks and errors raised while
    it generates escape, and the client sees the connection close) goes to
    `on_post_error(handler, exc, started, stream, body)`: `started` when the response's headers
    went out, `stream` and `body` as the host parsed them (None before it did)."""
    original_get, original_post, original_options = Handler.do_GET, Handler.do_POST, Handler.do_OPTIONS

    def do_GET(self):
        if not on_get(self):
            original_get(self)

    def do_POST(self):
        if on_post(self):
            return
        sent = []

        def end_headers():  # on the instance: the class's own still runs
            sent.append(True)
            Handler.end_headers(self)

        self.end_headers = end_headers
        try:
            original_post(self)
        except Exception as exc:
            if not sent:  # a status line still buffered (a plain answer's 200) is dropped: http.server's buffer
                self._headers_buffer = []
            on_post_error(self, exc, bool(sent), getattr(self, "stream", False), getattr(self, "body", None))

    def do_OPTIONS(self):
        if not on_options(self):
            original_options(self)

    Handler.do_GET, Handler.do_POST, Handler.do_OPTIONS = do_GET, do_POST, do_OPTIONS


def set_names(provider, removed, entries) -> None:
    """Drop the removed served names from the provider's name maps, and map each entry's name
    to its folder and adapter."""
    for alias in removed:
        provider._model_map.pop(alias, None)
        provider._adapter_map.pop(alias, None)
    for entry in entries:
        path = str(entry.resolved_path())
        provider._model_map[entry.model_id] = path
        adapter = entry.host_entry.get("adapter_path")
        # mlx-lm 0.31 looks adapters up by folder, 0.32 by the requested name.
        provider._adapter_map[entry.model_id] = adapter
        provider._adapter_map[path] = adapter


def set_default(provider, folder: str) -> None:
    """What a request without a `model` (or naming `default_model`) gets."""
    provider._model_map["default_model"] = folder


def loaded_folder(provider) -> Optional[str]:
    """The folder of the model the provider holds now, as the host recorded it (None: none)."""
    key = getattr(provider, "model_key", None)
    return key[0] if key else None


def forget_loaded(provider) -> None:
    """Make the provider's next `load` load again (a changed entry's new settings)."""
    provider.model_key = None


def serve_one_at_a_time(provider) -> None:
    provider.is_batchable = False


# -- pipeline mode (pipeline_mode.py) ---------------------------------------------------------

def pipeline_problems(server) -> list[str]:
    """What pipeline mode needs of mlx_lm.server beyond `check`: its sharded_load, the first
    load, and the point every rank passes together between requests."""
    import inspect

    import mlx_lm
    import mlx_lm.utils

    problems = []
    fn = getattr(mlx_lm.utils, "sharded_load", None)
    names = list(inspect.signature(fn).parameters) if fn else []
    if names[:4] != ["repo", "pipeline_group", "tensor_group", "return_config"]:
        problems.append(f"mlx_lm.utils.sharded_load(repo, pipeline_group, tensor_group, return_config) is "
                        f"missing (mlx-lm {mlx_lm.__version__})")
    if getattr(server, "sharded_load", None) is not fn:
        problems.append("mlx_lm.server does not load through mlx_lm.utils.sharded_load")
    for cls, attr in ((server.ModelProvider, "load_default"), (server.ResponseGenerator, "_next_request")):
        if not callable(getattr(cls, attr, None)):
            problems.append(f"{cls.__name__}.{attr} is missing")
    return problems


def replace_sharded_load(internals, wrap) -> bool:
    """mlx_lm.server loads through `sharded_load`, imported into its own namespace from
    mlx_lm.utils: both names become `wrap(sharded_load)`. False (nothing replaced) when this
    mlx_lm.server has none."""
    import mlx_lm.utils

    if getattr(internals.server, "sharded_load", None) is None:
        return False
    mlx_lm.utils.sharded_load = internals.server.sharded_load = wrap(mlx_lm.utils.sharded_load)
    return True


def hook_request_loop(internals, first_load_failed, between_requests) -> None:
    """A failing first load calls `first_load_failed(exc)` instead of raising; after each
    request is shared among the ranks, `between_requests(model)` runs on every rank."""
    Provider, Generator = internals.Provider, internals.ResponseGenerator
    original_default, original_next = Provider.load_default, Generator._next_request

    def load_default(self):
        try:
            original_default(self)
        except Exception as exc:
            first_load_failed(exc)

    def _next_request(self, *args, **kwargs):
        request = original_next(self, *args, **kwargs)
        between_requests(self.model_provider.model)
        return request

    Provider.load_default, Generator._next_request = load_default, _next_request
