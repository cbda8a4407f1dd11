"""The handler on daphne's own ``receive`` (an ``asyncio.Queue``'s ``get``, proxy/handler.py):
a body already queued is taken without a timer, a body still arriving is waited for within
the limits, and the client leaving is heard without a listener task, as on any other
``receive`` (tests/test_handler_tasks.py)."""

from __future__ import annotations

import asyncio
import json
import types

import httpx
import pytest

from scheduler.config import parse_config
from scheduler.dispatcher import Outcome
from tests.asgi import Body, http_scope, in_process
from tests.test_handler_tasks import BODY, HeldModel, handler_frames_in_garbage, settled

pytestmark = pytest.mark.timeout(20)


class QueueCall:
    """One request driven as daphne drives it: the body queued before the app starts,
    ``receive`` the queue's ``get``; ``leave()`` queues the client's disconnect."""

    def __init__(self, app, body: bytes, pieces: int = 1, sent: int | None = None) -> None:
        headers = [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json")]
        headers.append((b"content-length", str(len(body)).encode()))
        scope = http_scope("POST", "/v1/chat/completions", b"", headers)
        size = -(-len(body) // pieces)
        chunks = [body[i : i + size] for i in range(0, len(body), size)]
        self.queue: asyncio.Queue = asyncio.Queue()
        for i, chunk in enumerate(chunks[:sent]):
            more = i < len(chunks) - 1
            self.queue.put_nowait({"type": "http.request", "body": chunk, "more_body": more})
        self.status: int | None = None
        self.body = b""
        self.task = asyncio.create_task(app(scope, self.queue.get, self._send))

    async def _send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self.body += message.get("body", b"")

    def leave(self) -> None:
        self.queue.put_nowait({"type": "http.disconnect"})

    async def done(self) -> None:
        async with asyncio.timeout(5):
            await asyncio.wait({self.task})


@pytest.fixture
async def world():
    model = HeldModel()
    config = {"models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}}}
    async with in_process(parse_config(config), transport=model) as w:
        yield types.SimpleNamespace(app=w.app, recorder=w.recorder, model=model)


async def test_a_request_is_served_and_leaves_no_waiter_in_the_queue(world):
    world.model.release.set()
    call = QueueCall(world.app, BODY)
    await call.done()
    assert call.status == 200 and json.loads(call.body)["usage"] == {"total_tokens": 1}
    assert not call.queue._getters  # the listener's waiter was taken out again


async def test_a_body_in_pieces_is_read_whole(world):
    class Echo(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            size = str(len(await request.aread())).encode()
            return httpx.Response(200, stream=Body(size))

    config = {"models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}}}
    async with in_process(parse_config(config), transport=Echo()) as w:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 999}]})
        call = QueueCall(w.app, body.encode(), pieces=4)
        await call.done()
        assert call.status == 200 and call.body == str(len(body)).encode()


async def test_a_body_that_stops_arriving_is_a_408():
    config = {
        "models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}},
        "limits": {"bodyIdleTimeout": 0.2},
    }
    async with in_process(parse_config(config), transport=HeldModel()) as w:
        call = QueueCall(w.app, BODY, pieces=2, sent=1)  # the rest never comes
        await call.done()
        assert call.status == 408


async def test_a_client_that_leaves_while_the_model_works_cancels_its_request(world):
    call = QueueCall(world.app, BODY)
    await world.model.arrived.wait()
    call.leave()
    await call.done()
    assert not call.task.cancelled() and call.task.exception() is None
    assert call.status is None
    await settled()
    assert list(world.recorder.finished.values()) == [Outcome.CANCELLED_RUNNING]
    world.model.release.set()
    nxt = QueueCall(world.app, BODY)
    await nxt.done()
    assert nxt.status == 200


async def test_a_client_gone_before_the_view_ran_cancels_its_request(world):
    call = QueueCall(world.app, BODY)
    call.leave()  # queued behind the body: heard as soon as the handler listens
    await call.done()
    assert call.status is None
    await settled()
    assert all(
        outcome in (Outcome.CANCELLED_WAITING, Outcome.CANCELLED_RUNNING)
        for outcome in world.recorder.finished.values()
    )


async def test_requests_on_the_queue_leave_no_cycle_for_the_gc(world):
    import gc

    gc.collect()
    gc.disable()
    try:
        left = QueueCall(world.app, BODY)
        await world.model.arrived.wait()
        left.leave()
        await left.done()
        world.model.release.set()
        served = QueueCall(world.app, BODY)
        await served.done()
        assert served.status == 200
        await settled()
        del left, served
        assert handler_frames_in_garbage() == []
    finally:
        gc.enable()
