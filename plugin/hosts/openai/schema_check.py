"""Checking the keys the plugin passes through to a host against the host's own dataclass.

mlx-openai-server reads each model entry into `ModelEntryConfig` and the `server:` section
into `MultiModelServerConfig`, but only when a model process starts, or never (a wrong type
surfaces as a crash in the child). The plugin validates before anything is unloaded, so it
checks those values here: the annotated type, finite numbers, then the dataclass itself."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Optional

MAX_INT = 1 << 64  # the host's largest default is 1 << 63 (prompt_cache_max_bytes)


def dataclass_check(cls, skip: frozenset = frozenset(),
                    bounds: Optional[dict] = None) -> Callable[[dict], Optional[str]]:
    """A check of a dict against `cls`'s fields: returns what is wrong (naming the key) or None.
    `skip`: keys the dataclass does not take (ours, or handled elsewhere); `bounds`: key ->
    (low, high) for numbers the host uses as timeouts or sizes."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # annotations the host cannot resolve: check nothing but the dataclass
        hints = {}
    fields = {f.name for f in dataclasses.fields(cls)}
    bounds = bounds or {}

    def check(values: dict) -> Optional[str]:
        for key, value in values.items():
            if key in skip or key not in hints:
                continue
            if not _fits(value, hints[key]):
                return f"{key}: {value!r} is not {_describe(hints[key])} ({cls.__name__} of the host)"
            low, high = bounds.get(key, (None, None))
            if low is not None and value is not None and not low <= value <= high:
                return f"{key}: must be between {low} and {high}, got {value!r}"
        try:
            cls(**{k: v for k, v in values.items() if k in fields and k not in skip})
        except Exception as exc:  # the host's own __post_init__ refuses it
            return f"the host refuses it: {exc}"
        return None

    check.hints = hints
    return check


def _fits(value: Any, tp) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_INT
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    return True  # a type this check does not know: the dataclass decides


def _describe(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("NoneType", "None")


def section_check(key: str, cls, skip: frozenset = frozenset(),
                  bounds: Optional[dict] = None) -> Callable[[dict], Optional[str]]:
    """The same check for one top-level section (`server:`), which must be a mapping if set."""
    inner = dataclass_check(cls, skip, bounds)
    fields = {f.name for f in dataclasses.fields(cls)}

    def check(top_level: dict) -> Optional[str]:
        section = top_level.get(key)
        if section is None:
            return None
        if not isinstance(section, dict):
            return f"{key}: must be a mapping, got {section!r}"
        values = {k: v for k, v in section.items() if k in fields and k not in skip}
        for name, value in values.items():  # the dataclass needs its required fields: check types only
            if name in inner.hints and not _fits(value, inner.hints[name]):
                return f"{key}.{name}: {value!r} is not {_describe(inner.hints[name])} ({cls.__name__} of the host)"
            low, high = (bounds or {}).get(name, (None, None))
            if low is not None and value is not None and not low <= value <= high:
                return f"{key}.{name}: must be between {low} and {high}, got {value!r}"
        return None

    return check
