"""Refusing code shipped in a checkpoint folder.

mlx-lm builds the model class from the Python file that config.json's `model_file` names,
executing it, whenever it loads the folder (even lazily, even to read the sizes). That is code
from whoever published the checkpoint: it runs only when the caller says it trusts the folder."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ExpertStreamError


class RemoteCodeError(ExpertStreamError):
    """The checkpoint would run its own Python code and the caller did not allow it."""


def trusted(load_model, trust_remote_code: bool) -> dict:
    """Keyword arguments that let mlx-lm's `load_model` run a trusted `model_file`: mlx-lm 0.32
    has its own `trust_remote_code` gate, 0.31 has none."""
    import inspect

    if trust_remote_code is True and "trust_remote_code" in inspect.signature(load_model).parameters:
        return {"trust_remote_code": True}
    return {}


def refuse_model_file(model_dir: str | Path, trust_remote_code: bool = False) -> None:
    """Raise RemoteCodeError when config.json names a `model_file` and trust_remote_code is
    not True. A missing or unreadable config.json is left to the checkpoint index to report."""
    if trust_remote_code is True:
        return
    config_path = Path(model_dir).expanduser() / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return
    model_file = config.get("model_file") if isinstance(config, dict) else None
    if model_file is not None:
        raise RemoteCodeError(
            f"{config_path}: model_file {model_file!r} would run {Path(model_dir).expanduser() / str(model_file)} "
            "(Python code from the checkpoint folder); set trust_remote_code: true for this model if you "
            "trust its publisher, or use a checkpoint without model_file"
        )
