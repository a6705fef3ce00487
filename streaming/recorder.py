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
        self._pass: dict[int, list] = {}
        self._blocks: list[np.ndarray] = []
        self._unread: list[list] = []  # whole passes whose ids may still be on the device
        self._phase: list[np.ndarray] = []
        self._seq_start: list[int] = [0]
        self._tokens = 0

    @property
    def tokens(self) -> int:
        """Tokens recorded so far (whole forward passes)."""
        return self._tokens

    def add(self, layer: int, ids) -> None:
        """Layer `layer` (position among streamed layers) routed ids of shape (..., top_k): a numpy
        array, or an MLX array a layer left on the device. Those are read two passes later, when
        decode (one step evaluated ahead) has computed them, so that recording adds no sync."""
        self._pass.setdefault(layer, []).append(ids)
        if len(self._pass) == len(self.layer_names):
            rows = [self._pass[i].pop(0) for i in range(len(self.layer_names))]
            self._pass = {i: left for i, left in self._pass.items() if left}
            self._unread.append(rows)
            tokens = rows[0].size // rows[0].shape[-1]
            # A pass of one token is a decode step; more tokens are a prefill chunk.
            self._phase.append(np.full(tokens, 1 if tokens == 1 else 0, np.uint8))
            self._tokens += tokens
            self._read(keep=2)

    def _read(self, keep: int = 0) -> None:
        """Bring all but the latest `keep` passes' ids to the host."""
        while len(self._unread) > keep:
            rows = self._unread.pop(0)
            self._blocks.append(np.stack([np.asarray(r).reshape(-1, r.shape[-1]).astype(np.int16) for r in rows], axis=1))

    def new_sequence(self) -> None:
        """The next tokens start a new request (an unrelated document or conversation)."""
        if self._tokens and self._seq_start[-1] != self._tokens:
            self._seq_start.append(self._tokens)

    def trace(self, name: str = "recorded", meta: dict | None = None) -> RoutingTrace:
        self._read()
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
