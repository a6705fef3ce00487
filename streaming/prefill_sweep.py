"""Expert-major prefill: a call (a prefill chunk) that routes to more experts than the layer
has slots reads each missing expert exactly once, in expert-id order (adjacent experts are
adjacent in the shard, so reads merge into long spans), and computes the chunk's pairs expert
group by expert group.

One sweep serves one call, or every chunk of a prompt pass at one layer (prompt_pass.py): then
each expert any chunk needs is read once for the whole pass, and each chunk's pairs are computed
as that chunk's own stock call would (its sort rule, its kernel's row plan).

Order of work for one sweep:
1. experts already in the slots compute first, from the slots;
2. the most used experts of the last tokens (up to the slot count) are adopted: read into the
   slots they will keep after the call, so decode starts warm (and a long prompt's average
   does not push out what its end, next to decode, uses);
3. the rest stream through a double-buffered scratch block outside the cache (a throwaway
   buffer): batch j+1 is read while batch j computes;
4. the adopted experts compute from the slots.
Every (token, expert) pair is computed by the stock projection layers, sorted exactly when
stock sorts the whole call, in calls shaped to take the kernel stock's whole call takes
(kernel_match.py); outputs are stitched back in routing order by a pure gather.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .expert_calls import ExpertCompute, stitch, token_rows, unflatten_pairs
from .expert_store import ExpertStore
from .slots import ExpertSlots

# Experts per scratch batch (two batches double-buffer). Bigger batches mean fewer kernel
# launches; the scratch costs 2 * SCRATCH_EXPERTS experts of memory, shared by all layers.
SCRATCH_EXPERTS = 8
# Adoption ranks experts by their uses in the sweep's last this many tokens: the tokens nearest
# decode say best what decode needs next (a whole long prompt's counts would adopt its average).
ADOPT_FROM_LAST_TOKENS = 256


class ScratchPool:
    """Two scratch batches per distinct expert layout, shared by every layer of a model (the
    sweep's double buffer; LayerByLayer reads the misses the policy declines into the first)."""

    def __init__(self, write_mode: str, batch: int = SCRATCH_EXPERTS):
        self.write_mode = write_mode
        self.batch = batch
        self._buffers: dict[tuple, list[ExpertSlots]] = {}

    def buffers(self, tensors) -> list[ExpertSlots]:
        key = tuple((t.leaf, t.row_shape, t.info.dtype) for t in tensors)
        if key not in self._buffers:
            self._buffers[key] = [ExpertSlots(tensors, self.batch, self.write_mode) for _ in range(2)]
        return self._buffers[key]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for pair in self._buffers.values() for b in pair)


