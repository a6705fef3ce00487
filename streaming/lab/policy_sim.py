"""Replay a routing trace through an eviction policy, and Belady's optimum as the ceiling.

The definition (it reproduces the reference table of ``shared/moe_traces/README.md``):

- Every MoE layer has its own cache of ``C = max(top_k, round(share * num_experts))`` slots
  (Python's round: half to even), empty at the start of the trace and carried across requests
  (no reset at ``seq_start``).
- Only decode tokens (``phase == 1``; every token when the trace has no phase) are replayed, one
  at a time in trace order; prefill tokens neither touch the cache nor count (the engine's
  prefill goes through its own expert-major sweep). ``include_prefill=True`` replays them too,
  updating cache and policy state without counting them (not the reference definition: it
  moves the numbers by up to 0.2 points, e.g. qwen15 at 50 %: Belady 80.4 instead of 80.2).
  Replayed token ``t`` (0, 1, ... over replayed tokens) is one policy step, ``step = t``; its
  top-k experts are the step's accesses: a hit if resident before the step, else a miss.
- Per step the policy sees what the engine's cache (streaming/cache.py) gives it for one
  decode call of a layer: ``on_access(experts, t)`` first (the token's experts in ascending id
  order, as ``np.unique`` gives them, hits and misses), then, when the misses do not fit in the
  free slots, ``choose_victims(resident, n, protected)`` with the token's own experts protected
  (pinned), then ``on_evict`` per victim and ``on_insert`` per missed expert in ascending id
  order. The misses beyond the free slots are first offered with their victims to
  ``admission``; a miss it declines is not inserted (read for its token only) and its victim
  stays. After warm-up the cache stays full.
  tests/engine/test_policy.py replays traces through the engine's ``ExpertCache`` (access first, and
  placed first as a warm start does) and checks it misses what this simulator misses.
- Hit rate of a layer = hits / accesses over the replayed decode tokens.
- The trace's hit rate is the unweighted mean of its layers' hit rates, in percent.
- Belady: on eviction, the unprotected resident whose next access (over the replayed tokens) is
  farthest in the future; never-used-again experts first (ties: lowest id).
- LRU ties: `lru` stamps a call's experts in reverse of the order given (the first listed is the
  most recent) and stamps an expert again when inserted, so this call's misses are more recent
  than its hits. With the replay order above this reproduces the reference table (made in
  router rank order) to 0.2 points; the tie order alone moves the batched traces' LRU that much.

The policy objects are the engine's own (``expert_stream.streaming.policy``), driven through
exactly the interface the engine's cache calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..budget import REBALANCE_EVERY, HitCurve, rebalance
from ..policy import EvictionPolicy, POLICIES, make_policy, placed_misses
from ..traces import RoutingTrace

NEVER = 1 << 40   # "never used again"; times num_experts stays far below int64 overflow


def capacity_for(share: float, num_experts: int, top_k: int) -> int:
    """Slots per layer for a cache holding ``share`` of a layer's experts (at least top_k)."""
    if share > 1.0 or share <= 0:
        raise ValueError(f"capacity share must be in (0, 1], got {share}")
    return int(min(num_experts, max(top_k, round(share * num_experts))))


class BeladyPolicy(EvictionPolicy):
    """Offline optimum: evicts the expert whose next use is farthest. Needs the future, so it
    is built from the exact step sequence the simulator will feed (``steps[s]`` = experts of
    step s) and is not in the policy registry."""

    name = "belady"

    def __init__(self, num_experts: int, capacity: int, steps: np.ndarray):
        super().__init__(num_experts, capacity)
        steps = np.asarray(steps, dtype=np.int64)           # (S, K) distinct ids per row
        S, K = steps.shape
        flat = steps.ravel()
        pos = np.repeat(np.arange(S, dtype=np.int64), K)
        order = np.lexsort((pos, flat))                     # by expert, then time
        nxt = np.full(flat.size, NEVER, dtype=np.int64)
        same = flat[order[1:]] == flat[order[:-1]]
        nxt[order[:-1][same]] = pos[order[1:][same]]
        self.steps = steps
        self.next_of_row = nxt.reshape(S, K)
        # Each expert's first use: a cache that starts full holds experts not yet accessed.
        self.next_use = np.full(num_experts, NEVER, dtype=np.int64)
        first = order[np.r_[True, flat[order[1:]] != flat[order[:-1]]]] if flat.size else order
        self.next_use[flat[first]] = pos[first]

    def on_access(self, experts, step):
        self.now = step
        self.next_use[self.steps[step]] = self.next_of_row[step]

    def choose_victims(self, resident, count, protected):
        cand = resident[~protected]
        # farthest next use first; ties (e.g. never used again) -> lowest id
        key = -(self.next_use[cand] * self.num_experts) + cand
        if count >= cand.size:
            return cand
        return cand[np.argpartition(key, count - 1)[:count]]


@dataclass
class LayerResult:
    hits: int
    accesses: int
    misses_all: int          # misses over every token (prefill included)

    @property
    def hit_rate(self) -> float:
        return 100.0 * self.hits / self.accesses if self.accesses else float("nan")


