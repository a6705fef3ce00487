"""The handle `expert_stream.load` returns: counters and lifetime of one streamed model."""

from __future__ import annotations

from contextlib import contextmanager

from .cache import LayerStats
from .recorder import TraceRecorder


class StreamHandle:
    def __init__(self, index, settings, layers, plans, reader, model, warm_start_bytes=0):
        self.index = index
        self.settings = settings
        self.layers = layers  # StreamedSwitch per streamed layer, in model order
        self.streams = [layer.store for layer in layers]  # their ExpertStores
        self.plans = plans  # LayerPlan per MoE layer (streamed or resident)
        self.reader = reader
        self.model = model
        self.warm_start_bytes = warm_start_bytes  # read at load to preload the trace's experts

    @property
    def model_path(self):
        return self.index.model_dir

    @property
    def budget_bytes(self) -> int:
        """Bytes of slot memory actually allocated (at most the budget)."""
        return sum(p.slot_bytes for p in self.plans if not p.resident)

    def stats(self) -> dict:
        """Totals and per-layer counters (hits, misses, evictions, bytes, read seconds)."""
        layers = {s.name: s.cache.stats.as_dict() | {"slots": s.cache.num_slots} for s in self.streams}
        totals = LayerStats()
        for s in self.streams:
            for key, value in s.cache.stats.as_dict().items():
                setattr(totals, key, getattr(totals, key) + value)
        total = totals.as_dict()
        uses = total["hits"] + total["misses"]
        total["hit_rate"] = total["hits"] / uses if uses else 0.0
        return {
            "model_path": str(self.model_path),
            "streamed_layers": len(self.streams),
            "resident_layers": sum(p.resident for p in self.plans),
            "slot_bytes": self.budget_bytes,
            "reader": self.reader.backend,
            "cache_bypass": self.reader.cache_bypass,
            "warm_start_bytes": self.warm_start_bytes,
            "totals": total,
            "layers": layers,
        }

    @contextmanager
    def recording(self):
        """Record the routing of every streamed layer while the block runs:
        `with handle.recording() as rec: ...; rec.trace()`."""
        recorder = TraceRecorder([s.name for s in self.streams], self.streams[0].cache.num_experts)
        for position, s in enumerate(self.streams):
            s.recorder, s.position = recorder, position
        try:
            yield recorder
        finally:
            for s in self.streams:
                s.recorder = None

    def reset_stats(self) -> None:
        for s in self.streams:
            s.cache.stats = LayerStats()
        for layer in self.layers:
            if layer.lookahead is not None:
                layer.lookahead.restart_windows()

    @contextmanager
    def compute_only(self):
        """Benchmark: while the block runs, every expert lookup is a hit (expert e computes from
        slot e % slots, no reads), to time the compute of a model too big for memory."""
        for layer in self.layers:
            layer.time_compute_only(True)
        try:
            yield
        finally:
            for layer in self.layers:
                layer.time_compute_only(False)

    def close(self) -> None:
        self.reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
