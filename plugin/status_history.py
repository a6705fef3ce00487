"""The last minutes of each served model's counters, sampled by the server itself so a page
opened now has history at once, and the recent rates computed from them (the status page, the
terminal view and the metrics show the same figures).

Bounded: LENGTH samples, INTERVAL_S apart (ten minutes). Samples hold the monotonic counters
(live_figures.CounterLedger), so a difference between two samples is what happened between
them, across reloads and restarts too."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional

INTERVAL_S = 5.0
LENGTH = 120
RATE_WINDOW_S = 60.0  # the "recent" rates: over the last minute of samples
# What a sample keeps of each model's counters (the plots and rates need no more).
FIELDS = ("hits", "misses", "bytes_read", "read_seconds", "decode_tokens", "decode_seconds", "decode_bytes")


class StatusHistory:
    """Written by the host's sampler only; read by status requests on other threads."""

    def __init__(self, length: int = LENGTH, interval_s: float = INTERVAL_S):
        self.interval_s = interval_s
        self._samples: deque = deque(maxlen=length)
        self._lock = threading.Lock()

    def add(self, counters: dict[str, dict], at: Optional[float] = None) -> None:
        """One sample: {served name: its monotonic counters}."""
        sample = {"t": round(time.time() if at is None else at, 3),
                  "models": {name: [c.get(f, 0) for f in FIELDS] for name, c in counters.items()}}
        with self._lock:
            self._samples.append(sample)

    def as_dict(self) -> dict:
        with self._lock:
            samples = list(self._samples)
        return {"interval_s": self.interval_s, "fields": list(FIELDS), "samples": samples}

    def rates(self, name: str, window_s: float = RATE_WINDOW_S) -> dict:
        """`name`'s rates over the samples of the last `window_s` seconds; None where nothing
        happened (no decode step, no expert looked up)."""
        with self._lock:
            samples = [s for s in self._samples if name in s["models"]]
        if samples:
            newest = samples[-1]["t"]
            samples = [s for s in samples if s["t"] >= newest - window_s]
        if len(samples) < 2:
            return {"window_s": window_s, "tokens_per_second": None, "hit_rate": None,
                    "read_bytes_per_second": None, "bytes_per_token": None}
        first, last = samples[0], samples[-1]
        d = {f: b - a for f, a, b in zip(FIELDS, first["models"][name], last["models"][name])}
        uses = d["hits"] + d["misses"]
        return {
            "window_s": round(last["t"] - first["t"], 1),
            "tokens_per_second": d["decode_tokens"] / d["decode_seconds"] if d["decode_tokens"] else None,
            "hit_rate": d["hits"] / uses if uses else None,
            "read_bytes_per_second": d["bytes_read"] / (last["t"] - first["t"]),
            "bytes_per_token": d["decode_bytes"] / d["decode_tokens"] if d["decode_tokens"] else None,
        }


def add_figures(status: dict, history: StatusHistory, counters: dict, requests: dict, memory: dict) -> dict:
    """The status document (`ReloadRecord.as_dict()`) with what the operator's views read:
    per model its monotonic `counters`, `requests` (in flight, queued), the serving process's
    `memory` and the recent `rates`, where the host has them; the `history` at the top."""
    for name, model in status["models"].items():
        model["counters"] = counters.get(name)
        model["requests"] = requests.get(name)
        model["memory"] = memory.get(name)
        model["rates"] = history.rates(name) if name in counters else None
    status["history"] = history.as_dict()
    return status
