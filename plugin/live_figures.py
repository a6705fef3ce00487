"""What a process serving a streamed model reports while it runs, and how the counters stay
monotonic per served name when the model behind the name is replaced.

A handle's counters start at zero with each load, and a model process's with each start; an
operator's counters (Prometheus, the status page's history) must only grow. `CounterLedger`
keeps, per served name, the totals of the sources (handles, model processes) that went before
and adds the current ones' figures. Only the host knows when a source goes, so it says so
(`retire`); a source whose counts fall (a process restarted under the same row) is treated as
a new one."""

from __future__ import annotations

import threading

# The monotonic counters of one streamed model, in the order rows carry them.
COUNTERS = ("hits", "misses", "evictions", "bytes_read", "read_seconds", "guesses", "guess_hits",
            "prefetch_reads", "prefetch_hits", "syncs", "sync_seconds",
            "decode_tokens", "decode_seconds", "decode_bytes", "prompt_tokens_prefilled")
ENGINE_COUNTERS = COUNTERS[:11]  # from the handle's totals; the decode ones from its decode clock, then its prefill count
# What the serving process measures of itself (gauges).
MEMORY = ("rss_bytes", "mlx_active_bytes")


def handle_counters(handle) -> list[float]:
    """The COUNTERS of a StreamHandle, from its public stats."""
    stats = handle.stats()
    totals = stats["totals"]
    decode = stats.get("decode") or {}
    return [float(totals.get(name, 0)) for name in ENGINE_COUNTERS] + \
        [float(decode.get("tokens", 0)), float(decode.get("seconds", 0.0)), float(decode.get("bytes_read", 0)),
         float(stats.get("prompt_tokens_prefilled", 0))]


def process_memory() -> list[float]:
    """This process's MEMORY: resident set, and MLX's active memory (on Apple silicon the
    model's arrays live there, not all of them in the resident set)."""
    import mlx.core as mx
    import psutil

    return [float(psutil.Process().memory_info().rss), float(mx.get_active_memory())]


class CounterLedger:
    """Monotonic COUNTERS per served name over every source that served it. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._banked: dict[str, list[float]] = {}  # name -> totals of retired sources
        self._live: dict[str, dict] = {}  # name -> {source: its latest counters}

    def observe(self, name: str, source, values: list[float]) -> None:
        """The latest counters of `source` (any hashable id) serving `name`."""
        with self._lock:
            live = self._live.setdefault(name, {})
            last = live.get(source)
            if last is not None and any(v < seen for v, seen in zip(values, last)):
                self._bank(name, last)  # the source started counting again
            live[source] = list(values)

    def retire(self, name: str, source) -> None:
        """`source` serves `name` no more: its last counters join the banked totals."""
        with self._lock:
            last = self._live.get(name, {}).pop(source, None)
            if last is not None:
                self._bank(name, last)

    def sources(self, name: str) -> list:
        with self._lock:
            return list(self._live.get(name, {}))

    def totals(self, name: str) -> dict:
        """{counter: total} for `name`: banked plus every live source."""
        with self._lock:
            values = list(self._banked.get(name, [0.0] * len(COUNTERS)))
            for live in self._live.get(name, {}).values():
                values = [a + b for a, b in zip(values, live)]
        return {k: (v if k.endswith("seconds") else int(v)) for k, v in zip(COUNTERS, values)}

    def _bank(self, name: str, values: list[float]) -> None:
        banked = self._banked.setdefault(name, [0.0] * len(COUNTERS))
        self._banked[name] = [a + b for a, b in zip(banked, values)]
