"""What an HTTP client may see of an error: no absolute paths (they say where the user's files
live) and no byte offsets; the log keeps the full message. A path becomes its last component,
which is what the user needs to find the file."""

from __future__ import annotations

import re
from typing import Any

# An absolute path: starts a token (not inside a URL or a fraction), at least one separator.
_PATH = re.compile(r"(?<![\w.:/~-])(?:~|/)[^\s'\"(),;<>|]*")
_ROUTES = ("/v1/", "/expert-stream/", "/health")  # endpoint paths in messages are not files
_OFFSET = re.compile(r"\b((?:data_)?offsets?|at byte|position|pos)\s*[=:]?\s*\(?\d[\d_]*"
                     r"(?:\s*(?:\.\.|-|,|to)\s*\d[\d_]*)*\)?", re.IGNORECASE)
_HEX = re.compile(r"\b0x[0-9a-fA-F]{4,}\b")


def redact(text: str) -> str:
    """`text` with absolute paths cut to their last component and offsets removed."""
    def path(match: re.Match) -> str:
        token = match.group(0)
        if token.startswith(_ROUTES) or token in ("/", "~"):
            return token
        trailing = token[len(token.rstrip(".:")):]  # keep a sentence's full stop or colon
        name = token.rstrip(".:").rstrip("/").rsplit("/", 1)[-1]
        return (name or "<path>") + trailing

    text = _PATH.sub(path, text)
    text = _OFFSET.sub(lambda m: f"{m.group(1)} <n>", text)
    return _HEX.sub("<n>", text)


def redact_errors(value: Any, keys=("error", "last_error", "warnings", "message", "detail")) -> Any:
    """A copy of a JSON-like value whose strings under `keys` (at any depth) are redacted."""
    if isinstance(value, dict):
        return {k: _redact_all(v) if k in keys else redact_errors(v, keys) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_errors(v, keys) for v in value]
    return value


def _redact_all(value: Any) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _redact_all(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_all(v) for v in value]
    return value


def redacting(raise_remote_error):
    """Wraps mlx-openai-server's `HandlerProcessProxy._raise_remote_error(response)`, which turns
    a model process's error into the HTTPException its client gets: the same, redacted."""
    def raise_redacted(response):
        return raise_remote_error(redact_errors(dict(response), keys=("message", "detail")))

    return raise_redacted


def redacting_calls(call):
    """Wraps a host function whose exceptions reach HTTP clients as text (mlx_lm.server's
    `ResponseGenerator.generate`: a failed load or a read error of the first step becomes
    `{"error": str(e)}`): the same exception type, its message redacted; the log keeps it whole."""
    import functools
    import logging

    @functools.wraps(call)
    def redacted_call(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            text = str(exc)
            if redact(text) == text:
                raise
            logging.getLogger("expert_stream").error("expert-stream: request failed: %s", text)
            try:
                clean = type(exc)(redact(text))
            except Exception:  # an exception type that takes other arguments
                clean = RuntimeError(redact(text))
            raise clean from None

    return redacted_call
