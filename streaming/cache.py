"""Per-layer expert cache: which expert sits in which slot, who gets evicted, and the counters.

The cache only does bookkeeping over expert ids and slot numbers; the slot memory is
`ExpertSlots` and the bytes come from the reader. Eviction decisions are delegated to a policy
object (streaming/policy.py), the same code the trace simulator runs.

A slot claims an expert only once its bytes have arrived: `place` reserves slots for experts
about to be read (their victims are evicted at once, since their bytes are about to be
overwritten), `claim` makes them resident after the read, `release` frees them after a failed
one. A read that fails or is abandoned therefore never leaves a slot claiming bytes it did not
receive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .policy import AccessOrder, make_policy, placed_misses

EMPTY = -1


def among(values: np.ndarray, members: np.ndarray, size: int) -> np.ndarray:
    """Bool mask: which of `values` (ids in [0, size)) are in `members`. np.isin's result for a
    layer's few expert ids, without its sorts (a decode call makes several of these a layer).
    Negative members (EMPTY) are ignored."""
    members = np.asarray(members)
    mark = np.zeros(size, dtype=bool)
    mark[members[members >= 0]] = True
    return mark[values]


@dataclass
class LayerStats:
    """One layer's counters. The cache counts its accesses and evictions; the layer's
    ExpertStore counts reads, lookahead and path events (its `count_*` methods); others read."""

    calls: int = 0
    hits: int = 0  # expert-uses served from a slot (an expert counts once per call)
    misses: int = 0  # expert-uses that had to be read
    evictions: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # wall time the compute thread waited for reads
    reads_landed: int = 0  # experts read whose bytes were in when the compute thread came for them
    reads_waited: int = 0  # experts read whose bytes the compute thread had to wait for
    prefetch_reads: int = 0  # reads of guessed experts issued by the lookahead
    prefetch_hits: int = 0  # of those, experts a later call used before eviction
    guess_buffer_hits: int = 0  # of those, misses whose bytes came from the side buffer (no read then)
    readahead_reads: int = 0  # experts a prompt pass read as a chunk's routing arrived (prefill_readahead_gib)
    readahead_hits: int = 0  # misses whose bytes came from those reads (no read then)
    guesses: int = 0  # experts the lookahead guessed for this layer from the layer before
    guess_hits: int = 0  # of those, experts the layer then used
    far_guesses: int = 0  # experts guessed for this layer from two or more layers before
    far_guess_hits: int = 0  # of those, experts the layer then used
    demand_calls: int = 0  # routed calls that read an expert from the shards (not the side buffer)
    syncs: int = 0  # times the compute thread waited for the device (routing readback, settles)
    sync_seconds: float = 0.0  # wall time of those waits
    sweep_calls: int = 0  # calls that needed more experts than the layer has slots
    overlap_calls: int = 0  # decode calls whose hits computed while their misses were read
    resident_calls: int = 0  # calls with every expert in a slot: no sync, hits not counted
    skipped_misses: int = 0  # lossy skip_miss_below: misses dropped instead of read
    bypassed: int = 0  # misses the policy did not admit: read for their call into scratch, not kept

    def as_dict(self) -> dict:
        return asdict(self)


class ExpertCache:
    """Expert -> slot table for one MoE layer with `num_slots` slots over `num_experts` experts."""

    def __init__(self, num_experts: int, num_slots: int, policy: str = "default"):
        if num_slots < 1:
            raise ValueError("an expert cache needs at least one slot")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.slot_of = np.full(num_experts, EMPTY, dtype=np.int32)
        self.expert_in = np.full(num_slots, EMPTY, dtype=np.int32)
        self.incoming = np.full(num_slots, EMPTY, dtype=np.int32)  # reserved for a read in flight
        # Experts placed by a prefetch that no call has used yet (to score the lookahead).
        self.prefetched = np.zeros(num_experts, dtype=bool)
        self.held = 0  # experts resident now
        self.policy = AccessOrder(make_policy(policy, num_experts, num_slots))
        self.curve = None  # budget.HitCurve while online budgets are on
        self.stats = LayerStats()
        self.step = 0
        self.version = 0  # bumped whenever the expert -> slot table changes
        self.last_needed = np.empty(0, dtype=np.int64)  # experts of the latest access
        self._decided = None  # (placed, victims) of the latest admitted(), for the place() after it

    def resident(self, experts: np.ndarray) -> np.ndarray:
        """Bool mask: which of `experts` sit in a slot now."""
        return self.slot_of[experts] != EMPTY

    def access(self, needed: np.ndarray) -> np.ndarray:
        """Record one call that uses the unique experts `needed`; return the ones missing."""
        self.step += 1
        self.last_needed = needed
        self._decided = None
        self.stats.calls += 1
        self.policy.on_access(needed, self.step)
        if self.curve is not None:
            self.curve.record(needed)
        hit = self.resident(needed)
        used_spec = needed[hit & self.prefetched[needed]]
        if used_spec.size:
            self.stats.prefetch_hits += int(used_spec.size)
            self.prefetched[used_spec] = False
        missing = needed[~hit]
        self.stats.hits += needed.size - missing.size
        self.stats.misses += missing.size
        return missing

    def admitted(self, missing: np.ndarray, protected: np.ndarray) -> np.ndarray:
        """Of a call's `missing` experts, the ones that take a slot: all that find a free one,
        and of the rest those the policy admits against the victims it would evict for them
        (the simulator, policy_sim.py, decides the same way). The others are read for the call
        only and leave every slot as it was."""
        free = int(np.count_nonzero((self.expert_in == EMPTY) & (self.incoming == EMPTY)))
        if missing.size <= free:
            return missing
        resident = self.expert_in[self.expert_in != EMPTY]
        guard = among(resident, protected, self.num_experts)
        if int((~guard).sum()) < missing.size - free:
            return missing  # place() refuses it with the counts
        placed, victims = placed_misses(self.policy, missing, free, resident, guard)
        self._decided = (placed, victims)  # place() evicts these for them: one decision a call
        return placed

    def holds_all(self) -> bool:
        """Every expert of the layer sits in a slot: the table cannot change any more."""
        return self.held == self.num_experts

    def place(self, experts: np.ndarray, protected: np.ndarray, prefetched: bool = False) -> np.ndarray:
        """Reserve a slot for each of `experts` (not resident, not being read), evicting others
        but never an expert in `protected`; return the slots, aligned with `experts`. The caller
        reads the bytes into them, then calls `claim` (or `release` if the read failed)."""
        decided, self._decided = self._decided, None
        reading = among(experts, self.incoming, self.num_experts)
        if reading.any():
            raise RuntimeError(f"experts {experts[reading].tolist()} are already being read")
        slots = np.empty(len(experts), dtype=np.int32)
        free = np.flatnonzero((self.expert_in == EMPTY) & (self.incoming == EMPTY))
        n_free = min(len(free), len(experts))
        slots[:n_free] = free[:n_free]
        need = len(experts) - n_free
        if need:
            occupied = np.flatnonzero(self.expert_in != EMPTY)
            resident = self.expert_in[occupied]
            guard = among(resident, protected, self.num_experts)
            if int((~guard).sum()) < need:
                raise RuntimeError(
                    f"cannot place {len(experts)} experts: {self.num_slots} slots, "
                    f"{int(guard.sum())} protected, {int((self.incoming != EMPTY).sum())} being read"
                )
            if decided is not None and decided[1].size == need and np.array_equal(decided[0], experts):
                victims = decided[1].astype(np.int32)
            else:
                victims = np.asarray(self.policy.choose_victims(resident, need, guard), dtype=np.int32)
            victim_slots = self.slot_of[victims]
            for v in victims:
                self.policy.on_evict(int(v))
            self.slot_of[victims] = EMPTY
            self.expert_in[victim_slots] = EMPTY
            self.prefetched[victims] = False
            self.stats.evictions += need
            self.held -= need
            self.version += 1
            slots[n_free:] = victim_slots
        self.incoming[slots] = experts
        self.prefetched[experts] = prefetched
        for e in experts:
            self.policy.on_insert(int(e), prefetched)
        return slots

    def claim(self, slots: np.ndarray) -> None:
        """The bytes of the experts reserved in `slots` have arrived: they are resident now."""
        experts = self.incoming[slots]
        self.slot_of[experts] = slots
        self.expert_in[slots] = experts
        self.incoming[slots] = EMPTY
        self.held += len(slots)
        self.version += 1

    def release(self, slots: np.ndarray) -> None:
        """The read into `slots` failed or was abandoned: they hold no valid expert."""
        experts = self.incoming[slots]
        experts = experts[experts != EMPTY]
        self.incoming[slots] = EMPTY
        self.prefetched[experts] = False
        for e in experts:
            self.policy.on_evict(int(e))

    def resize(self, num_slots: int) -> np.ndarray:
        """Change the slot count (online budgets): evict by the policy down to `num_slots` and
        keep the rest in slots 0, 1, ... in their order; returns each new slot's old slot (EMPTY
        for an empty one), for ExpertSlots.resize. No read may be in flight."""
        if (self.incoming != EMPTY).any():
            raise RuntimeError("cannot resize an expert cache while reads into it are in flight")
        occupied = np.flatnonzero(self.expert_in != EMPTY)
        over = occupied.size - num_slots
        if over > 0:
            victims = self.policy.choose_victims(self.expert_in[occupied], over, np.zeros(occupied.size, dtype=bool))
            for v in victims:
                self.policy.on_evict(int(v))
            self.prefetched[victims] = False
            self.stats.evictions += over
            occupied = occupied[~np.isin(self.expert_in[occupied], victims)]
        rows = np.full(num_slots, EMPTY, dtype=np.int32)
        rows[: occupied.size] = occupied
        kept = self.expert_in[occupied]
        self.slot_of[:] = EMPTY
        self.slot_of[kept] = np.arange(kept.size, dtype=np.int32)
        self.expert_in = np.full(num_slots, EMPTY, dtype=np.int32)
        self.expert_in[: kept.size] = kept
        self.incoming = np.full(num_slots, EMPTY, dtype=np.int32)
        self.num_slots = num_slots
        self.held = int(kept.size)
        self.policy.resize(num_slots)
        self.version += 1
        return rows
