"""Routing replay (benchmark lab code): every MoE layer of a model uses the experts a recorded
trace of a trained model used, instead of what its own (random) router picks.

A random-weight model decoded greedily repeats its routing and barely misses; a trained one
misses 50-70% of its expert uses under LRU at a quarter budget. Replay gives the benchmark real
routing on a synthetic checkpoint of the traced model's shape.

Where: at the routed-expert call (`SwitchGLU` / `SwitchMLP`, or the engine's `StreamedSwitch`,
called as `block(x, indices)` by every architecture). The block's router still runs and gives
its weights; the indices it hands to the experts are swapped for the trace's. This works the
same for Linear routers and for DeepSeek-style gate modules returning (indices, scores), and
stock and streamed models run it alike, so they stay bitwise comparable. The lookahead's probe
holds the router itself, so its guesses are still the random router's: it cannot know a
replayed route (the benchmark reports its hit rate as measured).

The replayed ids are computed from the router's output (plus zero times it), so a streamed
layer still waits for its router before it knows its misses, as it would with real routing.

Which rows: the benchmark sets the trace row of the next forward (`begin(row)`); each forward
of T tokens takes rows row..row+T-1 (one per token, wrapping at the trace's end) and moves the
row on by T when it returns (the position is set around the model's call). MoE layer i uses
the trace's column i mod L (the trace's layers in order, cycled when the model has more).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from greenlet import getcurrent

from ..architectures import ArchitectureSpec, spec_for
from .call_wrap import wrap_call
from ..errors import ExpertStreamError
from ..streamed_switch import StreamedSwitch
from ..traces import RoutingTrace


class ReplayError(ExpertStreamError):
    """A trace that does not fit the model, or a model whose routing replay cannot map."""


@dataclass(frozen=True)
class Forward:
    """One top-level model call under replay: its first trace row, its tokens, whether the
    benchmark counts it (timed decode)."""

    row: int
    tokens: int
    counted: bool
    rows: np.ndarray | None = None  # set by `begin_rows`: rows that do not follow one another


def check_fit(trace: RoutingTrace, where: str, model_type: str, num_experts: int, top_k: int | None) -> None:
    """Refuse a trace whose expert count or top-k is not the model's, with both numbers."""
    fix = f"make a checkpoint of the trace's shape: expert-stream synth --like-trace {trace.name}.npz"
    if top_k is None:
        raise ReplayError(f"{where}: model_type {model_type!r} does not say its top-k; replay needs it")
    if int(trace.num_experts) != int(num_experts):
        raise ReplayError(
            f"trace {trace.name}: {trace.num_experts} experts per layer, but {where} "
            f"({model_type}) has {num_experts}; {fix}"
        )
    if trace.top_k != int(top_k):
        raise ReplayError(
            f"trace {trace.name}: top-{trace.top_k} routing, but {where} ({model_type}) routes "
            f"each token to {top_k} experts; the two must be equal; {fix}"
        )


