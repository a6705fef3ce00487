"""The `prefill_step` setting, applied where both hosts (and `mlx_lm.generate`) chunk a prompt:
`mlx_lm.generate.generate_step`'s `prefill_step_size`, and `speculative_generate_step`'s when
the host decodes with a draft model (it prefills the draft in the same chunks).

The hosts pass their own step (mlx_lm.server its `--prefill-step-size`, mlx-openai-server
mlx-lm's default), the same for every model. For a streamed model the chunk size decides how
often the prefill sweep reads each expert (once per chunk), so its entry's `prefill_step` wins;
any other model gets the host's value untouched.

It is also where a generation starts, on the thread that runs it: the streamed model's decode
clock starts a new run there (a prompt answered from the prompt cache can begin with a
single-token call, which the clock alone would take for the next decode step). With a draft
model the clock counts the tokens the generation yields (decode_clock.py says why)."""

from __future__ import annotations

import threading
import weakref

from expert_stream.plugin.hosts import layer_major

_lock = threading.Lock()
# id(model) of a loaded streamed model -> (a weak reference to it, its prefill_step, its
# decode_clock.DecodeClock or None); the reference guards against a later model that reuses a
# freed model's id.
_steps: dict[int, tuple] = {}
_original = None
_original_speculative = None


def check() -> list[str]:
    """What is wrong with the mlx-lm function this module wraps (empty when it fits)."""
    import importlib
    import inspect

    generate = importlib.import_module("mlx_lm.generate")
    problems = []
    for name, fn, head in (("generate_step", _original, ["prompt", "model"]),
                           ("speculative_generate_step", _original_speculative, ["prompt", "model", "draft_model"])):
        fn = fn or getattr(generate, name, None)
        params = list(inspect.signature(fn).parameters) if fn else []
        if params[:len(head)] != head or "prefill_step_size" not in params:
            problems.append(f"mlx_lm.generate.{name}({', '.join(head)}, prefill_step_size=...) is missing")
    return problems


def install() -> None:
    """Wrap `mlx_lm.generate.generate_step` and `speculative_generate_step` (once per process);
    stream_generate calls them by their module-level names."""
    global _original, _original_speculative
    import importlib

    generate = importlib.import_module("mlx_lm.generate")  # `mlx_lm.generate` the attribute is a function

    with _lock:
        if _original is not None:
            return
        _original, _original_speculative = generate.generate_step, generate.speculative_generate_step
        generate.generate_step, generate.speculative_generate_step = _generate_step, _speculative_generate_step


def register(model, prefill_step: int, clock=None, prefill=None) -> None:
    """`clock`: the model's decode_clock.DecodeClock (a generation's start begins a new run);
    `prefill`: its prompt_pass.PromptPrefill (a long prompt prefills layer-major)."""
    with _lock:
        _steps[id(model)] = (weakref.ref(model), int(prefill_step), clock, prefill)


def unregister(model) -> None:
    with _lock:
        _steps.pop(id(model), None)


def _registered(model):
    """(prefill_step, clock, prefill) of a registered streamed model, or None."""
    with _lock:
        ref, step, clock, prefill = _steps.get(id(model), (None, None, None, None))
    return (step, clock, prefill) if ref is not None and ref() is model else None


def _generate_step(prompt, model, *args, **kwargs):
    found = _registered(model)
    if found is None:
        return _original(prompt, model, *args, **kwargs)
    kwargs["prefill_step_size"], clock, prefill = found
    if clock is not None:
        clock.new_run()
    if prefill is not None and layer_major.serves(prefill, prompt, kwargs):
        return layer_major.generate(_original, prefill, prompt, model, args, kwargs)
    return _original(prompt, model, *args, **kwargs)


def _speculative_generate_step(prompt, model, draft_model, *args, **kwargs):
    found = _registered(model)
    if found is None:
        return _original_speculative(prompt, model, draft_model, *args, **kwargs)
    kwargs["prefill_step_size"], clock, _ = found  # a draft model prefills chunk by chunk
    steps = _original_speculative(prompt, model, draft_model, *args, **kwargs)
    return steps if clock is None else _counted(steps, clock, len(prompt) - 1)


def _counted(steps, clock, prefilled: int):
    """The speculative generation's tokens, each counted by the clock as it is yielded, and
    the `prefilled` prompt tokens its stock loop prefills (all but the last)."""
    with clock.counting_yields():
        clock.prefilled(prefilled)
        for step in steps:
            clock.generated()
            yield step