def _distinct_rows(ids_l: np.ndarray) -> np.ndarray:
    s = np.sort(ids_l, axis=1)
    if ids_l.shape[1] > 1 and (s[:, 1:] == s[:, :-1]).any():
        raise ValueError("a token routes to the same expert twice; the simulator expects "
                         "distinct top-k ids per token")
    return ids_l


def simulate_layer(ids_l: np.ndarray, policy: EvictionPolicy, capacity: int,
                   counted: np.ndarray | None = None, check: bool = False,
                   initial: np.ndarray | None = None) -> LayerResult:
    """Replay one layer's (tokens, top_k) expert ids through ``policy`` with ``capacity`` slots,
    starting empty or holding the experts ``initial`` (``policy`` then carries their history)."""
    rows = np.ascontiguousarray(np.sort(_distinct_rows(np.asarray(ids_l)), axis=1), dtype=np.int64)
    T, K = rows.shape
    E = policy.num_experts
    if capacity < K:
        raise ValueError(f"capacity {capacity} < top_k {K}: a token's experts must fit")
    if counted is None:
        counted = np.ones(T, dtype=bool)
    counted_l = counted.tolist()
    rows_l = rows.tolist()
    resident = np.full(capacity, -1, dtype=np.int64)
    slot_of = [-1] * E
    held = [] if initial is None else np.asarray(initial, dtype=np.int64).tolist()
    if len(held) > capacity:
        raise ValueError(f"{len(held)} initial experts do not fit {capacity} slots")
    for s, e in enumerate(held):
        resident[s], slot_of[e] = e, s
    free = list(range(capacity - 1, len(held) - 1, -1))    # pop() gives the lowest free slot first
    need = np.zeros(E, dtype=bool)
    on_access, on_insert, on_evict = policy.on_access, policy.on_insert, policy.on_evict
    hits = acc = misses_all = 0
    for t in range(T):
        row = rows_l[t]
        miss = [e for e in row if slot_of[e] < 0]
        nm = len(miss)
        if counted_l[t]:
            hits += K - nm
            acc += K
        misses_all += nm
        rt = rows[t]
        on_access(rt, t)
        if not nm:
            continue
        if nm > len(free):
            cnt = nm - len(free)
            n = capacity - len(free)
            res = resident if n == capacity else resident[np.array(
                [s for s in range(capacity) if resident[s] >= 0], dtype=np.int64)]
            need[rt] = True
            prot = need[res]
            need[rt] = False
            inspect = (lambda v: _check_victims(res, prot, cnt, v.tolist())) if check else None
            placed, victims = placed_misses(policy, np.array(miss, dtype=np.int64), len(free), res, prot, inspect)
            miss = placed.tolist()
            for v in victims.tolist():
                s = slot_of[v]
                slot_of[v] = -1
                resident[s] = -1
                free.append(s)
                on_evict(v)
        for e in miss:
            s = free.pop()
            resident[s] = e
            slot_of[e] = s
            on_insert(e)
    return LayerResult(hits, acc, misses_all)


def _check_victims(resident, protected, count, victims):
    allowed = set(resident[~protected].tolist())
    if len(victims) != count or len(set(victims)) != count or not set(victims) <= allowed:
        raise AssertionError(
            f"policy returned victims {victims} for count={count}; allowed {sorted(allowed)}")


def simulate(trace: RoutingTrace, policy: str | type, share: float,
             layers=None, check: bool = False, include_prefill: bool = False) -> dict:
    """Hit rate (%) of ``policy`` (a registry name, a class, or "belady") on ``trace``.

    Returns {"hit_rate": mean over layers, "per_layer": [...], "capacity": C,
    "misses_per_token": misses of all layers per counted token}."""
    E, K = int(trace.num_experts), trace.top_k
    C = capacity_for(share, E, K)
    counted = trace.decode_mask()
    if include_prefill:
        replay = slice(None)
    else:
        replay, counted = counted, None
    per_layer, misses = [], 0
    for li in (range(trace.num_layers) if layers is None else layers):
        ids_l = trace.ids[replay, li, :].astype(np.int64)
        if policy == "belady":
            pol = BeladyPolicy(E, C, ids_l)
        elif isinstance(policy, str):
            pol = make_policy(policy, E, C)
        else:
            pol = policy(E, C)
        res = simulate_layer(ids_l, pol, C, counted, check=check)
        per_layer.append(res.hit_rate)
        misses += res.accesses - res.hits
    tokens = int(trace.decode_mask().sum())
    return {"hit_rate": float(np.mean(per_layer)), "per_layer": per_layer, "capacity": C,
            "misses_per_token": misses / max(tokens, 1)}


def evaluate(trace: RoutingTrace, share: float, policies=None, check: bool = False,
             include_prefill: bool = False) -> dict:
    """{policy name: hit rate %} for the given names (default: all registered) plus belady."""
    names = list(POLICIES) if policies is None else list(policies)
    if "belady" not in names:
        names.append("belady")
    out, by_class = {}, {}
    for n in names:
        cls = POLICIES.get(n)
        if cls is None or cls not in by_class:        # aliases ("default") reuse the result
            r = simulate(trace, n, share, check=check, include_prefill=include_prefill)["hit_rate"]
            if cls is None:
                out[n] = r
                continue
            by_class[cls] = r
        out[n] = by_class[cls]
    return out


