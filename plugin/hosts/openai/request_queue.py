"""Requests for a model that is not there right now: they wait for it, or fail at once.

`WaitingHandler` stands in mlx-openai-server's model registry while an entry (re)loads: each
request waits, up to the entry's queue_timeout and with at most queue_size waiting, and is then
served by the new model. If the load fails (or the server stops), the waiting requests get that
error at once, and so does every later one until something else is routed. It answers the
handler methods the host calls (`generate_text_stream`, `generate_text_response`, ...) by
their names on the real handler class, so it needs no list of them."""

from __future__ import annotations

import asyncio
import inspect
import time


def _unavailable(model_id: str, message: str, code: str = "model_unavailable"):
    from fastapi import HTTPException

    from expert_stream.plugin.redact import redact

    return HTTPException(status_code=503, detail={"error": {
        "message": redact(f"model {model_id!r}: {message}"), "type": code, "code": 503}})


class WaitingHandler:
    def __init__(self, model_id: str, model_path: str, handler_type: str, interface: type,
                 timeout: float, max_waiting: int):
        self.model_id = model_id
        self.model_path = model_path
        self.handler_type = handler_type
        self.model_created = int(time.time())
        self._interface = interface  # the class whose methods the host calls
        self._timeout = timeout
        self._max_waiting = max_waiting
        self.waiting = 0
        self._outcome: asyncio.Future = asyncio.get_running_loop().create_future()

    # -- the owner (the reloader or the supervisor) decides the outcome ---------------------
    def resolve(self, handler) -> None:
        """Send the waiting requests (and any still arriving through this object) to `handler`."""
        if not self._outcome.done():
            self._outcome.set_result(handler)

    def fail(self, message: str) -> None:
        """Answer the waiting requests, and later ones, with a 503 carrying `message`."""
        if not self._outcome.done():
            self._outcome.set_result(message)

    # -- what the host calls ----------------------------------------------------------------
    async def _target(self):
        if not self._outcome.done():
            if self.waiting >= self._max_waiting:
                raise _unavailable(self.model_id, f"is reloading and {self.waiting} requests already wait "
                                                  "for it (queue_size); retry shortly", "model_reloading")
            self.waiting += 1
            try:
                await asyncio.wait_for(asyncio.shield(self._outcome), self._timeout)
            except asyncio.TimeoutError:
                raise _unavailable(self.model_id, f"still loading after {self._timeout:.0f} s "
                                                  "(queue_timeout); retry later", "model_reloading") from None
            finally:
                self.waiting -= 1
        outcome = self._outcome.result()
        if isinstance(outcome, str):
            raise _unavailable(self.model_id, outcome)
        return outcome

    def __getattr__(self, name: str):
        method = getattr(self._interface, name, None) if not name.startswith("_") else None
        if inspect.isasyncgenfunction(method):
            async def stream(*args, **kwargs):
                target = await self._target()
                async for chunk in getattr(target, name)(*args, **kwargs):
                    yield chunk
            return stream
        if inspect.iscoroutinefunction(method):
            async def call(*args, **kwargs):
                return await getattr(await self._target(), name)(*args, **kwargs)
            return call
        raise AttributeError(name)

    async def get_models(self):
        return []

    async def get_queue_stats(self):
        return {"waiting": self.waiting}

    async def cleanup(self):  # the server stops: nobody is going to load it
        self.fail("the server is shutting down")
