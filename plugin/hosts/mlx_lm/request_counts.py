"""The requests mlx_lm.server is answering, per served name: `queued` from the moment a request
is handed to the generation thread until that thread starts it (it waits behind other requests
or for its model to load), then `in_flight` until its last token was taken.

Counted around `ResponseGenerator.generate`, which the HTTP handler calls once per completion
request: it returns when the generation thread took the request up, with an iterator of the
answer's pieces that the handler then drains."""

from __future__ import annotations

import functools
import threading
from typing import Callable, Optional


class RequestCounts:
    def __init__(self, served_name: Callable[[Optional[str]], Optional[str]]):
        self._served_name = served_name  # requested model -> served name, or None (not counted)
        self._lock = threading.Lock()
        self._counts: dict[str, dict] = {}

    def snapshot(self) -> dict:
        with self._lock:
            return {name: dict(c) for name, c in self._counts.items()}

    def counting(self, generate, requested_model):
        """`generate` counted; `requested_model(args, kwargs)` reads the requested name."""

        @functools.wraps(generate)
        def counted(*args, **kwargs):
            name = self._served_name(requested_model(args, kwargs))
            if name is None:
                return generate(*args, **kwargs)
            self._add(name, "queued", 1)
            try:
                ctx, pieces = generate(*args, **kwargs)
            finally:
                self._add(name, "queued", -1)
            self._add(name, "in_flight", 1)
            return ctx, _Answer(pieces, functools.partial(self._add, name, "in_flight", -1))

        return counted

    def _add(self, name: str, key: str, n: int) -> None:
        with self._lock:
            counts = self._counts.setdefault(name, {"in_flight": 0, "queued": 0})
            counts[key] += n


class _Answer:
    """The answer's iterator; `done()` runs once, when it ends, fails, or is dropped unfinished
    (a client that went away)."""

    def __init__(self, pieces, done):
        self._pieces = iter(pieces)
        self._done = done

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._pieces)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()

    def __del__(self):
        self.close()
