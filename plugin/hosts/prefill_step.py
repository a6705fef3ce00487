"""The `prefill_step` setting, applied where both hosts (and `mlx_lm.generate`) chunk a prompt:
`mlx_lm.generate.generate_step`'s `prefill_step_size`.

The hosts pass their own step (mlx_lm.server its `--prefill-step-size`, mlx-openai-server
mlx-lm's default), the same for every model. For a streamed model the chunk size decides how
often the prefill sweep reads each expert (once per chunk), so its entry's `prefill_step` wins;
any other model gets the host's value untouched.

It is also where a generation starts, on the thread that runs it: the streamed model's decode
clock starts a new run there (a prompt answered from the prompt cache can begin with a
single-token call, which the clock alone would take for the next decode step)."""

from __future__ import annotations

import threading
import weakref

_lock = threading.Lock()
# id(model) of a loaded streamed model -> (a weak reference to it, its prefill_step, what to
# call as a generation starts); the reference guards against a later model that reuses a freed
# model's id.
_steps: dict[int, tuple] = {}
_original = None


def check() -> list[str]:
    """What is wrong with the mlx-lm function this module wraps (empty when it fits)."""
    import importlib
    import inspect

    fn = _original or getattr(importlib.import_module("mlx_lm.generate"), "generate_step", None)
    if fn is None or "prefill_step_size" not in inspect.signature(fn).parameters:
        return ["mlx_lm.generate.generate_step(prompt, model, prefill_step_size=...) is missing"]
    return []


def install() -> None:
    """Wrap `mlx_lm.generate.generate_step` (once per process); stream_generate calls it by
    its module-level name."""
    global _original
    import importlib

    generate = importlib.import_module("mlx_lm.generate")  # `mlx_lm.generate` the attribute is a function

    with _lock:
        if _original is not None:
            return
        _original = generate.generate_step
        generate.generate_step = _generate_step


def register(model, prefill_step: int, on_start=None) -> None:
    with _lock:
        _steps[id(model)] = (weakref.ref(model), int(prefill_step), on_start)


def unregister(model) -> None:
    with _lock:
        _steps.pop(id(model), None)


def _generate_step(prompt, model, *args, **kwargs):
    with _lock:
        ref, step, on_start = _steps.get(id(model), (None, None, None))
    if ref is not None and ref() is model:
        kwargs["prefill_step_size"] = step
        if on_start is not None:
            on_start()
    return _original(prompt, model, *args, **kwargs)
