"""Hot reload in pipeline mode: every rank applies the same file at the same step, or none does.

A reload asked on any rank (its watcher, SIGHUP, rank 0's reload endpoint) is only noted; at the
next point every rank passes together (between two requests, see pipeline_mode) the ranks learn
that one of them asked, each validates its own copy of the file, and one all_gather of a
fixed-size row (valid?, the file's hash, the error) decides: the same valid file everywhere is
applied by every rank, anything else is refused by every rank, with the reason. A changed model
then reloads at the next request, which every rank handles together."""

from __future__ import annotations

import threading

import numpy as np

ERROR_BYTES = 1024
HASH_BYTES = 64
WAIT_S = 60.0  # a reload asked during a generation applies after it; the asker hears back by then or is told


class RankReload:
    def __init__(self, group, state):
        self.group = group
        self.state = state  # reloader.LmServerState of this rank
        self._lock = threading.Lock()
        self._reasons: list[str] = []
        self._waiters: list[tuple[threading.Event, dict]] = []

    def request(self, reason: str) -> dict:
        """Ask for a reload; returns its result once the ranks decided (or a pending note)."""
        done, box = threading.Event(), {}
        with self._lock:
            self._reasons.append(reason)
            self._waiters.append((done, box))
        if done.wait(WAIT_S):
            return box["result"]
        return {"ok": True, "pending": True, "applied": [],
                "note": f"the ranks did not pass a point between two requests within {WAIT_S:.0f} s (a generation "
                        "is running): the reload is decided after it; `status` shows the outcome"}

    @property
    def wanted(self) -> bool:
        with self._lock:
            return bool(self._reasons)

    def step(self) -> None:
        """Every rank, together, once any rank asked: validate, agree, apply or refuse."""
        import mlx.core as mx

        from expert_stream.plugin.config import ConfigError
        from expert_stream.plugin.reload import refuse_reload

        with self._lock:
            reasons, waiters = self._reasons, self._waiters
            self._reasons, self._waiters = [], []
        reason = reasons[0] if reasons else "another rank asked"
        state = self.state
        new, error = None, ""
        try:
            new = state.host.load_config(state.config.path, state.internals, check_models=False)
        except Exception as exc:  # refused on every rank below
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ConfigError) else str(exc)
        row = np.zeros(1 + HASH_BYTES + ERROR_BYTES, dtype=np.uint8)
        row[0] = new is not None
        if new is not None:
            row[1:1 + HASH_BYTES] = np.frombuffer(new.text_hash.encode()[:HASH_BYTES].ljust(HASH_BYTES), np.uint8)
        text = error.encode()[:ERROR_BYTES]
        row[1 + HASH_BYTES:1 + HASH_BYTES + len(text)] = np.frombuffer(text, np.uint8)
        rows = np.array(mx.distributed.all_gather(mx.array(row), group=self.group, stream=mx.cpu))
        rows = rows.reshape(self.group.size(), -1)
        why = _disagreement(rows)
        if why is None:
            result = state.reload(reason, new=new)
        else:
            result = refuse_reload(state.record, state.config.path, reason,
                                   ConfigError(f"{state.config.path}: reload refused on every rank: {why}"))
        for done, box in waiters:
            box["result"] = result
            done.set()


def _disagreement(rows: np.ndarray) -> str | None:
    """None when every rank validated the same file; else why not."""
    for rank, row in enumerate(rows):
        if not row[0]:
            message = bytes(row[1 + HASH_BYTES:]).rstrip(b"\0").decode(errors="replace")
            return f"rank {rank}'s copy of the file is invalid: {message}"
    hashes = [bytes(row[1:1 + HASH_BYTES]).decode(errors="replace").strip() for row in rows]
    for rank, h in enumerate(hashes):
        if h != hashes[0]:
            return (f"rank {rank}'s copy of the file differs from rank 0's (hash {h[:12]} against "
                    f"{hashes[0][:12]}); every machine needs the same file")
    return None
