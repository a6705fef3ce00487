"""Routing traces: which routed experts each token used, per MoE layer, in token order.

The on-disk format is the one of `shared/moe_traces/` (and of what `expert-stream trace` records):
an uncompressed or compressed numpy ``.npz`` with

- ``ids``        int16 (tokens, moe_layers, top_k): expert ids in token order (required);
- ``layer_ids``  int16 (moe_layers,): the model's real layer index of each column (optional on
                 load, defaults to 0..moe_layers-1);
- ``seq_start``  int64 (requests,): token index where each request starts (optional);
- ``phase``      uint8 (tokens,): 0 = prefill, 1 = decode (optional);
- ``step_start`` int64 (steps,): token index where each forward pass starts (optional; batched
                 engines put many tokens in one pass).

Anything else in the file (``num_experts`` as a 0-d array, for instance) is kept in ``extra``.
A ``<name>.json`` sidecar next to the file, when present, is read into ``meta``; it is where
``num_experts`` usually lives (the ids alone only give a lower bound).

Every validation error names the file and the key at fault.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ExpertStreamError


class TraceError(ExpertStreamError):
    """A routing trace file that is missing, unreadable or malformed."""


_KNOWN = ("ids", "layer_ids", "seq_start", "phase", "step_start")


@dataclass
class RoutingTrace:
    """Routed expert ids of a run: ``ids[token, layer, j]`` is the j-th expert of that token."""

    ids: np.ndarray                         # int16 (tokens, layers, top_k)
    layer_ids: np.ndarray | None = None     # int16 (layers,)
    seq_start: np.ndarray | None = None     # int64 (requests,), ascending, first is 0
    phase: np.ndarray | None = None         # uint8 (tokens,), 0 prefill / 1 decode
    step_start: np.ndarray | None = None    # int64 (steps,), ascending, first is 0
    num_experts: int | None = None          # experts per layer (None: max id + 1)
    name: str = "trace"
    meta: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.ids = np.asarray(self.ids)
        if self.layer_ids is None and self.ids.ndim == 3:
            self.layer_ids = np.arange(self.ids.shape[1], dtype=np.int16)
        if self.num_experts is None and self.ids.size:
            self.num_experts = int(self.ids.max()) + 1
        _validate(self, f"<RoutingTrace {self.name}>")

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    def decode_mask(self) -> np.ndarray:
        """Tokens whose hits count: decode tokens where the phase is known, else all tokens."""
        if self.phase is None:
            return np.ones(self.num_tokens, dtype=bool)
        return self.phase == 1

    def request_bounds(self) -> list[tuple[int, int]]:
        """(start, stop) token ranges of the requests (one range when requests are unknown)."""
        starts = [0] if self.seq_start is None else [int(s) for s in self.seq_start]
        stops = starts[1:] + [self.num_tokens]
        return list(zip(starts, stops))

    def select_requests(self, requests, name: str | None = None) -> "RoutingTrace":
        """A trace of only the given request indices (in the given order), carrying metadata."""
        bounds = self.request_bounds()
        parts, starts, pos = [], [], 0
        for r in requests:
            a, b = bounds[r]
            parts.append(np.arange(a, b))
            starts.append(pos)
            pos += b - a
        idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return RoutingTrace(
            ids=self.ids[idx], layer_ids=self.layer_ids,
            seq_start=np.asarray(starts, dtype=np.int64),
            phase=None if self.phase is None else self.phase[idx],
            step_start=None, num_experts=self.num_experts,
            name=name or f"{self.name}[{len(starts)} requests]", meta=dict(self.meta))

    def select_layers(self, layers, name: str | None = None) -> "RoutingTrace":
        """A trace of only the given layer columns."""
        layers = list(layers)
        return RoutingTrace(
            ids=self.ids[:, layers], layer_ids=self.layer_ids[layers],
            seq_start=self.seq_start, phase=self.phase, step_start=self.step_start,
            num_experts=self.num_experts, name=name or self.name, meta=dict(self.meta))


def _fail(where: str, key: str, msg: str):
    raise TraceError(f"{where}: key '{key}': {msg}")


def _validate(tr: RoutingTrace, where: str) -> None:
    ids = tr.ids
    if ids.ndim != 3:
        _fail(where, "ids", f"expected 3 dimensions (tokens, moe_layers, top_k), got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        _fail(where, "ids", f"expected integer expert ids, got dtype {ids.dtype}")
    T, L, K = ids.shape
    if L < 1 or K < 1:
        _fail(where, "ids", f"needs at least one layer and top_k >= 1, got shape {ids.shape}")
    if ids.size and int(ids.min()) < 0:
        _fail(where, "ids", f"negative expert id {int(ids.min())}")
    if tr.num_experts is not None:
        if int(tr.num_experts) < 1:
            _fail(where, "num_experts", f"must be >= 1, got {tr.num_experts}")
        if ids.size and int(ids.max()) >= int(tr.num_experts):
            _fail(where, "ids", f"expert id {int(ids.max())} >= num_experts {tr.num_experts}")
        if K > int(tr.num_experts):
            _fail(where, "ids", f"top_k {K} > num_experts {tr.num_experts}")
    if tr.layer_ids is not None:
        tr.layer_ids = np.asarray(tr.layer_ids)
        if tr.layer_ids.shape != (L,):
            _fail(where, "layer_ids", f"expected shape ({L},) (one per ids column), got {tr.layer_ids.shape}")
        if not np.issubdtype(tr.layer_ids.dtype, np.integer):
            _fail(where, "layer_ids", f"expected integers, got dtype {tr.layer_ids.dtype}")
    if tr.phase is not None:
        tr.phase = np.asarray(tr.phase)
        if tr.phase.shape != (T,):
            _fail(where, "phase", f"expected shape ({T},) (one per token), got {tr.phase.shape}")
        if tr.phase.size and not np.isin(tr.phase, (0, 1)).all():
            _fail(where, "phase", "values must be 0 (prefill) or 1 (decode)")
    for key in ("seq_start", "step_start"):
        arr = getattr(tr, key)
        if arr is None:
            continue
        arr = np.asarray(arr)
        setattr(tr, key, arr)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            _fail(where, key, f"expected a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size:
            if int(arr[0]) != 0:
                _fail(where, key, f"must start at token 0, starts at {int(arr[0])}")
            if (np.diff(arr) <= 0).any():
                _fail(where, key, "must be strictly increasing")
            if int(arr[-1]) >= max(T, 1):
                _fail(where, key, f"token index {int(arr[-1])} out of range for {T} tokens")


def load_trace(path: str | os.PathLike, num_experts: int | None = None) -> RoutingTrace:
    """Read a routing trace ``.npz`` (and its ``.json`` sidecar if present)."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise TraceError(f"{where}: no such trace file")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as exc:  # zip / format errors: say which file
        raise TraceError(f"{where}: not a readable .npz trace ({type(exc).__name__}: {exc})") from exc
    if "ids" not in arrays:
        _fail(where, "ids", f"missing (keys present: {sorted(arrays) or 'none'})")
    meta = {}
    sidecar = path.with_suffix(".json")
    if sidecar.is_file():
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, ValueError) as exc:
            raise TraceError(f"{sidecar}: unreadable JSON sidecar ({exc})") from exc
        if not isinstance(meta, dict):
            raise TraceError(f"{sidecar}: JSON sidecar must hold an object")
    extra = {k: v for k, v in arrays.items() if k not in _KNOWN}
    if num_experts is None:
        if "num_experts" in extra:
            num_experts = int(np.asarray(extra.pop("num_experts")).reshape(-1)[0])
        elif isinstance(meta.get("num_experts"), int):
            num_experts = meta["num_experts"]
    tr = RoutingTrace.__new__(RoutingTrace)
    tr.ids = np.asarray(arrays["ids"])
    tr.layer_ids = arrays.get("layer_ids")
    tr.seq_start = arrays.get("seq_start")
    tr.phase = arrays.get("phase")
    tr.step_start = arrays.get("step_start")
    tr.num_experts = num_experts
    tr.name = str(meta.get("name") or path.stem)
    tr.meta = meta
    tr.extra = extra
    _validate(tr, where)
    if tr.layer_ids is None:
        tr.layer_ids = np.arange(tr.ids.shape[1], dtype=np.int16)
    if tr.num_experts is None:
        tr.num_experts = int(tr.ids.max()) + 1 if tr.ids.size else 1
    return tr


