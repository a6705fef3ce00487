"""Recording routing while a streamed model runs: the ids every streamed layer was routed to,
per token, in the format of streaming/traces.py (`expert-stream trace` writes it; warm start and
per-layer budgets read it)."""

from __future__ import annotations

import re

import numpy as np

from .traces import RoutingTrace


def layer_index(module_path: str) -> int:
    """The model's layer number in a module path (`model.layers.12.mlp.switch_mlp` -> 12)."""
    match = re.search(r"\.(\d+)\.", module_path)
    return int(match.group(1)) if match else -1


class TraceRecorder:
    """Collects one (tokens, layers, top_k) block per forward pass of the model."""

    def __init__(self, layer_names: list[str], num_experts: int):
        self.layer_names = layer_names
        self.num_experts = num_experts
        # per layer, the passes it recorded that some other layer has not reached yet (FIFO: a
        # layer-major prefill records every chunk of a layer before the next layer's)
        self._pass: dict[int, list[np.ndarray]] = {}
        self._blocks: list[np.ndarray] = []
        self._phase: list[np.ndarray] = []
        self._seq_start: list[int] = [0]
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens recorded so far (whole forward passes)."""
        return self._tokens

    def add(self, layer: int, ids: np.ndarray) -> None:
        """Layer `layer` (position among streamed layers) routed ids of shape (..., top_k)."""
        self._pass.setdefault(layer, []).append(ids.reshape(-1, ids.shape[-1]).astype(np.int16))
        if len(self._pass) == len(self.layer_names):
            block = np.stack([self._pass[i].pop(0) for i in range(len(self.layer_names))], axis=1)
            self._pass = {i: rows for i, rows in self._pass.items() if rows}
            self._blocks.append(block)
            # A pass of one token is a decode step; more tokens are a prefill chunk.
            self._phase.append(np.full(block.shape[0], 1 if block.shape[0] == 1 else 0, np.uint8))
            self._tokens += block.shape[0]

    def new_sequence(self) -> None:
        """The next tokens start a new request (an unrelated document or conversation)."""
        if self._tokens and self._seq_start[-1] != self._tokens:
            self._seq_start.append(self._tokens)

    def trace(self, name: str = "recorded", meta: dict | None = None) -> RoutingTrace:
        if not self._blocks:
            raise ValueError("nothing was recorded: run the model while recording")
        return RoutingTrace(
            ids=np.concatenate(self._blocks),
            layer_ids=np.array([layer_index(n) for n in self.layer_names], dtype=np.int16),
            # A new_sequence() after the last request marks no tokens: drop it.
            seq_start=np.array([s for s in self._seq_start if s < self._tokens], dtype=np.int64),
            phase=np.concatenate(self._phase),
            num_experts=self.num_experts,
            name=name,
            meta=dict(meta or {}),
        )
