"""The native decode path (`decode_path: native`): a decode token's routing resolved inside the
graph by a primitive (native/resolve.cpp) between the layer's router and its expert gather. The
primitive maps the token's expert ids to slots and reads the misses into the victims the
layer's policy (LRU or the default panel) chooses while the graph evaluates, so the Python
thread builds each token as stock does and never waits for a routing readback; the stock block
then computes on the slots it returns.

The primitive works on the layer's own ExpertCache arrays (slot_of, expert_in) and its policy's
(LRU's stamps; the default panel's keys and points), never while the Python path does: the
layer is either the primitive's (`active`) or the Python path's, and `hand_back` waits for
every resolution queued, folds the primitive's counters into the layer's stats and gives the
table back before any Python path, budget move or prefill touches it. On MLX's CPU backend and
on CUDA (resolutions run in stream order: on the CPU stream's worker, or in a CUDA host
function); elsewhere, or where the primitive cannot be built or prove itself
(native_check.py), the Python path serves and the log says why.
"""

from __future__ import annotations

import collections

import mlx.core as mx
import numpy as np

from .cache import EMPTY
from .errors import ReadError
from .policy import NATIVE_POLICIES, AdaptivePolicy

# The primitive's counters (native/resolve.cpp, enum Count), as LayerStats fields.
COUNTS = ("calls", "hits", "misses", "evictions", "bytes_read", "read_seconds", "demand_calls")
BYTES = COUNTS.index("bytes_read")
_factors: dict = {}  # (experts, the panel's decay bases) -> its decay factors for every call size


def panel_of(policy, state: np.ndarray, pending=(), curve=None) -> dict:
    """The primitive's view of `policy` (LRUPolicy or AdaptivePolicy) and of the layer's hit
    `curve` (budget.HitCurve, or None): their own arrays, which the primitive updates in place,
    their scalars in `state` ([clock, calls, leader, the curve's calls], written back by
    `_restore`), and the policy's decay factors for every call size, computed as it computes
    them. `pending`: experts placed before their access (AccessOrder), inserted after the next."""
    if type(policy) not in NATIVE_POLICIES:
        raise TypeError(f"the native decode path does not run {type(policy).__name__}")
    experts = policy.num_experts
    state[:] = (policy.clock, getattr(policy, "_calls", 0), getattr(policy, "leader", 0),
                curve._calls if curve is not None else 0)
    panel = dict(key=policy.stamp, points=np.zeros(1), state=state, counts_members=0, win_rows=[], decay=[],
                 judge=[], window=0.0, kth=0, judging=False, judge_every=1, pending=list(pending),
                 curve_hist=np.zeros(0), curve_stamp=np.zeros(0, dtype=np.int64), curve_half_life=0)
    if curve is not None:
        panel.update(curve_hist=curve.hist, curve_stamp=curve._stamp, curve_half_life=curve.half_life)
    if isinstance(policy, AdaptivePolicy):
        key = (experts, policy._decay_base.tobytes(), policy._judge_base, policy.JUDGE_EVERY)
        if key not in _factors:  # a policy's bases never change (resize keeps its first C)
            sizes = range(1, experts + 1)
            _factors[key] = (np.concatenate([policy._decay_base ** k for k in sizes]).tolist(),
                             [policy._judge_base ** (k * policy.JUDGE_EVERY) for k in sizes])
        decay, judge = _factors[key]
        panel.update(key=policy.key, points=policy.points, counts_members=policy.score.shape[0],
                     win_rows=policy.win_rows.tolist(), decay=decay, judge=judge, window=float(policy.window),
                     kth=policy._kth, judging=policy._judging, judge_every=policy.JUDGE_EVERY)
    return panel


def _restore(policy, state: np.ndarray, curve=None) -> None:
    """The scalars the primitive kept in `state`, back on the policy and curve objects."""
    policy.clock = float(state[0])
    if isinstance(policy, AdaptivePolicy):
        policy._calls, policy.leader = int(state[1]), int(state[2])
    if curve is not None:
        curve._calls = int(state[3])


