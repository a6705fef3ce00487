"""Every rank's cache counters, on rank 0, through mlx.distributed: each rank puts its counters in
a fixed-size int64 row and all ranks all_gather the rows at a point they pass together (between
two requests of mlx_lm.server's generation loop, right after it shares the next request). No
side channel: the ranks' only link is the pipeline's own group.

Besides the counters of its loaded handle, each rank sends its monotonic counters per served
name (its own CounterLedger: they keep growing across the rank's reloads) and its memory."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from expert_stream.plugin.live_figures import COUNTERS, MEMORY, CounterLedger, handle_counters, process_memory

log = logging.getLogger("expert_stream")

# One row per rank; read_us is microseconds the compute thread waited for reads; the monotonic
# counters follow (seconds as microseconds), then the rank's memory.
FIELDS = ("loaded", "first_layer", "end_layer", "streamed_layers", "resident_layers", "slot_bytes", "slots",
          "calls", "hits", "misses", "evictions", "bytes_read", "read_us",
          *(f"counter_{c}" for c in COUNTERS), *MEMORY, "reload_wanted")


class RankStats:
    """The latest rows of every rank (written by the generation thread, read by status)."""

    def __init__(self, group):
        self.group = group
        self._lock = threading.Lock()
        self._rows: np.ndarray | None = None
        self._model_id: str | None = None
        self._at: float | None = None
        self.ledger = CounterLedger()  # this rank's monotonic counters per served name
        self._handle = None  # the handle this rank's ledger counts now (a weak reference)

    def exchange(self, model, handle, model_id: str | None, reload_wanted: bool = False) -> bool:
        """Called by every rank at the same step: gather every rank's counters. Returns whether
        any rank wants a reload (pipeline_reload decides it next, on every rank)."""
        import mlx.core as mx

        row = np.zeros(len(FIELDS), dtype=np.int64)
        try:
            row[:] = self._row(model, handle, model_id)
        except Exception as exc:  # counters must never stop the loop: this row reads as unloaded
            log.warning("expert-stream: rank %d counters unreadable: %s", self.group.rank(), exc)
            row[:] = 0
        row[-1] = reload_wanted
        rows = np.array(mx.distributed.all_gather(mx.array(row), group=self.group, stream=mx.cpu))
        with self._lock:
            self._rows = rows.reshape(self.group.size(), len(FIELDS))
            self._model_id = model_id
            self._at = time.time()
        return bool(self._rows[:, -1].any())

    def status(self) -> dict:
        """What `status` shows: one entry per rank, as of the last exchange."""
        with self._lock:
            rows, at, model_id = self._rows, self._at, self._model_id
        out = {"ranks": self.group.size(), "rank": self.group.rank(), "model": model_id,
               "as_of": at, "age_seconds": None if at is None else round(time.time() - at, 2), "per_rank": []}
        if rows is None:
            return out
        for rank, values in enumerate(rows):
            entry = dict(zip(FIELDS, (int(v) for v in values)))
            entry.pop("reload_wanted")
            entry["loaded"] = bool(entry["loaded"])
            entry["read_seconds"] = entry.pop("read_us") / 1e6
            entry["counters"] = {c: entry.pop(f"counter_{c}") / (1e6 if c.endswith("seconds") else 1)
                                 for c in COUNTERS}
            uses = entry["hits"] + entry["misses"]
            entry["hit_rate"] = entry["hits"] / uses if uses else 0.0
            entry["layers"] = [entry.pop("first_layer"), entry.pop("end_layer")]
            out["per_rank"].append({"rank": rank, **entry})
        return out

    def _row(self, model, handle, model_id) -> list[int]:
        import weakref

        if model is None or handle is None:
            return [0] * len(FIELDS)
        counters = handle_counters(handle)
        if self._handle is None or self._handle() is not handle:  # a load: the entry's handle before is done
            for gone in self.ledger.sources(model_id):
                self.ledger.retire(model_id, gone)
            self._handle = weakref.ref(handle)
        self.ledger.observe(model_id, id(handle), counters)
        totals = self.ledger.totals(model_id)
        monotonic = [int(totals[c] * 1e6) if c.endswith("seconds") else totals[c] for c in COUNTERS]
        return _handle_row(model, handle) + monotonic + [int(v) for v in process_memory()] + [0]


def _handle_row(model, handle) -> list[int]:
    inner = getattr(model, "model", None)
    first = int(getattr(inner, "start_idx", 0) or 0)
    end = getattr(inner, "end_idx", None)
    end = int(end) if end is not None else len(getattr(inner, "layers", []))
    totals = {"calls": 0, "hits": 0, "misses": 0, "evictions": 0, "bytes_read": 0, "read_seconds": 0.0}
    for stream in handle.streams:
        stats = stream.cache.stats
        for key in totals:
            totals[key] += getattr(stats, key)
    resident = sum(p.resident for p in handle.plans)
    slots = sum(stream.cache.num_slots for stream in handle.streams)
    return [1, first, end, len(handle.streams), resident, handle.budget_bytes, slots, totals["calls"], totals["hits"],
            totals["misses"], totals["evictions"], totals["bytes_read"], int(totals["read_seconds"] * 1e6)]