def hindsight_windows(trace: RoutingTrace, share: float, window: int) -> dict:
    """Each layer holds, over each ``window`` decode tokens, the C experts those tokens use most
    (chosen knowing them; the set changes between windows for free). No policy that predicts a
    window's popular experts from the past can miss less at that window; Belady, which adapts
    token by token, can. Same return keys as ``simulate``."""
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    E, K = int(trace.num_experts), trace.top_k
    C = capacity_for(share, E, K)
    ids = trace.ids[trace.decode_mask()].astype(np.int64)
    T = ids.shape[0]
    per_layer, misses = [], 0
    for li in range(trace.num_layers):
        rows = _distinct_rows(ids[:, li, :])
        missed = 0
        for a in range(0, T, window):
            block = rows[a:a + window]
            kept = np.zeros(E, dtype=bool)
            kept[np.argsort(-np.bincount(block.ravel(), minlength=E), kind="stable")[:C]] = True
            missed += int(np.count_nonzero(~kept[block]))
        per_layer.append(100.0 * (1 - missed / rows.size) if rows.size else float("nan"))
        misses += missed
    return {"hit_rate": float(np.mean(per_layer)), "per_layer": per_layer, "capacity": C,
            "misses_per_token": misses / max(T, 1)}


def gap_closed(policy_rate: float, lru_rate: float, belady_rate: float) -> float:
    """Share (0..1) of the LRU-to-Belady gap a policy closes (nan when there is no gap)."""
    gap = belady_rate - lru_rate
    return (policy_rate - lru_rate) / gap if gap > 1e-9 else float("nan")


class _ResizableLayer:
    """One layer's cache in the budgeted replay: the same call order as ``simulate_layer``,
    with a slot count that can change between tokens."""

    def __init__(self, policy: EvictionPolicy, slots: int):
        self.policy, self.slots = policy, slots
        self.resident: set[int] = set()
        self.curve = HitCurve(policy.num_experts)
        self.hits = self.accesses = 0

    def step(self, row: np.ndarray, t: int) -> int:
        self.curve.record(row)
        miss = [e for e in row.tolist() if e not in self.resident]
        self.policy.on_access(row, t)
        self.accesses += len(row)
        self.hits += len(row) - len(miss)
        placed = miss
        if len(self.resident) + len(miss) > self.slots:
            res = np.fromiter(self.resident, dtype=np.int64, count=len(self.resident))
            placed, victims = placed_misses(self.policy, np.array(miss, dtype=np.int64), self.slots - len(res),
                                            res, np.isin(res, row))
            placed = placed.tolist()
            for v in victims.tolist():
                self.resident.discard(v)
                self.policy.on_evict(v)
        for e in placed:
            self.resident.add(e)
            self.policy.on_insert(e)
        return len(miss)

    def resize(self, slots: int) -> None:
        self.slots = slots
        self.policy.resize(slots)
        over = len(self.resident) - slots
        if over > 0:
            self._evict(over, np.empty(0, dtype=np.int64))

    def _evict(self, count: int, pinned: np.ndarray) -> None:
        res = np.fromiter(self.resident, dtype=np.int64, count=len(self.resident))
        for v in np.asarray(self.policy.choose_victims(res, count, np.isin(res, pinned))).tolist():
            self.resident.discard(v)
            self.policy.on_evict(v)


def simulate_budgeted(trace: RoutingTrace, policy: str, share: float,
                      every: int = REBALANCE_EVERY) -> dict:
    """Misses per decode token of ``policy`` when every layer starts at ``share`` of its experts
    and slots move between layers every ``every`` tokens by the layers' measured hit curves
    (``budget.rebalance``). Same replay definition as ``simulate`` otherwise.

    Returns {"hit_rate": mean over layers, "misses_per_token": ..., "slots": final slots per
    layer, "capacity": C}."""
    E, K = int(trace.num_experts), trace.top_k
    C = capacity_for(share, E, K)
    ids = np.sort(trace.ids[trace.decode_mask()].astype(np.int64), axis=2)
    layers = [_ResizableLayer(make_policy(policy, E, C), C) for _ in range(trace.num_layers)]
    misses = 0
    for t in range(ids.shape[0]):
        for layer, row in zip(layers, ids[t]):
            misses += layer.step(row, t)
        if len(layers) > 1 and t and not t % every:
            new = rebalance([l.curve for l in layers], [l.slots for l in layers], K)
            for layer, n in sorted(zip(layers, new), key=lambda p: p[1] - p[0].slots):
                if n != layer.slots:      # shrinking layers first: the total never exceeds
                    layer.resize(min(n, E))
    return {"hit_rate": float(np.mean([100.0 * l.hits / max(l.accesses, 1) for l in layers])),
            "misses_per_token": misses / max(ids.shape[0], 1),
            "slots": [l.slots for l in layers], "capacity": C}