class PrefillSweep:
    """The path of a call that needs more experts than the layer has slots; with `chunks`, of
    several prefill chunks' calls of one layer at once (prompt_pass.py)."""

    name = "prefill_sweep"

    def __init__(self, store: ExpertStore, compute: ExpertCompute, scratch: ScratchPool | None):
        self.store, self.compute = store, compute
        self.scratch = scratch  # shared by the model's layers

    def __call__(self, x: mx.array, indices: mx.array, call) -> mx.array:
        return self.chunks([x], [call])[0]

    def chunks(self, xs: list[mx.array], calls: list) -> list[mx.array]:
        """Each chunk's output, as stock's call of that chunk computes it, from ONE read of each
        expert any of them needs. Adoption ranks experts by their uses in the last
        ADOPT_FROM_LAST_TOKENS tokens (ties by the whole sweep's uses)."""
        store, compute = self.store, self.compute
        cache = store.cache
        store.count_sweep_call()
        chunks = [_Chunk(x, call) for x, call in zip(xs, calls)]
        needed = np.unique(np.concatenate([c.call.needed for c in chunks]))
        uses = sum(np.bincount(c.flat, minlength=cache.num_experts) for c in chunks)
        recent = np.bincount(_last_tokens(chunks, ADOPT_FROM_LAST_TOKENS), minlength=cache.num_experts)

        missing = cache.access(needed)
        resident = np.setdiff1d(needed, missing)
        hottest = needed[np.lexsort((-uses[needed], -recent[needed]))[: cache.num_slots]]
        adopt = np.setdiff1d(hottest, resident)  # read into the slots they keep
        cold = np.setdiff1d(missing, adopt)  # through the scratch buffers, once each
        outputs = []

        def pairs(experts, slot_of, array_experts, buffer=None):
            """Every chunk's pairs of `experts`, from a tensor of `array_experts` experts (slots
            or scratch), each chunk shaped as its own stock call."""
            ys = []
            for c in chunks:
                pos = np.flatnonzero(np.isin(c.flat, experts))
                if not pos.size:
                    continue
                plan = compute.row_plan(c.flat.size, array_experts, c.call.sorts)
                y, p = compute.pairs(c.rows, pos, slot_of(c.flat[pos]), c.k, c.call.sorts, plan, buffer)
                c.outputs.extend(y)
                c.positions.extend(p)
                ys.extend(y)
            outputs.extend(ys)
            return ys

        def from_cache(experts):
            return cache.slot_of[experts]

        if resident.size:
            y = pairs(resident, from_cache, cache.num_slots)
            mx.async_eval(y)
            store.hold(y)

        batch_size = self.scratch.batch
        buffers = self.scratch.buffers(store.slots.tensors) if cold.size else []
        batches = [cold[i : i + batch_size] for i in range(0, cold.size, batch_size)]
        scratch_reads = _read_batch(store, buffers, batches, 0)
        # The slots of resident experts that are not adopted may be reused once step 1 evaluated
        # (start_reads settles this layer's pending outputs first).
        adopt_reads = store.start_reads(adopt, protected=hottest) if adopt.size else None
        in_use = [None, None]  # the output computing from each scratch buffer
        for j, batch in enumerate(batches):
            store.finish_reads(scratch_reads)
            if j + 1 < len(batches):
                if in_use[(j + 1) % 2] is not None:
                    store.sync(in_use[(j + 1) % 2])  # its buffer is about to be overwritten
                scratch_reads = _read_batch(store, buffers, batches, j + 1)
            buffer = buffers[j % 2]
            local = np.full(cache.num_experts, -1, dtype=np.int32)
            local[batch] = np.arange(batch.size, dtype=np.int32)
            y = pairs(batch, lambda e: local[e], buffer.num_slots, buffer)
            mx.async_eval(y)
            in_use[j % 2] = y
        if adopt_reads is not None:
            store.finish_reads(adopt_reads, pending=[y for ys in in_use if ys is not None for y in ys])
            pairs(adopt, from_cache, cache.num_slots)
        store.sync(outputs)  # scratch buffers are reused by the next layer; slots pinned till here
        store.unpin()
        return [unflatten_pairs(stitch(c.outputs, c.positions, axis=0), c.call.ids.shape) for c in chunks]


class _Chunk:
    """One chunk's call within a sweep: its flat routing, token rows, and outputs so far."""

    __slots__ = ("call", "flat", "rows", "k", "outputs", "positions")

    def __init__(self, x: mx.array, call):
        self.call = call
        self.k = call.ids.shape[-1]
        self.flat = call.ids.reshape(-1)
        self.rows = token_rows(x)
        self.outputs, self.positions = [], []


def _last_tokens(chunks: list[_Chunk], tokens: int) -> np.ndarray:
    """The routed ids of the last `tokens` tokens of the chunks, in order."""
    tail, left = [], tokens
    for c in reversed(chunks):
        take = min(left, c.flat.size // c.k)
        if take:
            tail.append(c.flat[c.flat.size - take * c.k:])
        left -= take
        if not left:
            break
    return np.concatenate(tail[::-1]) if tail else np.zeros(0, dtype=np.int64)


def _read_batch(store, buffers, batches, j):
    if j >= len(batches):
        return None
    batch = batches[j]
    return store.read_into(buffers[j % 2], batch, np.arange(batch.size, dtype=np.int32))
