"""WaitingHandler (issue 14 item 6): requests for a reloading model wait, bounded in time and in
number, and are served by the model routed next; a failed load answers them at once."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")
from fastapi import HTTPException  # noqa: E402

from expert_stream.plugin.hosts.openai.request_queue import WaitingHandler  # noqa: E402


class Model:
    """A handler with the host's calling conventions: a coroutine and an async generator."""

    def __init__(self, name):
        self.name = name

    async def generate_text_response(self, request):
        return f"{self.name}:{request}"

    async def generate_text_stream(self, request):
        for piece in (self.name, request):
            yield piece


def waiting(timeout=5.0, max_waiting=3):
    return WaitingHandler("m", "/models/m", "lm", Model, timeout=timeout, max_waiting=max_waiting)


def test_waiting_requests_are_served_by_the_next_model():
    async def scenario():
        holder = waiting()
        plain = asyncio.create_task(holder.generate_text_response("a"))
        streamed = asyncio.create_task(_collect(holder.generate_text_stream("b")))
        await asyncio.sleep(0.05)
        assert holder.waiting == 2 and not plain.done()
        holder.resolve(Model("new"))
        assert await plain == "new:a" and await streamed == ["new", "b"]
        assert await holder.generate_text_response("c") == "new:c"  # later ones go straight through
    asyncio.run(scenario())


def test_a_failed_load_answers_waiting_and_later_requests_at_once():
    async def scenario():
        holder = waiting()
        pending = asyncio.create_task(holder.generate_text_response("a"))
        await asyncio.sleep(0.05)
        holder.fail("failed to load after a config change: /secret/path/model.py broke at offset 99")
        for call in (pending, holder.generate_text_response("b")):
            with pytest.raises(HTTPException) as err:
                await call
            assert err.value.status_code == 503
            message = err.value.detail["error"]["message"]
            assert "failed to load" in message and "/secret" not in message and "99" not in message
    asyncio.run(scenario())


def test_the_wait_is_bounded_in_time_and_number():
    async def scenario():
        holder = waiting(timeout=0.2, max_waiting=2)
        first = [asyncio.create_task(holder.generate_text_response(i)) for i in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(HTTPException, match="503") as err:
            await holder.generate_text_response("third")
        assert "already wait" in err.value.detail["error"]["message"]
        for task in first:
            with pytest.raises(HTTPException) as err:
                await task
            assert "still loading after 0 s (queue_timeout)" in err.value.detail["error"]["message"]
        assert holder.waiting == 0
    asyncio.run(scenario())


def test_chained_holders_and_unknown_attributes():
    async def scenario():
        first, second = waiting(), waiting()
        pending = asyncio.create_task(first.generate_text_response("a"))
        await asyncio.sleep(0.05)
        first.resolve(second)  # a second reload began before the first model came back
        await asyncio.sleep(0.05)
        assert not pending.done()
        second.resolve(Model("final"))
        assert await pending == "final:a"
        assert getattr(first, "debug", False) is False  # the host probes optional attributes
    asyncio.run(scenario())


async def _collect(stream):
    return [chunk async for chunk in stream]
