"""Eviction policies for a layer's cache of expert slots.

The engine's per-layer cache drives a policy through four calls (this is the whole interface):

    on_access(experts, step)    the distinct expert ids one forward call of this layer uses (hits
                                and misses), once per call, BEFORE any eviction for that call;
                                ``step`` counts this layer's calls (a prefill chunk is one call)
    on_insert(expert, prefetched=False)   an expert was placed in a slot (``prefetched``: a
                                speculative read that no call asked for yet)
    on_evict(expert)            an expert left its slot
    choose_victims(resident, count, protected) -> ids
                                ``count`` distinct ids from ``resident[~protected]``

These run per MoE layer per token on the decode path, so every call is a handful of numpy
operations on arrays indexed by expert id (no per-call dicts, no Python loops over experts).

Time inside a policy is measured in *accesses* (the number of expert ids seen by ``on_access``),
and every horizon is a multiple of the cache's capacity C, so one constant means the same thing
for top-1 and top-8 models and for any cache size.

Policies (``POLICIES``; ``make_policy(name, num_experts, capacity)``):

- ``lru``: least recently used (the floor).
- ``lfu``: aging LFU: exponentially decayed access count, half-life 64 C accesses.
- ``lrfu``: the same decayed count with half-life 4 C (between LRU and LFU).
- ``lrfu-window``: decayed count (half-life 16 C), but experts used within the last C accesses
  are evicted only after all others.
- ``slru``: segmented LRU (probation / protected, protected share 80 %).
- ``arc``: adaptive replacement cache (recency and frequency lists with ghost lists).
- ``lru2``: LRU-2 (evict the oldest second-to-last use; once-used experts first).
- ``adaptive`` (= ``default``): a panel of those scores with horizons from pure recency to
  128 C; each call it checks which panel member would have held the call's experts (a member's
  virtual cache is its top-C experts by score) and evicts by the member with the most such
  virtual hits over the last ~16 C accesses. See ``AdaptivePolicy``.

All policies are deterministic (ties go to the least recently used expert).

Why this default (hit % of decode tokens, ``policy_sim`` replay of shared/moe_traces; share of
the LRU-to-Belady gap closed at 10 / 25 / 50 % capacity):

    llama4 (top-1, single stream)      12 / 22 / 40 %
    qwen15 (top-4, 25 batched streams) 13 / 15 / 20 %
    olmoe  (top-8, batched)             - / 42 / 38 %   (10 %: C = top_k, nothing to choose)

- No fixed horizon fits every trace: single-stream decode wants recency plus a short frequency
  memory (decayed count, half-life 2-4 C, best with a recency window), batched traces want long
  memory (64 C and more, LFU-like), and each loses to LRU on the other kind (``lfu`` is 13
  points of gap below LRU on llama4). The panel follows whichever fits; it is within about a
  point of the best fixed member on every trace and capacity.
- Closing half the gap is out of reach for these traces: batched decode routes almost like
  independent draws from a drifting popularity (overlap of consecutive tokens 0.10 vs 0.07 for
  independent draws), and even an oracle told each expert's true frequency over the whole
  trace closes 11 % (qwen15) and 42 % (olmoe) at 25 %; on llama4 an oracle told each request's
  own expert counts closes 39 %. What Belady exploits there is exact timing.
- Constants (panel horizons 2, 8, 32, 128 C; window C; judge half-life 16 C) were picked by
  leave-one-out over the three traces among 33 panel variants; the scores are flat (the mean
  gap closed of the top 10 variants is within 1 point), so the structure matters, not the
  digits. The llama4 halves (by request) give 15 / 25 / 36 % and 10 / 18 / 41 %.
- Other candidates (kept under their names): ``lfu`` wins batched traces but loses single
  stream; ``lrfu`` and ``lrfu-window`` are the reverse; ``slru``, ``arc`` and ``lru2`` trail;
  an online hazard model over (age, inter-reference gap), a reuse-interval predictor, a
  first-order Markov next-expert model and shadow-cache ensembles were tried and dropped (none
  beat the panel on any trace; the Markov model also needs an E x E table).
"""

from __future__ import annotations

import numpy as np


