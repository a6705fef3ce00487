"""Where the project keeps its own files (synthetic checkpoints for the demo and generate)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$EXPERT_STREAM_CACHE, else $XDG_CACHE_HOME/expert-stream, else ~/.cache/expert-stream."""
    root = os.environ.get("EXPERT_STREAM_CACHE")
    if root:
        path = Path(root)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        path = Path(base) / "expert-stream"
    path.mkdir(parents=True, exist_ok=True)
    return path
