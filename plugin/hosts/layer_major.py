"""A streamed model's prompt through mlx-lm's `generate_step`, prefilled layer-major
(streaming/prompt_pass.py): the same chunks as stock's loop, the same cache, the same progress
calls; then stock's own generate_step runs from the prompt's last token with the filled cache, so
sampling, logits processors and decode are stock's code.

Kept on stock's chunk-by-chunk loop (each chunk one sweep of the experts): a prompt of one chunk
(nothing to share), quantized KV (`kv_bits`: stock quantizes the cache between chunks), input
embeddings (VLM prompts), a pipeline rank (its layers wait on other ranks' sends), a family
prompt_pass.PER_CHUNK_FAMILIES names, and `prefill_window: 0`."""

from __future__ import annotations

import importlib

import mlx.core as mx


def serves(prefill, prompt, kwargs) -> bool:
    """Whether this generate_step call prefills layer-major (`prefill`: the model's PromptPrefill)."""
    if prefill.window <= 0 or prefill.refusal() is not None:
        return False
    if kwargs.get("input_embeddings") is not None or kwargs.get("kv_bits") is not None:
        return False
    return len(prompt) - 1 > kwargs["prefill_step_size"]


def generate(original, prefill, prompt, model, args, kwargs):
    """generate_step's tokens, its prompt but the last token prefilled layer-major first. A
    generator, as stock's: nothing runs before the first token is asked for."""
    from mlx_lm.models.cache import make_prompt_cache

    generate_module = importlib.import_module("mlx_lm.generate")
    # mlx-lm 0.32 takes the stream third (positional or not); 0.31 always uses its module's.
    stream = kwargs.get("stream", args[0] if args else generate_module.generation_stream)
    cache = kwargs.get("prompt_cache")
    if cache is None:
        cache = make_prompt_cache(model, max_kv_size=kwargs.get("max_kv_size"))
    kwargs["prompt_cache"] = cache
    callback = kwargs.get("prompt_progress_callback") or (lambda *_: None)
    total, done = len(prompt), len(prompt) - 1
    with mx.stream(stream):
        prefill.prefill(model, prompt, cache, kwargs["prefill_step_size"], callback)
    # stock's last calls are (total - 1, total) then (total, total): the rest's own (0, 1) is one too many
    kwargs["prompt_progress_callback"] = lambda p, t: p and callback(done + p, total)
    if kwargs.get("logits_processors") and _prefill_feeds_processors():
        kwargs["logits_processors"] = [_with_head(p, prompt[:done]) for p in kwargs["logits_processors"]]
    yield from original(prompt[done:], model, *args, **kwargs)


def _prefill_feeds_processors() -> bool:
    """mlx-lm 0.32's prefill adds each chunk's tokens to the history logits processors see
    (0.31's shows them only the tokens from the last prompt token on)."""
    import mlx_lm

    major, minor = (int(p) for p in mlx_lm.__version__.split(".")[:2])
    return (major, minor) >= (0, 32)


def _with_head(processor, head: mx.array):
    """A logits processor seeing the prefilled tokens before its history, as in stock's loop."""
    return lambda tokens, logits: processor(mx.concat([head, tokens]), logits)
