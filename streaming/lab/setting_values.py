"""Streaming settings written as KEY=VALUE on a lab command line (`expert-stream bench --set`,
the GPU tool's `--set` and `--variant`): each value read as a bool, None, an int, a float, or
else the string as given."""

from __future__ import annotations

from ..errors import SettingsError


def parse_value(raw: str):
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def parse_settings(pairs: list[str]) -> dict:
    """KEY=VALUE strings -> typed settings."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SettingsError(f"--set {pair!r}: expected KEY=VALUE")
        key, raw = pair.split("=", 1)
        out[key.strip()] = parse_value(raw)
    return out
