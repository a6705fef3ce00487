"""Running a thrown-away speculative decode step again from its first layer that met a miss.

A speculative pass (streaming/speculation.py) computes every layer of a decode step before its
routing is checked. When layer L met a missing expert, layers 0..L-1 computed exactly what the
kept step needs: their outputs and their cache updates are right, only layer L and what follows
are wrong. Instead of rerunning the whole step, the next pass replays layers below L: each
decoder layer's `__call__` (wrapped like the model's, streaming/call_wrap.py) returns the output it
gave in the earlier pass and puts its caches back to where that pass left them, without
computing anything. Layers from L on compute from caches rewound to before the step.

This relies only on the shape every mlx-lm model has: a loop that calls each decoder layer once,
in order, passing it its own cache. A model that does anything else (calls a layer twice, shares
a cache between layers, keeps caches that no layer is given, returns from a layer an object
other than arrays) is detected after a pass and is simply not replayed: its thrown passes rerun
the whole step, as before.
"""

from __future__ import annotations

from typing import Optional

import mlx.nn as nn

from .call_wrap import wrap_call


def _is_cache(value) -> bool:
    from mlx_lm.models.cache import _BaseCache

    return isinstance(value, _BaseCache)


def _snapshot(cache) -> dict:
    """The cache's state as references. A forward pass writes cache arrays in place only past
    the offset it started from, so references taken after a layer ran stay that layer's
    result until the layer runs again."""
    from mlx_lm.models.cache import CacheList

    if isinstance(cache, CacheList):
        return {"caches": [_snapshot(c) for c in cache.caches]}
    return {k: (list(v) if isinstance(v, list) else v) for k, v in vars(cache).items()}


def _restore(cache, state: dict) -> None:
    from mlx_lm.models.cache import CacheList

    if isinstance(cache, CacheList):
        for c, s in zip(cache.caches, state["caches"]):
            _restore(c, s)
        return
    vars(cache).update({k: (list(v) if isinstance(v, list) else v) for k, v in state.items()})


class StepReplay:
    """Records each decoder layer's output and cache state during a speculative pass, and
    replays the layers below `replay_below` in the next pass of the same step."""

    def __init__(self, layers: list, layer_of: dict):
        self.layers = layers
        self.layer_of = layer_of  # LayerStream -> index of the decoder layer that holds it
        n = len(layers)
        self._outputs: list = [None] * n
        self._states: list = [None] * n
        self._caches: list = [None] * n
        self._calls: list[int] = []
        self.replay_below = 0
        self._opaque = False  # a layer returned an object a later layer may change in place
        self.active = False  # set around speculative passes; other calls run the layers as is
        self.shape_ok = False  # the last complete pass had the shape replay needs

    def start_step(self) -> None:
        self.replay_below = 0
        self._outputs = [None] * len(self.layers)
        self._states = [None] * len(self.layers)

    def start_pass(self, replay_below: int) -> None:
        self.replay_below = replay_below
        self._calls = []
        self._opaque = False

    def call(self, index: int, run, args, kwargs):
        self._calls.append(index)
        caches = [a for a in (*args, *kwargs.values()) if _is_cache(a)]
        if index < self.replay_below:
            for cache, state in zip(caches, self._states[index]):
                _restore(cache, state)
            return self._outputs[index]
        out = run()
        if not _plain(out):
            self._opaque = True
        self._outputs[index] = out
        self._states[index] = [_snapshot(c) for c in caches]
        self._caches[index] = caches
        return out

    def _has_shape(self, model_caches, whole: bool) -> bool:
        """The last pass called decoder layers 0, 1, ... in order (all of them when `whole`),
        each with caches of its own that are the model's (all of them when `whole`)."""
        calls = self._calls
        if model_caches is None or self._opaque or calls != list(range(len(calls))):
            return False
        seen = [id(c) for index in calls for c in (self._caches[index] or ())]
        model = {id(c) for c in model_caches}
        if len(seen) != len(set(seen)):
            return False
        if whole:
            return len(calls) == len(self.layers) and set(seen) == model
        return set(seen) <= model

    def pass_complete(self, model_caches) -> None:
        """After a pass that ran to its end: note whether the model has the shape replay needs."""
        self.shape_ok = self._has_shape(model_caches, whole=True)

    def first_missed_layer(self, missing_streams, model_caches, complete: bool = True) -> int:
        """The decoder layer the next pass must compute from: the lowest layer holding a stream
        in `missing_streams`, or 0 when the model does not have the shape replay needs. A pass
        that ended early (`complete` False) is checked as far as it got, for a model whose
        last complete pass had the shape."""
        if complete:
            self.pass_complete(model_caches)
        elif self.shape_ok:
            self.shape_ok = self._has_shape(model_caches, whole=False)
        if not self.shape_ok:
            return 0
        return min(self.layer_of[s] for s in missing_streams)

    def clear(self) -> None:
        """Drop the recorded outputs and states (they hold device arrays)."""
        self.start_step()
        self._caches = [None] * len(self.layers)


def _plain(out) -> bool:
    """An output made only of arrays (in tuples or lists) and None: a replay can hand it back.
    Anything else may be changed in place by the layers after it (kimi_k3's attention
    residuals return the ResidualBlocks every later layer appends to), so the recorded object
    would no longer be what this layer returned."""
    import mlx.core as mx

    if out is None or isinstance(out, mx.array):
        return True
    if isinstance(out, (tuple, list)):
        return all(_plain(o) for o in out)
    return False


def build(model: nn.Module, streams) -> Optional[StepReplay]:
    """A StepReplay for `model` with its decoder layers wrapped, or None when the model has no
    `layers` list holding every streamed layer."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        return None
    layer_of = {}
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            return None
        for module in layer.modules():
            stream = getattr(module, "stream", None)
            if stream in streams:
                layer_of[stream] = index
    if len(layer_of) != len(streams):
        return None
    replay = StepReplay(list(layers), layer_of)
    for index, layer in enumerate(layers):
        _wrap(layer, replay, index)
    return replay


_REPLAYING_CLASSES: dict[type, type] = {}


def _wrap(layer: nn.Module, replay: StepReplay, index: int) -> None:
    # Plain attributes: MLX modules keep tuples, lists and dicts as parameters.
    layer._expert_stream_replay = replay
    layer._expert_stream_layer_index = index
    wrap_call(layer, _REPLAYING_CLASSES, lambda base: _around_layer)


def _around_layer(layer, call, args, kwargs):
    replay = layer._expert_stream_replay
    if replay.active:
        return replay.call(layer._expert_stream_layer_index, lambda: call(*args, **kwargs), args, kwargs)
    return call(*args, **kwargs)
