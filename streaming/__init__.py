"""The engine: exact expert streaming from safetensors for mlx-lm MoE models.

Knows nothing of servers. `load` builds a model whose routed experts are read from the
checkpoint's shards into a per-layer slot cache whose budget fits to memory or is set;
`loader.load_streamed` is the one load path under it (a host passes its own lazy build).
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
    # load imports mlx-lm; keep `import expert_stream.streaming` light for the CLI.
    if name == "load":
        from . import loader

        return getattr(loader, name)
    if name == "StreamHandle":
        from .handle import StreamHandle

        return StreamHandle
    raise AttributeError(name)


__all__ = [
    "load", "StreamHandle", "StreamSettings",
    "ExpertStreamError", "CheckpointError", "ReadError", "BudgetError", "SettingsError", "NotMoEError",
]
