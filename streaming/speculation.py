"""Speculative decode: run a whole decode step without stopping at each streamed layer.

A streamed layer normally reads its routing back to the host before computing (to find misses
and start their reads). That sync serialises host and device once per layer: on CUDA it measured
about 1 ms per layer per token, more than a stock token costs per layer. A speculative step runs
the way stock runs: every streamed layer maps expert ids to slots on the device (a missing expert
maps to slot 0, a wrong but harmless expert) and the whole step is one graph. Its routing is then
read back and checked on the host, a group of layers at a time while the pass is still being
built (streaming/pass_checks.py), the last groups when it ends:
- every routed expert was resident: the step computed exactly what the layer-by-layer path
  computes (same kernels, same slot numbers). The caches record the accesses; done.
- some expert was missing: the pass ends at that group's check (or at its end), the step is
  thrown away and the KV and state caches rewound (streaming/rewind.py). The missing experts
  the pass saw are read (those of the first layer that missed are certain; later layers saw a
  slightly wrong input, so theirs are likely), and the step runs again speculatively from the
  first decoder layer that missed: the layers below it replay what they computed
  (streaming/layer_replay.py). After MAX_PASSES thrown-away passes that ran to their end the
  step runs layer by layer (passes cut short do not count: each makes a later layer resident).
Nothing the expert caches do depends on a thrown-away pass except which experts they hold, so
the output is exactly the layer-by-layer path's, which is exactly stock's.

Speculation pays while a speculative step, thrown-away passes included, costs less than a
layer-by-layer step: on CUDA a pass measured about a quarter of a layer-by-layer step; on a CPU,
where a sync costs little, about the same. Both are timed as the model runs (one decode step in
EXPLORE_EVERY runs layer by layer to keep its time current) and, judged over at least JUDGE_AFTER
speculative steps, speculation pauses while it loses.
A step that cannot be rewound (a wrapped sliding-window cache, batched state) is not speculated.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import layer_replay
from .call_wrap import wrap_call
from .pass_checks import MissFound, PassChecks
from .rewind import rewind_point

# Speculative passes of one step, run to their end and thrown away, before it runs layer by layer.
MAX_PASSES = 3
# Weight of the newest sample in the moving averages of step times (a plain mean over the
# first 1 / EWMA samples).
EWMA = 0.1
# Speculative steps timed before speculation is judged: one step that met a miss costs two
# passes and its reads, and must not pause it by itself.
JUDGE_AFTER = 8
# One decode step in this many runs layer by layer, to keep that path's time current.
EXPLORE_EVERY = 64
# Decode steps run layer by layer once speculation lost, before it is tried again.
PAUSE_STEPS = 64


@dataclass
class SpeculationStats:
    steps: int = 0  # decode steps that ended with a kept speculative pass
    passes_thrown: int = 0  # speculative passes thrown away for a miss (and rerun)
    passes_cut: int = 0  # of those, passes ended early by a group's check (not built to the end)
    fallbacks: int = 0  # steps that ran layer by layer after MAX_PASSES thrown-away passes
    layered: int = 0  # decode steps run layer by layer by choice (exploring, paused)
    not_rewindable: int = 0  # decode steps run layer by layer because a cache has no way back
    paused: int = 0  # times speculation lost against layer by layer and paused
    layers_replayed: int = 0  # decoder layers a rerun took from the thrown pass instead of computing
    layers_computed: int = 0  # MoE layers computed by speculative passes, kept and thrown
    # Moving averages of seconds per decode step, speculative (all its passes) and layer by layer.
    t_speculative: Optional[float] = None
    t_layer_by_layer: Optional[float] = None

    def as_dict(self) -> dict:
        return asdict(self)


def _average(old: Optional[float], sample: float, n: int) -> float:
    """Moving average after its `n`-th sample."""
    return sample if old is None else old + max(EWMA, 1.0 / n) * (sample - old)


class DecodeSpeculation:
    """Runs each decode step of one model speculatively while that pays (see module doc)."""

    def __init__(self, streams, adaptive: bool = True, check_every: int = 4):
        self.streams = streams
        self.adaptive = adaptive  # False: speculate every decode step that can be rewound
        self.checks = PassChecks(check_every)
        self.replay = None  # layer_replay.StepReplay, set by install() when the model allows it
        self.stats = SpeculationStats()
        self._pause = 0
        self._decode_steps = 0
        self._samples = {"speculative": 0, "layer_by_layer": 0}  # since each average restarted

    def forward(self, run, inputs, cache):
        """Run one forward pass (`run()` calls the model), speculatively when it is a decode
        step worth it."""
        if not self._decode_step(inputs):
            return run()
        self._decode_steps += 1
        if not self._speculate_now():
            self.stats.layered += 1
            return self._timed_layer_by_layer(run)
        rewind = rewind_point(cache, 1)
        if rewind is None:
            self.stats.not_rewindable += 1
            return run()
        t0 = time.perf_counter()
        out = self._speculate(run, rewind, cache)
        self._time("speculative", time.perf_counter() - t0)
        self._judge()
        return out

    def _time(self, path: str, seconds: float) -> None:
        st, key = self.stats, f"t_{path}"
        if getattr(st, key) is None:
            self._samples[path] = 0
        self._samples[path] += 1
        setattr(st, key, _average(getattr(st, key), seconds, self._samples[path]))

    def _decode_step(self, inputs) -> bool:
        """One token, and no benchmark or recording mode that needs the layer-by-layer path."""
        first = self.streams[0]
        return (
            isinstance(inputs, mx.array) and inputs.size == 1
            and not first.forced_hits and first.recorder is None
        )

    def _speculate_now(self) -> bool:
        if not self.adaptive:
            return True
        if self._pause:
            self._pause -= 1
            return False
        # The model's first decode step explores, so that both times are known early on.
        return self._decode_steps % EXPLORE_EVERY != 1

    def _judge(self) -> None:
        st = self.stats
        if (
            self.adaptive and st.t_layer_by_layer is not None
            and self._samples["speculative"] >= JUDGE_AFTER and st.t_speculative > st.t_layer_by_layer
        ):
            st.paused += 1
            st.t_speculative = None  # judged afresh after the pause
            self._pause = PAUSE_STEPS

    def _timed_layer_by_layer(self, run):
        t0 = time.perf_counter()
        out = run()
        self._time("layer_by_layer", time.perf_counter() - t0)
        return out

    def _speculate(self, run, rewind, cache):
        fetched = {}  # stream -> experts read for this step by a thrown-away pass
        verified = {}  # stream -> experts it needs, checked in a pass whose layer is replayed
        replay, replay_below = self.replay, 0
        if replay is not None:
            replay.start_step()
        try:
            complete_passes = 0
            for _ in range(MAX_PASSES + len(self.streams)):
                if complete_passes == MAX_PASSES:
                    break
                out = self._pass(run, replay_below)
                needed, absent = self.checks.finish()
                if not absent:
                    if replay is not None and not replay.shape_ok:  # a model's shape stays
                        replay.pass_complete(cache)
                    self._keep(needed, verified, fetched)
                    self.stats.steps += 1
                    return out
                complete = out is not None
                complete_passes += complete
                if complete:
                    del out
                    for s in needed:
                        s.pending.pop()  # its graph was evaluated by the routing, or is dropped now
                # A pass cut short handed every layer it built to the device: those outputs
                # stay pending (they pin their slots until evaluated).
                rewind()
                self.stats.passes_thrown += 1
                self.stats.passes_cut += not complete
                certain = {s: (needed[s], a) for s, a in absent.items()}
                self._fetch(certain, fetched, None if complete else self.checks.likely_misses)
                if replay is not None:
                    replay_below = replay.first_missed_layer(absent, cache, complete)
                    if replay_below == 0:
                        verified = {}
                    verified.update((s, n) for s, n in needed.items() if replay.layer_of[s] < replay_below)
        finally:
            if replay is not None:
                replay.clear()
        self.stats.fallbacks += 1
        out = run()
        self._count_late_reads(fetched)
        return out

    def _pass(self, run, replay_below: int):
        """One speculative pass; decoder layers below `replay_below` replay the last pass.
        None when a group's check ended it (self.checks holds what was checked)."""
        replay = self.replay
        self.checks.start()
        for s in self.streams:
            s.await_prefetch()
            s.speculated_ids = None
            s.speculative_pass = self.checks
        if replay is not None:
            replay.start_pass(replay_below)
            replay.active = True
            self.stats.layers_replayed += replay_below
        try:
            return run()
        except MissFound:
            return None
        finally:
            self.stats.layers_computed += self.checks.layers
            for s in self.streams:
                s.speculative_pass = None
            if replay is not None:
                replay.active = False

    def _keep(self, needed: dict, verified: dict, fetched: dict) -> None:
        """The pass is the step: settle its layers' outputs and record every layer's accesses
        (replayed layers were checked in an earlier pass)."""
        # Earlier outputs of these layers are ancestors of the routing just evaluated: only
        # each layer's newest output can still be running.
        settled = [p for s in needed for p in s.pending[:-1]]
        if settled:
            mx.eval(settled)
        for s in needed:
            s.pending = s.pending[-1:]
        for s, n in {**verified, **needed}.items():
            s.cache.access(n)
            s.last_path = "speculated"
        self._count_late_reads(fetched)

    @staticmethod
    def _count_late_reads(fetched: dict) -> None:
        """Experts read for this step by a thrown-away pass were misses of the step, although
        the pass that kept it found them resident."""
        for s, late in fetched.items():
            s.cache.count_as_misses(int(np.isin(s.cache.last_needed, late).sum()))

    def _fetch(self, missing: dict, fetched: dict, more=None) -> None:
        """Read the experts a thrown-away pass found missing, all layers' reads in flight at once;
        `more()`, called once those reads are under way, gives likely ones to read as well."""
        reads = []
        try:
            reads += [(s, s.start_reads(a, protected=n)) for s, (n, a) in missing.items()]
            if more is not None:
                extra = {s: v for s, v in more().items() if s not in missing}
                reads += [(s, s.start_reads(a, protected=n)) for s, (n, a) in extra.items()]
                missing = {**missing, **extra}
            for s, r in reads:
                s.finish_reads(r)
        except BaseException:
            for s, _ in reads:
                s.reap()  # the other layers' reads: none may claim a slot or write one later
            raise
        for s, (_, a) in missing.items():
            fetched[s] = a if s not in fetched else np.union1d(fetched[s], a)


_SPECULATING_CLASSES: dict[type, type] = {}


def install(model: nn.Module, speculation: DecodeSpeculation) -> None:
    """Route `model(...)` calls through `speculation` (streaming/call_wrap.py: hosts that call
    the model, check its type or read its attributes see the stock model), and let its decoder
    layers replay a thrown pass where the model allows it."""
    speculation.replay = layer_replay.build(model, speculation.streams)
    model._expert_stream_speculation = speculation
    wrap_call(model, _SPECULATING_CLASSES, _around_model)


def _around_model(base: type):
    signature = inspect.signature(base.__call__)
    params = list(signature.parameters)
    inputs_name = params[1] if len(params) > 1 else None

    def around(model, call, args, kwargs):
        bound = signature.bind(model, *args, **kwargs)
        return model._expert_stream_speculation.forward(
            lambda: call(*args, **kwargs), bound.arguments.get(inputs_name), bound.arguments.get("cache")
        )

    return around
