"""The engine: exact expert streaming from safetensors for mlx-lm MoE models.

Knows nothing of servers. `load` builds a model whose routed experts are read from the
checkpoint's shards into a fixed-budget per-layer cache; `attach` does the swap on a model a
host already built lazily.
"""

from .errors import (
    BudgetError,
    CheckpointError,
    ExpertStreamError,
    NotMoEError,
    ReadError,
    SettingsError,
)
from .settings import StreamSettings


def __getattr__(name):
    # load/attach import mlx-lm; keep `import expert_stream.streaming` light for the CLI.
    if name in ("load", "attach"):
        from . import loader

        return getattr(loader, name)
    if name == "StreamHandle":
        from .handle import StreamHandle

        return StreamHandle
    raise AttributeError(name)


__all__ = [
    "load", "attach", "StreamHandle", "StreamSettings",
    "ExpertStreamError", "CheckpointError", "ReadError", "BudgetError", "SettingsError", "NotMoEError",
]
