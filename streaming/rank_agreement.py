"""Pipeline ranks agree on a load before any of them serves: a rank that failed (a missing shard,
a budget too small for its layers) must not leave the others waiting forever in their first
send or receive. Every rank passes the same point with its outcome, through one all_gather of a
fixed-size buffer (mlx.distributed, the pipeline's own group); then all go on, or all raise."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .errors import ExpertStreamError

MESSAGE_BYTES = 2048  # of each rank's error text that travels; the failing rank logs all of it


class RankFailed(ExpertStreamError):
    """Another rank of the pipeline could not load its layers (its error is in the message)."""


def agree(group, error: BaseException | None) -> None:
    """The load barrier of a pipeline group. Returns when every rank loaded; otherwise re-raises
    this rank's own error, or raises RankFailed naming the first rank that failed and its error."""
    text = b"" if error is None else f"{error}".encode()[:MESSAGE_BYTES]
    mine = np.zeros(MESSAGE_BYTES + 4, dtype=np.uint8)
    mine[:4] = np.frombuffer(np.array([len(text) + (error is not None)], dtype=np.int32).tobytes(), np.uint8)
    mine[4:4 + len(text)] = np.frombuffer(text, dtype=np.uint8)
    gathered = mx.distributed.all_gather(mx.array(mine), group=group, stream=mx.cpu)
    rows = np.array(gathered).reshape(group.size(), -1)
    if error is not None:
        raise error
    for rank, row in enumerate(rows):
        flag = int(row[:4].view(np.int32)[0])
        if flag:
            message = bytes(row[4:4 + flag - 1]).decode(errors="replace")
            raise RankFailed(f"rank {rank} of the pipeline could not load its layers: {message}")