class RoutingReplay:
    """The trace rows of the forward in progress, for every MoE layer of one model."""

    def __init__(self, trace: RoutingTrace, moe_layers: int, model_type: str = "?"):
        self.ids = np.asarray(trace.ids, dtype=np.int64)  # (rows, columns, top_k)
        self.trace = trace
        self.model_type = model_type
        self.columns = [i % trace.num_layers for i in range(moe_layers)]
        self.next_row = 0
        self.counting = False  # forwards started while True are marked counted
        self.log: list[Forward] = []
        self.paths: list[str] = []  # module path of each MoE layer's expert call
        # rows of each forward in progress, by the greenlet running it: a layer-major prefill
        # (prompt_pass.py) runs its chunks' forwards side by side, each parked at every layer
        self._forwards: dict = {}
        self._given: np.ndarray | None = None  # rows of the next forward (begin_rows)

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])

    def begin(self, row: int) -> None:
        """The next forward starts at trace row `row`."""
        self.next_row = int(row) % self.num_rows

    def begin_rows(self, rows) -> None:
        """The next forward's tokens take these rows, one each (a speculative verify pass whose
        rejected drafts route elsewhere: draft_bench.py)."""
        self._given = np.asarray(rows, dtype=np.int64) % self.num_rows

    def start_forward(self, tokens: int) -> None:
        given, self._given = self._given, None
        if given is not None and given.size != int(tokens):
            raise ReplayError(f"begin_rows gave {given.size} rows for a forward of {tokens} tokens")
        rows = given if given is not None else self.rows(self.next_row, int(tokens))
        self.log.append(Forward(int(rows[0]) if rows.size else self.next_row, int(tokens), self.counting, given))
        if rows.size:  # the next forward follows this one, even while this one is still running
            self.next_row = (int(rows[-1]) + 1) % self.num_rows
        self._forwards[getcurrent()] = rows

    def end_forward(self) -> None:
        self._forwards.pop(getcurrent(), None)

    def rows(self, start: int, count: int) -> np.ndarray:
        return (start + np.arange(count)) % self.num_rows

    def experts(self, layer: int, path: str, indices: mx.array) -> mx.array:
        """The trace's experts for this forward's tokens at MoE layer `layer`, shaped and typed
        like the router's `indices` (..., k)."""
        rows = self._forwards.get(getcurrent())
        if rows is None:
            raise ReplayError(f"{path}: expert call outside a replayed forward of the model")
        k = int(indices.shape[-1])
        n = int(indices.size) // k
        if n != rows.size:
            raise ReplayError(
                f"{path}: {n} routed rows in a forward of {rows.size} tokens; replay maps one "
                f"row to one token (batch 1), which model_type {self.model_type!r} does not do here"
            )
        if k > self.ids.shape[2]:
            raise ReplayError(f"{path}: the router gives top-{k}, the trace has top-{self.ids.shape[2]}")
        # A lossy top_k_override routes to fewer experts: the trace's first ones (its rank order).
        ids = self.ids[rows, self.columns[layer], :k]
        # `+ indices * 0` keeps the router in the graph of what the layer reads back: a layer
        # must wait for its router before it knows its misses, as with real routing (a constant
        # would be known before the device computed anything: a perfect lookahead).
        return mx.array(ids.reshape(indices.shape), dtype=indices.dtype) + indices * 0

    def counted_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, counted) of every token replayed so far, in order: what a simulator replays."""
        rows = [f.rows if f.rows is not None else self.rows(f.row, f.tokens) for f in self.log]
        counted = [np.full(f.tokens, f.counted) for f in self.log]
        if not rows:
            return np.zeros(0, np.int64), np.zeros(0, bool)
        return np.concatenate(rows), np.concatenate(counted)


_REPLAY_MODELS: dict[type, type] = {}
_REPLAY_EXPERTS: dict[type, type] = {}


def expert_modules(model: nn.Module, spec: ArchitectureSpec) -> list[tuple[str, nn.Module]]:
    """(path, module) of each MoE layer's expert call in model order: the streamed layer where
    the engine swapped one in, else the stock expert block (stock models, resident layers)."""
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, (StreamedSwitch, *spec.expert_classes))][::-1]
    streamed = [p for p, m in found if isinstance(m, StreamedSwitch)]
    return [(p, m) for p, m in found if not any(p.startswith(s + ".") for s in streamed)]


def install(model: nn.Module, trace: RoutingTrace, model_type: str, num_experts: int, top_k: int | None,
            where: str = "the model", architectures: list[ArchitectureSpec] | None = None) -> RoutingReplay:
    """Make every MoE layer of `model` (stock or streamed) route as `trace` does; returns the
    replay whose `begin(row)` sets where the next forward starts."""
    check_fit(trace, where, model_type, num_experts, top_k)
    spec = spec_for(model_type, architectures)
    layers = expert_modules(model, spec)
    if not layers:
        raise ReplayError(f"{where}: model_type {model_type!r} has no routed-expert calls to replay")
    replay = RoutingReplay(trace, len(layers), model_type)
    replay.paths = [path for path, _ in layers]
    for i, (path, module) in enumerate(layers):
        module._expert_stream_replay = replay
        module._expert_stream_replay_layer = i
        module._expert_stream_replay_path = path
        wrap_call(module, _REPLAY_EXPERTS, _around_experts)
    model._expert_stream_replay = replay
    wrap_call(model, _REPLAY_MODELS, _around_model)
    return replay


def _around_experts(base: type):
    def around(module, call, args, kwargs):
        args = list(args)
        if len(args) >= 2:
            args[1] = module._expert_stream_replay.experts(
                module._expert_stream_replay_layer, module._expert_stream_replay_path, args[1])
        else:
            kwargs = dict(kwargs, indices=module._expert_stream_replay.experts(
                module._expert_stream_replay_layer, module._expert_stream_replay_path, kwargs["indices"]))
        return call(*args, **kwargs)

    return around


def _around_model(base: type):
    # mlx-lm models take the token ids first (`inputs`); base may already be a wrapped class
    # whose signature is (*args, **kwargs).
    def around(model, call, args, kwargs):
        inputs = args[0] if args else kwargs.get("inputs")
        replay = model._expert_stream_replay
        if not isinstance(inputs, mx.array) or inputs.ndim != 2 or inputs.shape[0] != 1:
            shape = getattr(inputs, "shape", None)
            raise ReplayError(f"replay runs token ids of one sequence, shape (1, T); got {shape}")
        replay.start_forward(inputs.shape[1])
        try:
            return call(*args, **kwargs)
        finally:
            replay.end_forward()

    return around
