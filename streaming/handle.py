"""The handle `expert_stream.load` returns: counters and lifetime of one streamed model."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

from .cache import LayerStats
from .errors import BudgetError
from .decode_clock import DecodeClock
from .prompt_pass import PromptPrefill
from .recorder import TraceRecorder
from .settings import GIB


@dataclass
class ModelBudget:
    """One model's budget as it stands: the number set, or what auto picked and why. The handle
    writes it (set_budget); the ledger and status read it."""

    auto: bool
    target_bytes: int  # slots of every MoE layer together may hold this much
    expert_bytes: int  # every routed expert of the model
    smallest: int  # one token's experts in every MoE layer
    context_length: int  # tokens of KV cache set aside beside it
    explained: Optional[dict] = None  # auto: the limit and each term (AutoBudget.as_dict)

    def as_dict(self) -> dict:
        out = {"budget_gib": round(self.target_bytes / GIB, 4), "budget_bytes": self.target_bytes, "auto": self.auto,
               "expert_gib": round(self.expert_bytes / GIB, 4), "smallest_gib": round(self.smallest / GIB, 4),
               "context_length": self.context_length}
        if self.explained:
            out["why"] = {k: v for k, v in self.explained.items() if k not in out}
        return out


class StreamHandle:
    def __init__(self, index, settings, layers, plans, reader, model, warm_start_bytes=0, budget=None):
        self.index = index
        self.settings = settings
        self.layers = layers  # StreamedSwitch per streamed layer, in model order
        self.streams = [layer.store for layer in layers]  # their ExpertStores
        self.plans = plans  # LayerPlan per MoE layer (streamed or resident)
        self.reader = reader
        self.model = model
        self.warm_start_bytes = warm_start_bytes  # read at load to preload the trace's experts
        self.budget = budget  # ModelBudget
        self._lock = threading.Lock()
        self._closed = False
        self.decode_path = ("python", "")  # (the decode path serving, why not native where asked); set at load
        self.decode = DecodeClock(self._bytes_read)
        if layers:
            layers[0].clock = self.decode
        self.prefill = PromptPrefill(layers, index.model_type, settings.prefill_window,
                                     self._bytes_read, index.model_dir.name,
                                     int(settings.prefill_readahead_gib * GIB))

    @property
    def model_path(self):
        return self.index.model_dir

    @property
    def budget_bytes(self) -> int:
        """Bytes of slot memory allocated now (at most the budget)."""
        return self.resident_bytes + sum(s.slots.nbytes for s in self.streams)

    @property
    def resident_bytes(self) -> int:
        """Experts of the layers left as stock blocks: held for the model's life."""
        return sum(p.slot_bytes for p in self.plans if p.resident)

    @property
    def online_budget(self):
        return self.layers[0].online_budget if self.layers else None

    def set_budget(self, nbytes: int, explained: Optional[dict] = None) -> None:
        """A new budget (another model loaded or unloaded beside this one): each streamed layer
        follows at its next call, shrinking ones first, so the slots never exceed it once they
        have run (`apply_budget` moves them all at once). Raises BudgetError when the model
        cannot run with that little."""
        nbytes = min(int(nbytes), max(self.budget.expert_bytes, self.resident_bytes))
        room = nbytes - self.resident_bytes
        if nbytes < self.budget.smallest or (self.online_budget is None and room < 0):
            raise BudgetError(f"{self.model_path}: a budget of {nbytes / GIB:.4f} GiB is below what it needs "
                              f"({max(self.budget.smallest, self.resident_bytes) / GIB:.4f} GiB)")
        with self._lock:
            if self.online_budget is not None:
                self.online_budget.set_capacity(room)
            self.budget.target_bytes = nbytes
            if explained is not None:
                self.budget.explained = explained

    def apply_budget(self) -> None:
        """Move every layer's slots to the budget now: only while no forward pass of this
        model runs (a host calls it between two requests, on its compute thread)."""
        if self.online_budget is not None:
            self.online_budget.apply_all()

    def _layer_stats(self, layer) -> dict:
        """A layer's counters, with the native decode path's not yet folded into them."""
        stats = layer.store.cache.stats.as_dict()
        if layer.native is not None and layer.native.active:
            for key, value in layer.native.unfolded().items():
                stats[key] += value
        return stats

    def _bytes_read(self) -> int:
        """The model's expert bytes read so far (the decode clock asks once a token)."""
        return sum(layer.store.cache.stats.bytes_read + (layer.native.unfolded_bytes() if layer.native else 0)
                   for layer in self.layers)

    def stats(self) -> dict:
        """Totals and per-layer counters (hits, misses, evictions, bytes, read seconds)."""
        per_layer = [self._layer_stats(layer) for layer in self.layers]
        layers = {s.name: st | {"slots": s.cache.num_slots} for s, st in zip(self.streams, per_layer)}
        totals = LayerStats()
        for st in per_layer:
            for key, value in st.items():
                setattr(totals, key, getattr(totals, key) + value)
        total = totals.as_dict()
        uses = total["hits"] + total["misses"]
        total["hit_rate"] = total["hits"] / uses if uses else 0.0
        return {
            "model_path": str(self.model_path),
            "budget": self.budget.as_dict(),
            "streamed_layers": len(self.streams),
            "resident_layers": sum(p.resident for p in self.plans),
            "slot_bytes": self.budget_bytes,
            "decode_path": self.decode_path[0],
            "decode_path_note": self.decode_path[1],  # why the Python path serves where native was asked
            "reader": self.reader.backend,
            "cache_bypass": self.reader.cache_bypass,
            "warm_start_bytes": self.warm_start_bytes,
            "totals": total,
            "decode": self.decode.as_dict(),
            "prompt_tokens_prefilled": self.decode.prompt_tokens,  # since load; a prompt cache's hits never count
            "prefill": self.prefill.progress(),  # a layer-major prefill running now, or None
            "layers": layers,
        }

    @contextmanager
    def recording(self):
        """Record the routing of every streamed layer while the block runs:
        `with handle.recording() as rec: ...; rec.trace()`."""
        num_experts = self.streams[0].cache.num_experts if self.streams else 0
        recorder = TraceRecorder([s.name for s in self.streams], num_experts)
        for position, s in enumerate(self.streams):
            s.recorder, s.position = recorder, position
        try:
            yield recorder
        finally:
            for s in self.streams:
                s.recorder = None

    def reset_stats(self) -> None:
        for layer in self.layers:
            layer.store.cache.stats = LayerStats()
            if layer.native is not None:
                layer.native.reset()
        self.decode.reset()
        for layer in self.layers:
            for lookahead in layer.lookaheads:
                lookahead.restart_windows()

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
        """Release the reader; the other models loaded in this process may grow into what this
        one held (their auto budgets)."""
        from .auto_budget import LEDGER

        if self._closed:
            return
        self._closed = True
        for layer in self.layers:
            if layer.native is not None:
                layer.native.close()
        self.reader.close()
        LEDGER.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
