"""The streamed expert layer: a drop-in for mlx-lm's SwitchGLU / SwitchMLP whose routed experts
stay on disk. It wraps the stock module itself (its expert tensors swapped for slot arrays) and
calls it with slot numbers instead of expert ids, so the arithmetic, the activation and stock's
sort rule (sort the token-expert pairs when `indices.size >= 64`) are stock's own code.

Each call picks one path (decode_paths.py, prefill_sweep.py), built here from the layer's
parts: its ExpertStore (expert_store.py), which reserves slots for the missing experts, reads,
and lets the slots claim them once the bytes are in; its ExpertCompute (expert_calls.py), the
stock block on the slot arrays, which shapes calls so the backend picks stock's kernel for each
(kernel_match.py); and the model's scratch pool. streaming/README.md follows a miss through.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .decode_paths import ComputeFloor, LayerByLayer, LossySkip, ResidentPath, route, route_chunks
from .expert_calls import ExpertCompute
from .expert_store import ExpertStore
from .prefill_sweep import PrefillSweep


class StreamedSwitch(nn.Module):
    """Called exactly like the SwitchGLU / SwitchMLP it replaces: `layer(x, indices)`."""

    def __init__(self, inner: nn.Module, store: ExpertStore, overlap: bool = True, skipper=None,
                 scratch=None, lookaheads=()):
        super().__init__()
        self.inner = inner
        self.store = store
        self.compute = ExpertCompute(inner, store.cache.num_experts)
        # lookahead.Lookahead into each of the next streamed layers it guesses (set by the loader).
        # A plain attribute: MLX keeps a list set on a module in its parameter tree.
        object.__setattr__(self, "lookaheads", list(lookaheads))
        self.resident = ResidentPath(store, self.compute)
        self.layered = LayerByLayer(store, self.compute, scratch, overlap)
        self.sweep = PrefillSweep(store, self.compute, scratch)
        self.skip = LossySkip(store, self.compute, skipper) if skipper is not None else None
        self.floor = None  # the benchmark's ComputeFloor while it times compute alone
        self.online_budget = None  # OnlineBudget moving slots between layers (set by the loader)
        self.path_taken = None  # the path object of the latest call
        self.native = None  # native_decode.NativeDecode (decode_path native, where it serves)
        self.clock = None  # decode_clock.DecodeClock on the model's first streamed layer (set by its handle)
        # prompt_pass's park while a layer-major prefill runs: calls wait for the other chunks
        object.__setattr__(self, "prompt_pass", None)

    def __getattr__(self, name: str):
        # The model may reach into the block it built: muse_spark reads
        # `experts.post_expert_norm`, a norm it keeps on its SwitchGLU.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "inner" not in self:
                raise
            return getattr(self["inner"], name)

    def time_compute_only(self, on: bool) -> None:
        """Benchmark: compute every call as if all experts were resident (ComputeFloor)."""
        self.floor = ComputeFloor(self.store, self.compute) if on else None

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.prompt_pass is not None:
            return self.prompt_pass(self, x, indices)
        if self.online_budget is not None and self.floor is None:
            self.online_budget.apply(self)  # slots follow the budget, in a layer holding every expert too
        if self.clock is not None:  # the token count is the shape's: no sync
            self.clock.tick(indices.size // indices.shape[-1])
        path = self.floor or (self.resident if self.store.on_device() else None)
        if path is not None:
            self.path_taken = path
            return path(x, indices)
        native = self.native
        if native is not None:
            if indices.size == indices.shape[-1]:
                if self.store.recorder is not None:
                    self.store.record(indices)  # left on the device: the recorder reads it later
                self.path_taken = native
                return native(x, indices)
            native.hand_back()  # a multi-token call (a verify pass, a prompt chunk): the Python path
        store = self.store
        store.reap()
        try:
            call = route(store, self.lookaheads, x, indices)
            path = self._host_path(x, call)
            self.path_taken = path
            y = path(x, indices, call)
        except BaseException:
            store.reap()  # a failed call leaves no read behind that could still write a slot
            raise
        finally:
            store.end_call()  # the side buffer's bytes were copied where the call needed them
        store.pin([y])
        return y

    def call_chunks(self, xs: list[mx.array], indices: list[mx.array]) -> list[mx.array]:
        """A prompt pass's calls of this layer, one per chunk in chunk order (prompt_pass.py),
        each output bitwise its own call's: one sync for all, and one sweep where together they
        need more experts than the layer has slots (each expert read once for the pass)."""
        if self.online_budget is not None and self.floor is None:
            self.online_budget.apply(self)
        if self.clock is not None:  # a prefill: ends the decode run
            self.clock.prefilled(sum(i.size // i.shape[-1] for i in indices))
        path = self.floor or (self.resident if self.store.on_device() else None)
        if path is not None:
            self.path_taken = path
            return [path(x, i) for x, i in zip(xs, indices)]
        if self.native is not None:
            self.native.hand_back()
        store = self.store
        store.reap()
        try:
            calls = route_chunks(store, indices)
            if len(calls) > 1 and _union_size(calls) > store.cache.num_slots:
                self.path_taken = self.sweep
                ys = self.sweep.chunks(xs, calls)
                store.pin(ys)
            else:  # they fit the slots together: each chunk's call as it comes, misses read once
                ys = []
                for x, i, call in zip(xs, indices, calls):
                    self.path_taken = self._host_path(x, call)
                    ys.append(self.path_taken(x, i, call))
                    store.pin(ys[-1:])
        except BaseException:
            store.reap()
            raise
        finally:
            store.end_call()
        return ys

    def _host_path(self, x, call):
        """The path for a call whose routing is on the host."""
        if call.needed.size > self.store.cache.num_slots:
            return self.sweep
        if self.skip is not None and call.single_token:
            call.kept = self.skip.keep(x, call)
            if call.kept is not None:
                return self.skip
        return self.layered


def _union_size(calls) -> int:
    return int(np.unique(np.concatenate([c.needed for c in calls])).size)