class NativeDecode:
    """One streamed layer's decode calls through the primitive (`__call__`), and the hand-over
    of its table to and from the Python path."""

    name = "native"

    def __init__(self, module, store, compute, shards):
        self.module, self.store, self.compute, self.shards = module, store, compute, shards
        tensors = store.slots.tensors
        experts = store.cache.num_experts
        self.row_bytes = [t.row_bytes for t in tensors]
        self.file_of = [t.info.file for _ in range(experts) for t in tensors]
        self.offset_of = [t.info.start + e * t.row_bytes for e in range(experts) for t in tensors]
        # where the stock block keeps each slot tensor: (its child module, the key in it)
        self.places = [_place(compute.module, t.leaf) for t in tensors]
        self.leaves = [t.leaf for t in tensors]
        self.counts = np.zeros(module.NUM_COUNTS, dtype=np.uint64)
        self.folded = self.counts.copy()  # the counts already in the layer's stats
        self.state = np.zeros(4)  # [clock, calls, leader, the curve's calls] while the primitive runs
        self.table = None
        self.arrays = []
        self.recent = collections.deque(maxlen=4)
        self.active = False

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if not self.active:
            self._take_over()
        self.store.cache.step += 1  # the call count online budgets rebalance by
        if indices.dtype != mx.uint32:
            indices = indices.astype(mx.uint32)
        slots, *arrays = self.module.resolve(indices, self.arrays, self.table)
        for (child, key), array in zip(self.places, arrays):  # the gathers depend on the resolution
            child[key] = array
        y = self.compute(x, slots)
        # Not pinned (an eval here would wait for the token before): the stream's order keeps
        # the slots until the gathers ran. The latest few outputs are kept for hand_back to
        # evaluate, with every call before them that they depend on.
        self.recent.append(y)
        return y

    def _take_over(self) -> None:
        """The table becomes the primitive's: no read of the Python path is left in flight."""
        store = self.store
        store.await_prefetch()
        store.reap()
        store.end_call()
        store.settle()
        cache = store.cache
        order = cache.policy  # policy.AccessOrder: a warm start's inserts wait for the next access
        panel = panel_of(order.policy, self.state, order.take_pending(), cache.curve)
        self.arrays = [store.slots.arrays[leaf] for leaf in self.leaves]
        self.table = self.module.LayerTable(store.name, cache.slot_of, cache.expert_in, **panel, counts=self.counts,
                                            row_bytes=self.row_bytes, file_of=self.file_of,
                                            offset_of=self.offset_of, shards=self.shards)
        self.active = True

    def hand_back(self) -> None:
        """Before the Python path (or a budget move) touches this layer: every resolution queued
        has run, its counters are in the layer's stats, the table is the cache's again. Raises
        the primitive's failure, if a read failed: the layer fails until the model is reloaded."""
        if not self.active:
            return
        self.active = False
        store = self.store
        try:
            mx.eval(list(self.recent))  # built and not yet evaluated: they resolve on this table
        except RuntimeError:
            pass  # a failed one: its table says why (below)
        self.table.drain()  # every resolution queued has run (on CUDA, its copies landed too)
        self.recent.clear()
        self._fold()
        cache = store.cache
        cache.held = int(np.count_nonzero(cache.expert_in != EMPTY))
        cache.version += 1
        _restore(cache.policy.policy, self.state, cache.curve)
        self.compute.use(store.slots)
        self.arrays = []
        failed = self.table.failed
        if failed:
            self.active = True  # keeps failing through the primitive, as the evaluation did
            raise ReadError(failed)

    def close(self) -> None:
        """The model is going away: wait for every resolution queued (mlx-lm evaluates a token
        ahead), since each writes into the arrays that go with it."""
        table = getattr(self, "table", None)
        if table is not None:
            table.drain()

    __del__ = close

    def _fold(self) -> None:
        stats = self.store.cache.stats
        for name, value in self.unfolded().items():
            setattr(stats, name, getattr(stats, name) + value)
        self.folded = self.counts.copy()

    def unfolded(self) -> dict:
        """The primitive's counts not yet in the layer's stats (a live view for `stats()`)."""
        delta = (self.counts - self.folded).tolist()
        out = dict(zip(COUNTS, (int(v) for v in delta)))
        out["read_seconds"] = delta[COUNTS.index("read_seconds")] / 1e9
        out["reads_waited"] = out["misses"]  # read inside the evaluation: the compute waits for each
        return out

    def unfolded_bytes(self) -> int:
        return int(self.counts[BYTES] - self.folded[BYTES])

    def reset(self) -> None:
        """The layer's stats were reset: count from now."""
        self.folded = self.counts.copy()


def _place(module, leaf: str):
    """(the module holding tensor `leaf` of a block, its key there): "gate_proj.weight" ->
    (block["gate_proj"], "weight")."""
    *path, key = leaf.split(".")
    for name in path:
        module = module[name]
    return module, key


def link_native(module, layers, index, bypass: str) -> str:
    """Give every streamed layer its NativeDecode (decode_path: native) through the primitive's
    `module` (native_check.native_module). Returns "" or why the Python path serves instead
    (logged once by the caller)."""
    try:
        shards = module.Shards([str(i.path) for i in index.identities],
                               [[i.device, i.inode, i.size, i.mtime_ns] for i in index.identities],
                               bypass != "none")
    except RuntimeError as exc:
        return str(exc)
    for layer in layers:
        layer.native = NativeDecode(module, layer.store, layer.compute, shards)
    return ""