def save_trace(path: str | os.PathLike, trace: RoutingTrace, sidecar: bool = True) -> Path:
    """Write ``trace`` in the shared format (int16 ids, int64 starts, uint8 phase).

    With ``sidecar`` a ``<name>.json`` is written beside it holding ``trace.meta`` plus the
    shape facts (num_experts, top_k, layers, tokens)."""
    path = Path(path)
    if path.suffix != ".npz":
        path = path.with_name(path.name + ".npz")
    _validate(trace, str(path))
    if trace.ids.size and int(trace.ids.max()) > np.iinfo(np.int16).max:
        _fail(str(path), "ids", "expert ids do not fit int16")
    out = {"ids": trace.ids.astype(np.int16), "layer_ids": np.asarray(trace.layer_ids, dtype=np.int16)}
    if trace.seq_start is not None:
        out["seq_start"] = np.asarray(trace.seq_start, dtype=np.int64)
    if trace.phase is not None:
        out["phase"] = np.asarray(trace.phase, dtype=np.uint8)
    if trace.step_start is not None:
        out["step_start"] = np.asarray(trace.step_start, dtype=np.int64)
    for k, v in trace.extra.items():
        if k not in out:
            out[k] = np.asarray(v)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, **out)
    os.replace(tmp, path)
    if sidecar:
        meta = dict(trace.meta)
        meta.update(name=trace.name, num_experts=int(trace.num_experts), top_k=trace.top_k,
                    num_layers=trace.num_layers, num_tokens=trace.num_tokens,
                    npz=path.name,
                    arrays={k: [list(v.shape), str(v.dtype)] for k, v in out.items()})
        path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return path
