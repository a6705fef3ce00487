"""Routing lookahead: during decode, layer l guesses which experts the next MoE layer will pick
and starts reading the missing ones while layer l (and the next attention) computes.

The guess applies the next layer's router to layer l's expert input. That input is
`rms(h) * w_l` (layer l's norm); the next router sees `rms(h') * w_next` where h' differs from
h by one attention and one MoE output, so `x * (w_next / w_l)` is the next router's input up to
that drift. The guess is evaluated together with layer l's own routing (no extra sync).
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .architectures import NORM_NAMES, ROUTER_NAMES

# A layer turns its lookahead off when fewer than this share of its guesses are experts the next
# layer then uses: a wrong guess costs a read and a slot that real misses need ...
MIN_GUESS_HIT_SHARE = 0.3
# ... judged over windows of this many guessed experts,
WINDOW_GUESSES = 128
# A layer also turns it off when fewer than this share of its reads of guessed experts were used
# before eviction (a right guess that was already resident costs nothing; a read does) ...
MIN_READ_PRECISION = 0.5
# ... judged over windows of this many reads,
WINDOW_READS = 32
# ... and tries again after this many calls, since routing drifts with the text.
RETRY_AFTER_CALLS = 512


def router_scores(block: nn.Module) -> Optional[Callable[[mx.array], mx.array]]:
    """A function x -> scores whose top-k are the experts `block` routes x to (up to group
    limits), from the block's router: a Linear / QuantizedLinear (or another module holding
    quantized `weight` and `scales`, called as it is), or a gate holding `weight`
    (DeepSeek-style sigmoid scores plus a correction bias)."""
    for name in ROUTER_NAMES:
        router = block.get(name) if isinstance(block, dict) else None
        if router is None:
            continue
        if isinstance(router, (nn.Linear, nn.QuantizedLinear)):
            return router
        if isinstance(router, nn.Module) and "scales" in router:
            # another quantized linear (prism_hadamard_qwen35's Hadamard-rotated one): its
            # `weight` is packed codes, so only calling it scores
            return router
        weight = router.get("weight") if isinstance(router, nn.Module) else None
        if isinstance(weight, mx.array) and weight.ndim == 2:
            bias = router.get("e_score_correction_bias")
            if isinstance(bias, mx.array):
                return lambda x, w=weight, b=bias: mx.sigmoid(x @ w.T) + b
            return lambda x, w=weight: x @ w.T
    return None


def block_router(block: nn.Module, router_hook=None):
    """The scoring function of a block's router: the architecture's hook when it registered
    one (ArchitectureSpec.router), else what router_scores finds."""
    return router_hook(block) if router_hook else router_scores(block)


def _norm_weight(layer: nn.Module) -> Optional[mx.array]:
    for name in NORM_NAMES:
        norm = layer.get(name) if isinstance(layer, dict) else None
        if isinstance(norm, nn.RMSNorm):
            return norm.weight
    return None


class RouterProbe:
    """Guesses a block's experts from another layer's normalised input."""

    def __init__(self, logits: Callable[[mx.array], mx.array], scale: mx.array, count: int):
        self.logits = logits
        self.scale = scale
        self.count = count

    def guess(self, x: mx.array) -> mx.array:
        """Lazy: the `count` most likely experts for the last token, most confident first."""
        scores = self.logits(x.reshape(-1, x.shape[-1])[-1:] * self.scale)[0]
        return mx.argsort(-scores.astype(mx.float32))[: self.count]


def make_probe(model: nn.Module, path_l: str, path_next: str, count: int, router_hook=None):
    """A probe for the block at path_next, fed with the input of the block at path_l, or None
    when the architecture does not show a router or RMSNorm weights to rescale."""
    block_next = module_at(model, path_next.rsplit(".", 1)[0])
    layer_l = module_at(model, path_l.rsplit(".", 2)[0])
    layer_next = module_at(model, path_next.rsplit(".", 2)[0])
    logits = block_router(block_next, router_hook)
    w_l, w_next = _norm_weight(layer_l), _norm_weight(layer_next)
    if logits is None or w_l is None or w_next is None:
        return None
    # The probe rescales layer l's expert input, which is the normed residual only when the
    # experts run at the model's width: kimi_k3's latent MoE feeds them a down-projection.
    if _expert_input_width(module_at(model, path_l)) != w_l.size:
        return None
    safe = mx.where(w_l == 0, 1, w_l)
    scale = mx.where(w_l == 0, 0, w_next / safe)
    # Evaluated here: hosts generate on another thread, where a graph built on the loading
    # thread's stream cannot run.
    mx.eval(scale)
    return RouterProbe(logits, scale, count)


def _expert_input_width(block: nn.Module) -> Optional[int]:
    """The input width of a (streamed or stock) expert block: that of the stacked linear its
    input enters (SwitchGLU's gate_proj, SwitchMLP's fc1); None for another kind of block."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    inner = block.get("inner", block) if isinstance(block, dict) else block
    for name in ("gate_proj", "fc1"):
        module = inner.get(name) if isinstance(inner, dict) else None
        if isinstance(module, QuantizedSwitchLinear):
            return module["scales"].shape[-1] * module.group_size
        if isinstance(module, SwitchLinear):
            return module["weight"].shape[-1]
    return None