class EvictionPolicy:
    """Base class. Subclasses keep numpy arrays indexed by expert id."""

    name: str = "base"

    def __init__(self, num_experts: int, capacity: int):
        if num_experts < 1 or capacity < 1:
            raise ValueError(f"num_experts and capacity must be >= 1, got {num_experts}, {capacity}")
        self.num_experts = int(num_experts)
        self.capacity = int(capacity)
        # recency stamps (shared by every policy for tie-breaks): larger = more recent
        self.stamp = np.zeros(self.num_experts, dtype=np.float64)
        self.clock = 0.0

    # -- recency bookkeeping shared by all policies ------------------------------------------
    def _touch(self, experts: np.ndarray) -> None:
        # the first id listed becomes the most recent (top-1 of the router first)
        k = len(experts)
        self.stamp[experts[::-1]] = np.arange(self.clock + 1.0, self.clock + k + 1.0)
        self.clock += k

    def on_access(self, experts: np.ndarray, step: int) -> None:
        self._touch(experts)

    def on_insert(self, expert: int, prefetched: bool = False) -> None:
        # an inserted expert is more recent than this call's hits
        self.clock += 1.0
        self.stamp[expert] = self.clock

    def on_evict(self, expert: int) -> None:
        pass

    def choose_victims(self, resident: np.ndarray, count: int, protected: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------
    def _pick(self, cand: np.ndarray, key: np.ndarray | None, count: int) -> np.ndarray:
        """The ``count`` candidates with the lowest key (ties: least recent). key None: LRU."""
        if count >= cand.size:
            return cand.copy()
        st = self.stamp[cand]
        if key is None:
            order = np.argpartition(st, count - 1)[:count] if count > 1 else [np.argmin(st)]
            return cand[order]
        if count == 1:
            m = key == key.min()
            i = np.flatnonzero(m)
            return cand[i[np.argmin(st[i])]][None] if i.size > 1 else cand[i]
        return cand[np.lexsort((st, key))[:count]]


class LRUPolicy(EvictionPolicy):
    """Least recently used. Within one call the first listed expert counts as the most recent,
    and an expert inserted by the call is more recent than the call's hits."""

    name = "lru"

    def choose_victims(self, resident, count, protected):
        return self._pick(resident[~protected], None, count)


class DecayedCountPolicy(EvictionPolicy):
    """Exponentially decayed access count (LRFU): each access adds 1, every access anywhere
    multiplies all counts by 2**(-1 / (half_life * C)). Evicts the lowest count.

    ``window`` > 0: experts used within the last ``window * C`` accesses go after all others."""

    name = "lrfu"
    half_life = 4.0        # in multiples of C accesses
    window = 0.0           # in multiples of C accesses

    def __init__(self, num_experts, capacity):
        super().__init__(num_experts, capacity)
        self.score = np.zeros(self.num_experts, dtype=np.float64)
        self.decay = 0.5 ** (1.0 / (self.half_life * self.capacity))
        self._calls = 0

    def on_access(self, experts, step):
        self.score *= self.decay ** len(experts)
        self.score[experts] += 1.0
        self._touch(experts)
        self._calls += 1
        if not self._calls & 1023:       # keep long-unused scores out of denormal range
            self.score[self.score < 1e-200] = 0.0

    def choose_victims(self, resident, count, protected):
        cand = resident[~protected]
        key = self.score[cand]
        if self.window > 0:
            key = key + (self.clock - self.stamp[cand] < self.window * self.capacity) * 1e12
        return self._pick(cand, key, count)


class LFUPolicy(DecayedCountPolicy):
    name = "lfu"
    half_life = 64.0


class LRFUWindowPolicy(DecayedCountPolicy):
    name = "lrfu-window"
    half_life = 16.0
    window = 1.0


class SLRUPolicy(EvictionPolicy):
    """Segmented LRU: an expert hit while resident moves to the protected segment (at most
    ``protected_share`` of C; the least recent protected ones fall back to probation); victims
    come from probation first, LRU within a segment."""

    name = "slru"
    protected_share = 0.8

    def __init__(self, num_experts, capacity):
        super().__init__(num_experts, capacity)
        self.resident = np.zeros(self.num_experts, dtype=bool)
        self.prot = np.zeros(self.num_experts, dtype=bool)
        self.prot_cap = max(1, int(round(self.protected_share * self.capacity)))

    def on_access(self, experts, step):
        self._touch(experts)
        hit = experts[self.resident[experts]]
        if hit.size:
            self.prot[hit] = True
            over = int(np.count_nonzero(self.prot)) - self.prot_cap
            if over > 0:
                p = np.flatnonzero(self.prot)
                self.prot[p[np.argpartition(self.stamp[p], over - 1)[:over]]] = False

    def on_insert(self, expert, prefetched=False):
        super().on_insert(expert, prefetched)
        self.resident[expert] = True

    def on_evict(self, expert):
        self.resident[expert] = False
        self.prot[expert] = False

    def choose_victims(self, resident, count, protected):
        cand = resident[~protected]
        return self._pick(cand, self.prot[cand].astype(np.float64), count)


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement cache: T1 (seen once lately), T2 (seen again), ghost lists B1/B2 of
    recently evicted ids; a ghost hit in B1 grows T1's target p, in B2 shrinks it."""

    name = "arc"
    _T1, _T2, _B1, _B2 = 1, 2, 3, 4

    def __init__(self, num_experts, capacity):
        super().__init__(num_experts, capacity)
        self.list = np.zeros(self.num_experts, dtype=np.int8)   # 0: unknown
        self.p = 0.0

    def on_access(self, experts, step):
        st = self.list[experts]
        n_b1 = int(np.count_nonzero(self.list == self._B1))
        n_b2 = int(np.count_nonzero(self.list == self._B2))
        g1 = int(np.count_nonzero(st == self._B1))
        g2 = int(np.count_nonzero(st == self._B2))
        if g1:
            self.p = min(float(self.capacity), self.p + g1 * max(1.0, n_b2 / max(n_b1, 1)))
        if g2:
            self.p = max(0.0, self.p - g2 * max(1.0, n_b1 / max(n_b2, 1)))
        self.list[experts] = np.where(st == 0, self._T1, self._T2)
        self._touch(experts)

    def on_insert(self, expert, prefetched=False):
        super().on_insert(expert, prefetched)
        if self.list[expert] == 0:      # a prefetch nobody asked for yet: a new T1 entry
            self.list[expert] = self._T1

    def on_evict(self, expert):
        lst = self.list
        lst[expert] = self._B1 if lst[expert] == self._T1 else self._B2
        C = self.capacity
        b1 = np.flatnonzero(lst == self._B1)
        if b1.size and np.count_nonzero(lst == self._T1) + b1.size > C:
            lst[b1[np.argmin(self.stamp[b1])]] = 0
        b2 = np.flatnonzero(lst == self._B2)
        if b2.size and np.count_nonzero(lst) > 2 * C:
            lst[b2[np.argmin(self.stamp[b2])]] = 0

    def choose_victims(self, resident, count, protected):
        cand = resident[~protected]
        in_t1 = self.list[cand] == self._T1
        n1 = int(np.count_nonzero(self.list == self._T1))
        # take from T1 while it is above its target p (LRU first), then from T2
        from_t1 = min(int(np.count_nonzero(in_t1)), max(0, n1 - int(max(1.0, self.p))), count)
        if from_t1 < count and np.count_nonzero(~in_t1) < count - from_t1:
            from_t1 = count - int(np.count_nonzero(~in_t1))
        out = []
        if from_t1:
            out.append(self._pick(cand[in_t1], None, from_t1))
        if count - from_t1:
            out.append(self._pick(cand[~in_t1], None, count - from_t1))
        return np.concatenate(out)


class LRU2Policy(EvictionPolicy):
    """LRU-2: evicts the expert whose second-to-last use is oldest (once-used experts first)."""

    name = "lru2"

    def __init__(self, num_experts, capacity):
        super().__init__(num_experts, capacity)
        self.prev = np.full(self.num_experts, -1.0)

    def on_access(self, experts, step):
        self.prev[experts] = self.stamp[experts]
        self._touch(experts)

    def choose_victims(self, resident, count, protected):
        cand = resident[~protected]
        return self._pick(cand, self.prev[cand], count)


class AdaptivePolicy(EvictionPolicy):
    """A panel of eviction scores; the one that fits the recent past drives eviction.

    Panel members, all kept for every expert (resident or not):
      - recency (LRU);
      - decayed counts (LRFU) with half-lives ``HALF_LIVES`` x C accesses, from nearly LRU to
        nearly LFU;
      - the counts of ``WINDOW_HALF_LIVES`` with a recency window: experts used within the last
        ``WINDOW`` x C accesses rank above all others.
    A member's virtual cache is its C highest-ranked experts. Before each call updates the
    scores, every member earns one point per expert of the call inside its virtual cache; points
    decay with half-life ``JUDGE_HALF_LIFE`` x C accesses. Victims are the lowest-ranked
    candidates of the member with the most points (ties: the earlier member, LRU first; so the
    policy starts as LRU). Recency-heavy members win on single-stream decode, where consecutive
    tokens reuse experts; long-horizon counts win where routing is close to independent draws
    from a skewed popularity (batched serving), and the judge follows drift between the two.
    """

    name = "adaptive"
    HALF_LIVES = (2.0, 8.0, 32.0, 128.0)
    WINDOW_HALF_LIVES = (32.0, 128.0)
    WINDOW = 1.0
    JUDGE_HALF_LIFE = 16.0
    JUDGE_EVERY = 1    # judge every n-th call only (cost); points then count n calls' experts
    _BIG = 1e12        # added to windowed scores; decayed counts stay below 128 C / ln 2 << 1e12

    def __init__(self, num_experts, capacity):
        super().__init__(num_experts, capacity)
        E = self.num_experts
        hl = np.asarray(self.HALF_LIVES, dtype=np.float64)
        nh = hl.size
        self.win_rows = np.array([self.HALF_LIVES.index(h) for h in self.WINDOW_HALF_LIVES],
                                 dtype=np.int64)
        self.members = 1 + nh + self.win_rows.size
        # one matrix of ranking keys, one row per member; stamp and scores are views into it
        self.key = np.zeros((self.members, E), dtype=np.float64)
        self.key[0] = self.stamp
        self.stamp = self.key[0]
        self.score = self.key[1:1 + nh]
        self.wkey = self.key[1 + nh:]
        wr = self.win_rows
        if wr.size and np.array_equal(wr, np.arange(wr[0], wr[0] + wr.size)):
            self.win_src = self.score[wr[0]:wr[0] + wr.size]      # a view: no gather per call
        else:
            self.win_src = None
        self._tmp = np.zeros(E, dtype=np.float64)
        self._decay_base = 0.5 ** (1.0 / (hl * self.capacity))
        self._decay = {}                          # k -> (nh, 1) decay factors for a k-id call
        self.points = np.zeros(self.members, dtype=np.float64)
        self._judge_base = 0.5 ** (1.0 / (self.JUDGE_HALF_LIFE * self.capacity))
        self._judge = {}
        self.window = self.WINDOW * self.capacity
        self._kth = self.num_experts - self.capacity      # C-th largest, ascending index
        self._judging = self.capacity < self.num_experts and self.members > 1
        self.leader = 0
        self._calls = 0

    def on_access(self, experts, step):
        k = len(experts)
        if self._judging and not self._calls % self.JUDGE_EVERY:
            key = self.key
            if self.win_rows.size:
                tmp = self._tmp
                np.multiply(self.stamp > (self.clock - self.window), self._BIG, out=tmp)
                src = self.score[self.win_rows] if self.win_src is None else self.win_src
                np.add(src, tmp, out=self.wkey)
            th = np.partition(key, self._kth, axis=1)[:, self._kth]
            inside = np.count_nonzero(key.take(experts, axis=1) >= th[:, None], axis=1)
            jd = self._judge.get(k)
            if jd is None:
                jd = self._judge[k] = self._judge_base ** (k * self.JUDGE_EVERY)
            self.points *= jd
            self.points += inside
            self.leader = int(self.points.argmax())
        d = self._decay.get(k)
        if d is None:
            d = self._decay[k] = (self._decay_base ** k)[:, None]
        self.score *= d
        self.score[:, experts] += 1.0
        self._touch(experts)
        self._calls += 1
        if not self._calls & 1023:                  # keep long-unused counts out of denormals
            self.score[self.score < 1e-200] = 0.0

    def choose_victims(self, resident, count, protected):
        cand = resident[~protected]
        j = self.leader
        if j == 0:
            return self._pick(cand, None, count)
        nh = self.score.shape[0]
        if j <= nh:
            return self._pick(cand, self.score[j - 1, cand], count)
        key = self.score[self.win_rows[j - 1 - nh], cand]
        key = key + (self.stamp[cand] > (self.clock - self.window)) * self._BIG
        return self._pick(cand, key, count)


DEFAULT = "adaptive"

POLICIES: dict[str, type] = {
    cls.name: cls
    for cls in (LRUPolicy, LFUPolicy, DecayedCountPolicy, LRFUWindowPolicy, SLRUPolicy,
                ARCPolicy, LRU2Policy, AdaptivePolicy)
}
POLICIES["default"] = POLICIES[DEFAULT]


def make_policy(name: str, num_experts: int, capacity: int) -> EvictionPolicy:
    """A fresh policy for one layer's cache; ``name`` is a key of ``POLICIES``."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(num_experts, capacity)
