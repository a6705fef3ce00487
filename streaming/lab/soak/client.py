"""One request to the host and its verdict: exact (the stock answer), a clear error (it names the
model, says why, and carries no absolute path), an unclear error, a wrong answer, or a hang (no
answer within the deadline)."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from dataclasses import dataclass

EXACT, CLEAR, UNCLEAR, WRONG, HANG = "exact", "clear error", "unclear error", "wrong", "hang"
SERVER_DOWN = "no server (killed by the soak)"
# An absolute path in text meant for an HTTP client (the host's folders, the checkpoints, Python's).
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])/(?:tmp|home|work|usr|var|opt|root|private|Users|srv|mnt|etc)/")


@dataclass
class Verdict:
    kind: str
    seconds: float
    detail: str = ""


def error_text(body: bytes) -> str:
    """The message of an error answer, whatever shape the host gives it."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()
    found = []

    def walk(node):
        if isinstance(node, str):
            found.append(node)
        elif isinstance(node, dict):
            for key in ("message", "error", "detail"):
                if key in node:
                    walk(node[key])
        elif isinstance(node, list):
            for item in node:
                walk(item)
    walk(doc)
    return " ".join(found) if found else json.dumps(doc)


def judge_error(message: str, model: str) -> str:
    """CLEAR when the message names the model, says something beyond it, and has no absolute path."""
    if not message or ABSOLUTE_PATH.search(message):
        return UNCLEAR
    return CLEAR if model in message and len(message) > len(model) + 8 else UNCLEAR


def request(port: int, model: str, prompt: str, max_tokens: int, stream: bool, expected: str | None,
            deadline_s: float, disconnect_after_first: bool = False) -> Verdict:
    """Send one chat completion and judge it. expected None: any clear error is right (a model
    that is not served), an answer is not."""
    t0 = time.perf_counter()
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=deadline_s)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            message = error_text(response.read())
            return Verdict(judge_error(message, model), time.perf_counter() - t0, f"{response.status}: {message}")
        if not stream:
            doc = json.loads(response.read())
            text = doc["choices"][0]["message"]["content"] or ""
            return _compare(text, expected, t0, "plain")
        return _read_stream(response, model, expected, t0, deadline_s, disconnect_after_first)
    except (socket.timeout, TimeoutError):
        return Verdict(HANG, time.perf_counter() - t0, f"no answer within {deadline_s:.0f} s")
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError) as exc:
        return Verdict(UNCLEAR, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def _compare(text: str, expected: str | None, t0: float, how: str) -> Verdict:
    if expected is not None and text == expected:
        return Verdict(EXACT, time.perf_counter() - t0)
    return Verdict(WRONG, time.perf_counter() - t0, f"{how} answer {text!r}, stock {expected!r}")


def _read_stream(response, model, expected, t0, deadline_s, disconnect_after_first) -> Verdict:
    text, errors = "", []
    for raw in response:
        if time.perf_counter() - t0 > deadline_s:
            return Verdict(HANG, time.perf_counter() - t0, f"stream not done within {deadline_s:.0f} s")
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            if errors:
                break
            return _compare(text, expected, t0, "streamed")
        chunk = json.loads(data)
        if "error" in chunk or ("message" in chunk and "choices" not in chunk):
            errors.append(error_text(data.encode()))
            continue
        for choice in chunk.get("choices", []):
            text += (choice.get("delta") or {}).get("content") or ""
        if disconnect_after_first and text:
            return Verdict(EXACT if expected is not None and expected.startswith(text) else WRONG,
                           time.perf_counter() - t0, "disconnected after the first piece")
    seconds = time.perf_counter() - t0
    if expected is not None and not expected.startswith(text):
        return Verdict(WRONG, seconds, f"the stream's text {text!r} before its end is no prefix of {expected!r}")
    if errors:
        message = " ".join(errors)
        return Verdict(judge_error(message, model), seconds, f"in the stream: {message}")
    return Verdict(UNCLEAR, seconds, f"the stream ended without [DONE] or an error after {text!r}")