def module_at(model: nn.Module, path: str):
    node = model
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


class Lookahead:
    """Layer l's lookahead into a later streamed layer (`depth` streamed layers ahead), with its
    on/off bookkeeping."""

    def __init__(self, probe: RouterProbe, target, per_call: int, depth: int = 1):
        self.probe = probe
        self.target = target  # the guessed layer's ExpertStore
        self.per_call = per_call
        self.depth = depth
        self.active = True
        self._calls_off = 0
        self._window_start = (0, 0)  # target's (guesses, guess_hits) when the window began
        self._reads_start = (0, 0)  # target's (prefetch_reads, prefetch_hits) likewise

    def restart_windows(self) -> None:
        """The target's counters were reset: judge from here on."""
        self._window_start, self._reads_start = self._counts(), self._read_counts()

    def guess(self, x: mx.array) -> Optional[mx.array]:
        if not self.active:
            self._calls_off += 1
            if self._calls_off >= RETRY_AFTER_CALLS:
                self.active, self._calls_off = True, 0
                self.restart_windows()
            return None
        return self.probe.guess(x)

    def issue(self, guessed: np.ndarray) -> None:
        """Start reading the guessed experts the target lacks, most confident first."""
        self.target.prefetch(guessed, self.per_call, self.depth)
        if _window_failed(self._counts(), self._window_start, WINDOW_GUESSES, MIN_GUESS_HIT_SHARE):
            self.active = False
        if _window_failed(self._read_counts(), self._reads_start, WINDOW_READS, MIN_READ_PRECISION):
            self.active = False
        if _window_full(self._counts(), self._window_start, WINDOW_GUESSES):
            self._window_start = self._counts()
        if _window_full(self._read_counts(), self._reads_start, WINDOW_READS):
            self._reads_start = self._read_counts()

    def _counts(self):
        stats = self.target.cache.stats
        if self.depth > 1:
            return stats.far_guesses, stats.far_guess_hits
        return stats.guesses, stats.guess_hits

    def _read_counts(self):
        stats = self.target.cache.stats
        return stats.prefetch_reads, stats.prefetch_hits


def _window_full(now, start, size) -> bool:
    return now[0] - start[0] >= size


def _window_failed(now, start, size, min_share) -> bool:
    """A full window (of guesses or reads) in which too few paid off."""
    return _window_full(now, start, size) and (now[1] - start[1]) / (now[0] - start[0]) < min_share


def resolve_prefetch(setting) -> bool:
    """The `prefetch` setting; None ("auto") is on, except on CUDA, where reads of guessed
    experts measured harmful (streaming/lab/MEASUREMENTS.md)."""
    if setting is not None:
        return bool(setting)
    cuda = getattr(mx, "cuda", None)
    return not (cuda is not None and cuda.is_available())
