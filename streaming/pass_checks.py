"""Checking a speculative pass's routing while the pass is still being built.

A speculative decode step (speculation.py) built whole and checked once at the end leaves the
device idle while the host builds the graph, and a miss in an early layer is found only after
every later layer computed from a wrong input; on an H200 that waste was most of a pass per
thrown pass, since the early layers miss most. So every `every` streamed layers the pass so far
is handed to the device (async_eval) together with those layers' routing, and the routing of
the group handed before it, computed meanwhile, is read back: reading an array waits on the
eval that scheduled it, not on work queued after it. A group that met a missing expert ends
the pass there (MissFound): at most one more group computed from a wrong input, and the host
built nothing further. The last groups are checked when the pass ends.

The price: a pass cut short does not see the misses of later layers, which a whole thrown pass
reads too (their input was only slightly wrong), so a step takes more passes, each shorter.
The group in flight at the cut is still read as likely misses (likely_misses), after the
certain reads have started: on a CPU stand-in of the benchmark's shape (48 layers, 128 experts,
top-8, 32 slots, 3 x 64 greedy tokens) that cut thrown passes by 18-20% and the MoE layers
computed by 3-4% against cutting without it, at every group size tried (1-8). Counts per step
there: one check at the end 0.8 thrown passes, 81 layers computed; groups of 4 with likely
misses 1.3 and 57 (48 is one clean pass).
On an H200 (Qwen3-30B-A3B shape, a quarter of the experts, same process and prompts), groups
of 4 decoded at 21.6 / 15.9 tok/s against 20.1 / 14.3 for one check at the end
(tests/gpu/prof_steps.py). Groups of 12, and leaving two groups running instead of one (groups
of 2, 4 or 8), did no better (tests/gpu/spec_variants.py, variants in rotating order), nor did
smaller groups in the early layers (2, 2, 4, then 8). The checks have a price of their own: with
every expert in a slot, so that no pass is thrown, steps checked every 4 layers ran at 0.75 of
stock's rate and steps checked once at the end at 0.93 (tests/gpu/clean_steps.py; each hand-off
of a group took about 1.3 ms of host time there).

Residency does not change during a pass (no reads are started inside one), so a group's
verdict, taken early, holds for the whole pass.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class MissFound(Exception):
    """Raised inside the model's forward pass when a checked group of layers met a missing
    expert; the speculation catches it, rewinds and runs the step again."""


def _flat_routing(streams) -> tuple[mx.array, list[int]]:
    """The streams' routing as one flat array (one read for the group), and each one's length."""
    ids = [s.speculated_ids.reshape(-1) for s in streams]
    for s in streams:
        s.speculated_ids = None
    return (mx.concatenate(ids) if len(ids) > 1 else ids[0]), [i.size for i in ids]


def _experts(streams, routing: mx.array, sizes: list[int]):
    """Per stream: (the experts its routing names, those not resident). Reads the routing back."""
    flat = np.array(routing)
    for s, part in zip(streams, np.split(flat, np.cumsum(sizes)[:-1])):
        needed = np.unique(part)
        yield s, needed, needed[~s.cache.resident(needed)]


class PassChecks:
    """The routing checks of one speculative pass at a time."""

    def __init__(self, every: int):
        self.every = every  # streamed layers per group; 0: one check when the pass ends
        self.start()

    def start(self) -> None:
        self.needed: dict = {}  # stream -> experts it needs, for the layers checked so far
        self.absent: dict = {}  # stream -> those not resident (non-empty arrays only)
        self._open: list = []  # streams computed since the last group was handed over
        self._handed = None  # (streams, flat routing, sizes) handed to the device, not yet checked
        self._cut_at = None  # the group in flight when the pass was cut
        self.layers = 0  # streamed layers the pass computed

    def computed(self, stream, output: mx.array) -> None:
        """A streamed layer built its speculative output (its routing is in speculated_ids)."""
        self.layers += 1
        self._open.append(stream)
        if not self.every or len(self._open) < self.every:
            return
        group, self._open = self._open, []
        routing, sizes = _flat_routing(group)
        mx.async_eval(output, routing)
        handed, self._handed = self._handed, (group, routing, sizes)
        if handed is not None:
            self._check(*handed)
            if self.absent:
                self._cut_at = self._handed
                self._handed = None  # computed from a wrong input: never checked
                raise MissFound()

    def finish(self) -> tuple[dict, dict]:
        """At the end of a pass: check what is left (one sync) and give ({stream: experts
        needed}, {stream: experts not resident}) for every layer checked: all the layers the
        pass computed, or, after MissFound, those up to the group that met the miss."""
        groups = [self._handed] if self._handed is not None else []
        if self._open:
            groups.append((self._open, *_flat_routing(self._open)))
        self._handed, self._open = None, []
        if groups:  # one read for both
            streams = [s for g in groups for s in g[0]]
            routing = mx.concatenate([g[1] for g in groups]) if len(groups) > 1 else groups[0][1]
            self._check(streams, routing, [n for g in groups for n in g[2]])
        return self.needed, self.absent

    def _check(self, streams, routing: mx.array, sizes: list[int]) -> None:
        for s, needed, absent in _experts(streams, routing, sizes):
            self.needed[s] = needed
            if absent.size:
                self.absent[s] = absent

    def likely_misses(self) -> dict:
        """After MissFound: {stream: (experts needed, those not resident)} of the group that was
        in flight when the pass was cut (computed from a slightly wrong input, so its misses are
        likely, not certain). Waits for that group."""
        group, self._cut_at = self._cut_at, None
        if group is None:
            return {}
        return {s: (needed, absent) for s, needed, absent in _experts(*group) if absent.size}
