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


def expand(value: str) -> str:
    """A path as a user writes it in a config: `~` and `$VAR` / `${VAR}` expanded."""
    return os.path.expanduser(os.path.expandvars(value))


def is_folder(value: str | Path) -> bool:
    """Path.is_dir that answers False for a name the OS refuses (too long, bad bytes)."""
    try:
        return Path(value).is_dir()
    except (OSError, ValueError):
        return False


def looks_like_hub_id(value: str) -> bool:
    """`org/name` as the Hugging Face hub spells a repository (not a relative folder that exists)."""
    parts = value.split("/")
    return (len(parts) == 2 and all(parts) and not value.startswith((".", "~", "$"))
            and not os.path.exists(value))  # os.path answers False where the OS refuses the name


def resolve_model_path(value: str) -> str:
    """A model folder: `~` and variables expanded; a hub id (`mlx-community/Qwen3-30B-A3B-4bit`)
    becomes its snapshot folder in the local Hugging Face cache ($HF_HUB_CACHE / $HF_HOME).
    Nothing is downloaded: a hub id that is not cached stays as written (the caller says so)."""
    path = expand(value)
    if not looks_like_hub_id(path):
        return path
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return path
    # Read the cache location now, not at huggingface_hub's import: the caller's environment rules.
    cache = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None)
    try:
        return snapshot_download(path, local_files_only=True, cache_dir=cache)
    except (LocalEntryNotFoundError, ValueError, OSError):
        return path


def checkpoint_bytes(value) -> int:
    """Bytes of the safetensors of a local checkpoint folder (a model loaded whole beside the
    streamed ones: a draft), or 0 for anything else: a hub id, an unreadable folder (the host
    says what is wrong with it)."""
    from expert_stream.streaming.checkpoint import CheckpointIndex
    from expert_stream.streaming.errors import ExpertStreamError

    if not isinstance(value, str) or not value or not is_folder(Path(value).expanduser()):
        return 0
    try:
        return CheckpointIndex(Path(value).expanduser()).total_bytes()
    except ExpertStreamError:
        return 0
