"""Layer-major prefill: one read of each expert a prompt needs, per streamed layer, however many
prefill chunks the prompt has.

Stock mlx-lm prefills a prompt chunk by chunk (`prefill_step` tokens each), every chunk through
every layer. Layer-major order is just as valid a dependency order for the same chunks: chunk c
at layer L needs chunk c's output of layer L-1 and the KV of chunks before c at layer L, nothing
else. So each chunk's forward pass runs in its own greenlet (same OS thread: MLX's thread-local
streams are the caller's) and parks at every streamed layer; once every chunk waits at the same
layer, that layer computes all chunks' calls from one sweep over the experts
(`StreamedSwitch.call_chunks`), and the chunks resume in chunk order, so each layer's KV cache is
appended in stock's order and every chunk's call keeps stock's shape (the bits are stock's).
The chunks' logits are dropped unevaluated: stock's prefill never looks at them either.

A prompt longer than the window (tokens whose activations live at once) goes in several passes,
each of whole chunks. The window is `prefill_window`, or fewer tokens where the memory left under
the process's limit holds fewer tokens' activations (`activation_bytes`), never less than one
chunk (stock's own peak).

A layer's reads need not wait for its sweep: its routing reaches the host chunk by chunk, and
the experts each chunk names start reading into host rows while the later chunks' attention
computes (`prefill_readahead_gib` of rows, what the memory left beside the window's activations
holds; decode_paths.route_chunks). Only experts the layer needs are read, each once.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
from greenlet import GreenletExit, greenlet

from .guess_buffer import GuessPool
from .slots import expert_bytes

# Families whose stock forward pass cannot be reordered layer-major without changing a bit, and
# why; they keep one sweep per chunk. Found by tests/engine/test_prompt_pass.py over every preset.
_LATER_CACHE = ("its forward pass builds the attention mask (and the rope offset) from the cache of a "
                "later layer than the first streamed one, which the other chunks have not reached yet")
PER_CHUNK_FAMILIES: dict[str, str] = {
    "kimi_linear": _LATER_CACHE,  # cache[attn_idx], its first MLA layer, with return_array=True
    "bailing_moe_linear": _LATER_CACHE,  # cache[attn_idx] = layer_group_size - 1, and its offset
    "bailing_moe_v3": _LATER_CACHE,  # mlx-lm 0.32: its first MLA layer's cache, return_array=True
    "bailing_hybrid": _LATER_CACHE,  # mlx-lm 0.32: cache[_attn_idx], return_array=True
    "kimi_k3": _LATER_CACHE,  # mlx-lm 0.32: cache[attn_idx]; a stale offset's mask does not even fit
}


log = logging.getLogger("expert_stream")

# Kept free beside a pass's activations: the allocator's slack, the attention temporaries of
# the one chunk evaluated at a time (decode_paths.route_chunks), the scratch buffers' growth.
PASS_MARGIN_BYTES = 512 << 20


def readahead_experts(nbytes: int, expert_bytes_: int, most_experts: int) -> int:
    """Experts a layer's read-ahead rows hold in `nbytes` (never more than a layer has)."""
    return int(min(max(nbytes, 0) // max(expert_bytes_, 1), most_experts))


def activation_bytes(model, config: dict, top_k: int | None) -> int:
    """Bytes a prompt pass holds per token at a streamed layer: the layer's input and the
    residual beside it, the routed pairs' outputs and their stitched copy (2 x top_k), the
    combined output; each a hidden-size vector of the activation dtype. Stock's prefill holds
    the same for one chunk (streaming/lab/MEASUREMENTS.md has the measured slope)."""
    from mlx.utils import tree_flatten

    cfg = config.get("text_config") or config
    hidden = int(cfg.get("hidden_size") or cfg.get("dim") or 0)
    floats = [(name, a.dtype.size) for name, a in tree_flatten(model.parameters())
              if hasattr(a, "dtype") and mx.issubdtype(a.dtype, mx.floating)]
    norms = [size for name, size in floats if "norm" in name]  # norms keep the activation dtype
    itemsize = norms[0] if norms else max((size for _, size in floats), default=2)
    return hidden * itemsize * (2 * (top_k or 1) + 4)


class ChunkRunner(greenlet):
    """One prefill chunk's forward pass, parked at each streamed layer it reaches."""


def _park(layer, x: mx.array, indices: mx.array) -> mx.array:
    """A streamed layer's call inside a pass: hand (x, indices) to the driver, get the output."""
    runner = greenlet.getcurrent()
    if not isinstance(runner, ChunkRunner):
        raise RuntimeError(f"{layer.store.name}: called outside its prompt pass while one runs (one "
                           "generation at a time per streamed model)")
    return runner.parent.switch((layer, x, indices))


def _forward(model, chunk: mx.array, cache) -> None:
    model(chunk[None], cache=cache)  # logits dropped unevaluated: stock never reads a chunk's


def chunk_sizes(tokens: int, step: int) -> list[int]:
    """Stock generate_step's chunks of a prompt of `tokens` (its last token is decode's first
    step, not prefill)."""
    sizes, left = [], tokens - 1
    while left > 0:
        sizes.append(min(step, left))
        left -= sizes[-1]
    return sizes


def windows(sizes: list[int], window: int) -> list[list[int]]:
    """Chunks grouped into passes of at most `window` tokens (a chunk longer than that alone)."""
    passes, current = [], []
    for n in sizes:
        if current and sum(current) + n > window:
            passes.append(current)
            current = []
        current.append(n)
    return passes + ([current] if current else [])


@dataclass
class PrefillProgress:
    """A prefill in progress, for status and metrics (the compute thread writes it)."""

    tokens_total: int = 0
    tokens_done: int = 0  # every layer done with them (a pass's tokens advance layer by layer)
    bytes_at_start: int = 0
    started: float = 0.0
    tokens_per_pass: int = 0

    def as_dict(self, bytes_now: int) -> dict:
        return {"tokens_done": self.tokens_done, "tokens_total": self.tokens_total,
                "bytes_read": bytes_now - self.bytes_at_start, "seconds": time.monotonic() - self.started,
                "tokens_per_pass": self.tokens_per_pass}


class PromptPrefill:
    """Layer-major prefill of one streamed model (its StreamedSwitch layers in model order)."""

    def __init__(self, layers, model_type: str, window: int, bytes_read, name: str = "", readahead_bytes: int = 0):
        self.layers = layers
        self.name = name or model_type  # the model, for the log
        self.model_type = model_type
        self.window = window  # tokens per pass
        self.readahead_bytes = readahead_bytes  # host rows for experts read as routing arrives
        self._expert_bytes = max((expert_bytes(l.store.slots.tensors) for l in layers), default=0)
        self._most_experts = max((l.store.cache.num_experts for l in layers), default=0)
        self._bytes_read = bytes_read  # () -> the model's expert bytes read so far
        self._lock = threading.Lock()
        self._progress: PrefillProgress | None = None
        self._refused: str | None = None  # set by the loader where the model itself forbids it
        self.token_bytes = 0  # activations per prompt token; 0: not sized, the window as set
        self._room = None  # (prompt tokens) -> bytes this process may still take, for activations

    def size_by(self, token_bytes: int, room) -> None:
        """Passes fit their activations (`token_bytes` a token) into `room(prompt tokens)` bytes."""
        self.token_bytes, self._room = token_bytes, room

    def window_for(self, step: int, tokens: int) -> int:
        """Tokens per pass now: the setting, or the whole chunks whose activations fit the
        memory left (at least one chunk: stock's peak)."""
        if not self.token_bytes or self._room is None:
            return self.window
        fits = max(self._room(tokens) - PASS_MARGIN_BYTES, 0) // self.token_bytes
        return min(self.window, max(step, fits // step * step))

    def readahead_for(self, window: int, tokens: int) -> int:
        """Experts a layer reads ahead of its sweep in a pass of `window` tokens: the rows the
        setting pays for, or fewer where the memory left beside the pass's activations is short."""
        nbytes = self.readahead_bytes
        if self.token_bytes and self._room is not None:
            nbytes = min(nbytes, self._room(tokens) - PASS_MARGIN_BYTES - min(window, tokens) * self.token_bytes)
        return readahead_experts(nbytes, self._expert_bytes, self._most_experts)

    def keep_per_chunk(self, reason: str) -> None:
        """This model prefills chunk by chunk, for `reason` (a pipeline rank)."""
        self._refused = reason

    def refusal(self) -> str | None:
        """Why this model prefills chunk by chunk instead, or None."""
        if not self.layers:
            return "no streamed layer"
        return self._refused or PER_CHUNK_FAMILIES.get(self.model_type)

    def progress(self) -> dict | None:
        """The prefill running now (tokens done of total, bytes read), or None."""
        with self._lock:
            p = self._progress
            return None if p is None else p.as_dict(self._bytes_read())

    def prefill(self, model, prompt: mx.array, cache, step: int, on_progress=None) -> None:
        """Stock's prefill of `prompt` (1-D tokens) into `cache`, but its last token, in stock's
        chunks of `step`, layer-major. `on_progress(done, total)` as stock's callback."""
        total = int(prompt.size)
        on_progress = on_progress or (lambda *_: None)
        window = self.window_for(step, total)
        if window < min(self.window, total - 1):
            log.info("%s: prefill of %d tokens in passes of %d (prefill_window %d): the memory left holds "
                     "activations of %d bytes a token for that many", self.name, total, window, self.window,
                     self.token_bytes)
        readahead = self.readahead_for(window, total)
        pool = GuessPool(readahead, readahead=True) if readahead else None  # freed with the prefill
        for layer in self.layers:
            layer.store.readahead_pool = pool
        with self._lock:
            self._progress = PrefillProgress(total, 0, self._bytes_read(), time.monotonic(), window)
        try:
            on_progress(0, total)
            start = 0
            for sizes in windows(chunk_sizes(total, step), window):
                chunks = []
                for n in sizes:
                    chunks.append(prompt[start : start + n])
                    start += n
                self._pass(model, chunks, cache, on_progress, start - sum(sizes), total)
                mx.eval([c.state for c in cache])
                mx.clear_cache()
                self._advance(start, on_progress, total)
        finally:
            for layer in self.layers:
                layer.store.readahead_pool = None
            with self._lock:
                self._progress = None

    def _advance(self, done: int, on_progress, total: int) -> None:
        with self._lock:
            self._progress.tokens_done = done
        on_progress(done, total)

    def _pass(self, model, chunks, cache, on_progress, before: int, total: int) -> None:
        runners = [ChunkRunner(partial(_forward, model, chunk, cache)) for chunk in chunks]
        tokens = sum(int(c.size) for c in chunks)
        for layer in self.layers:
            object.__setattr__(layer, "prompt_pass", _park)
        try:
            parked = [r.switch() for r in runners]
            done_layers = 0
            while not all(r.dead for r in runners):
                if any(r.dead for r in runners) or any(p[0] is not parked[0][0] for p in parked):
                    raise RuntimeError("the chunks of a prompt pass reached different layers")
                layer = parked[0][0]
                ys = layer.call_chunks([p[1] for p in parked], [p[2] for p in parked])
                done_layers += 1
                # Progress by layers: a pass's tokens are done when the last layer is.
                self._advance(before + tokens * min(done_layers, len(self.layers)) // (len(self.layers) + 1), on_progress,
                              total)
                parked = [r.switch(y) for r, y in zip(runners, ys)]
                del ys  # else this layer's outputs outlive the next layer's sweep: one more top_k term
        finally:
            for layer in self.layers:
                object.__setattr__(layer, "prompt_pass", None)
            for r in runners:
                if not r.dead:
                    r.throw(GreenletExit)
