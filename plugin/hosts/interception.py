"""The one place a host's model load is changed: `mlx_lm.utils.load_model`.

Both hosts load through `mlx_lm.utils.load` (`mlx_lm.load`), which calls the module-level
`load_model`. While a target is set for a checkpoint folder, a call for that folder builds the
model lazily, swaps its expert blocks for streamed ones before
anything is evaluated, then evaluates the trunk if the host asked for an eager load. A call for
any other folder (a dense model, a draft model) runs the stock function untouched. The load
itself is the engine's one load path (`streaming.loader.load_streamed`), handed the host's own
lazy build."""

from __future__ import annotations

import inspect
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from expert_stream.plugin.hosts import prefill_step
from expert_stream.streaming.auto_budget import HandedBudget, ProcessMemory

log = logging.getLogger("expert_stream")


@dataclass(frozen=True)
class Target:
    model_id: str
    settings: dict  # StreamSettings.to_dict()
    budget: Optional[HandedBudget] = None  # an auto budget the host resolved with its other models
    memory: ProcessMemory = ProcessMemory()  # what an auto budget resolved here is sized against
    trust_remote_code: bool = False  # the entry's: a model_file of the checkpoint may run


_lock = threading.RLock()
_targets: dict[str, Target] = {}  # resolved checkpoint folder -> what to stream it with
_handles: dict[str, object] = {}  # model_id -> StreamHandle of the loaded model
_original = None
_signature = None
_busy = threading.local()


def _key(path) -> str:
    return str(Path(path).expanduser().resolve())


def check() -> list[str]:
    """What is wrong with the mlx-lm function this module patches (empty when it fits)."""
    import mlx_lm
    import mlx_lm.utils

    problems = []
    fn = getattr(mlx_lm.utils, "load_model", None)
    if fn is None:
        return [f"mlx_lm.utils.load_model is missing (mlx-lm {mlx_lm.__version__})"]
    params = inspect.signature(_original or fn).parameters
    for name in ("model_path", "lazy"):
        if name not in params:
            problems.append(f"mlx_lm.utils.load_model has no `{name}` parameter (mlx-lm {mlx_lm.__version__})")
    return problems + prefill_step.check()


def install() -> None:
    """Patch `mlx_lm.utils.load_model` (once per process)."""
    global _original, _signature
    import mlx_lm.utils

    with _lock:
        if _original is not None:
            return
        problems = check()
        if problems:
            from expert_stream.plugin.hosts.base import HostError

            raise HostError("; ".join(problems) + ": this mlx-lm is not supported by expert-stream")
        _original = mlx_lm.utils.load_model
        _signature = inspect.signature(_original)
        _load_model.__wrapped__ = _original  # callers that inspect its parameters see mlx-lm's
        mlx_lm.utils.load_model = _load_model
    prefill_step.install()


def set_targets(targets: dict) -> None:
    """Replace the targets: {checkpoint folder: Target}."""
    with _lock:
        _targets.clear()
        _targets.update({_key(path): target for path, target in targets.items()})


def handles() -> dict:
    with _lock:
        return dict(_handles)


def forget(model_id: str) -> None:
    """Close and drop the handle of an unloaded model."""
    with _lock:
        handle = _handles.pop(model_id, None)
    if handle is not None:
        from expert_stream.plugin import plugins

        prefill_step.unregister(handle.model)
        plugins.get_plugin_manager().hook.model_unloading(
            model_id=model_id, model_path=str(handle.model_path), handle=handle)
        handle.close()


def stats() -> dict:
    """model_id -> handle.stats() for every streamed model this process loaded."""
    return {model_id: handle.stats() for model_id, handle in handles().items()}


def _load_model(*args, **kwargs):
    bound = _signature.bind(*args, **kwargs)
    bound.apply_defaults()
    with _lock:
        target = None if getattr(_busy, "on", False) else _targets.get(_key(bound.arguments["model_path"]))
    if target is None:
        return _original(*args, **kwargs)
    return _load_streamed(bound, target)


def _load_streamed(bound, target: Target):
    from expert_stream.plugin import plugins
    from expert_stream.streaming.loader import load_streamed
    from expert_stream.streaming.settings import StreamSettings

    model_path = Path(bound.arguments["model_path"])
    bound.arguments["lazy"] = True  # expert tensors must never be evaluated; the engine evaluates the trunk
    settings = StreamSettings.from_mapping(target.settings, where=f"{target.model_id}.expert_stream")
    _busy.on = True
    try:
        model, config, handle = load_streamed(
            model_path, settings, hooks=plugins.load_hooks(), build=lambda: _original(*bound.args, **bound.kwargs),
            trust_remote_code=target.trust_remote_code, budget=target.budget, memory=target.memory,
            where=f"{target.model_id}.expert_stream")
    finally:
        _busy.on = False
    adopt(target, model, model_path, handle, settings)
    return model, config


def set_budget(model_id: str, budget: HandedBudget) -> Optional[dict]:
    """A running model's new auto budget (the host resolved it again with its other models):
    its layers follow at their next calls. Returns its budget as it stands, or None when the
    model is not loaded here."""
    handle = handles().get(model_id)
    if handle is None:
        return None
    handle.set_budget(budget.bytes, budget.explained)
    return handle.budget.as_dict()


def apply_budget(model_id: str) -> None:
    """Move the model's slots to its budget now: only between two of its forward passes."""
    handle = handles().get(model_id)
    if handle is not None:
        handle.apply_budget()


def target_for(path):
    """The Target of a checkpoint folder, or None (not streamed: the host loads it as always)."""
    with _lock:
        return _targets.get(_key(path))


@contextmanager
def stock_loads():
    """`load_model` calls inside run the stock function (a loader that streams by itself)."""
    _busy.on = True
    try:
        yield
    finally:
        _busy.on = False


def adopt(target: Target, model, model_path: Path, handle, settings) -> None:
    """Record a streamed model this process loaded (replacing the entry's previous one)."""
    from expert_stream.plugin import plugins

    old = None
    with _lock:
        old = _handles.pop(target.model_id, None)
        _handles[target.model_id] = handle
    if old is not None:
        prefill_step.unregister(old.model)
        old.close()
    prefill_step.register(model, settings.prefill_step, handle.decode, handle.prefill)  # a request's start ends a decode run
    log.info("expert-stream: %s streams %s with a %.3f GiB budget%s", target.model_id, model_path,
             handle.budget.target_bytes / 2**30, " (auto)" if handle.budget.auto else "")
    plugins.get_plugin_manager().hook.model_loaded(model_id=target.model_id, model_path=str(model_path),
                                                   handle=handle)
