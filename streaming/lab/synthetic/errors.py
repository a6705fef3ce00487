"""The error synthetic-checkpoint arguments raise: a SettingsError (the CLI prints it without a
traceback) that is also a ValueError, the natural thing for a Python caller to catch."""

from ...errors import SettingsError


class SyntheticError(SettingsError, ValueError):
    """Bad arguments for a synthetic checkpoint, or an output folder that cannot be used."""
