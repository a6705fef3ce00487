"""Errors the engine raises. Each message names the file, tensor, layer or setting involved and
says what to do, so callers (CLI, host plugins) can show it as it is."""


class ExpertStreamError(Exception):
    """Base class: an error whose message is complete for the user (no traceback needed)."""


class CheckpointError(ExpertStreamError):
    """A checkpoint that cannot be streamed: missing/truncated shard, bad header, layout."""


class ReadError(ExpertStreamError):
    """An I/O error or short read while reading expert bytes from a shard."""


class ShardChangedError(ReadError):
    """A shard differs from what was indexed at load: the model must be reloaded."""


class BudgetError(ExpertStreamError):
    """The expert budget cannot hold what one step needs."""


class SettingsError(ExpertStreamError):
    """A streaming setting with a wrong type or value."""


class NotMoEError(ExpertStreamError):
    """The checkpoint has no routed-expert layers to stream."""
