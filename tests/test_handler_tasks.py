"""The handler runs the view in the request's own task, a second task only listening for
the client leaving (proxy/handler.py): what a client sees when it leaves, when the server
gives up, and that neither leaves a reference cycle for the cyclic GC."""

from __future__ import annotations

import asyncio
import gc
import json
import types

import httpx
import pytest

from scheduler.config import parse_config
from scheduler.dispatch_state import ANNOUNCE_AFTER
from scheduler.dispatcher import Outcome
from tests.asgi import Call, in_process

CONFIG = {"models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}}}
BODY = json.dumps({"model": "m", "messages": []}).encode()


class HeldModel(httpx.AsyncBaseTransport):
    """Answers once ``release`` is set; ``arrived`` is set when a request reaches it."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.arrived.set()
        await self.release.wait()
        answer = b'{"choices": [], "usage": {"total_tokens": 1}}'
        headers = {"content-type": "application/json"}
        return httpx.Response(200, headers=headers, stream=httpx.ByteStream(answer))


@pytest.fixture
async def world():
    model = HeldModel()
    async with in_process(parse_config(CONFIG), transport=model) as w:
        yield types.SimpleNamespace(app=w.app, recorder=w.recorder, model=model)


async def settled() -> None:
    for _ in range(ANNOUNCE_AFTER + 2):  # the observers' deferred on_finish
        await asyncio.sleep(0)


def handler_frames_in_garbage() -> list[types.FrameType]:
    """Collect with every unreachable object kept: the handler's frames among them."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return [
            o
            for o in gc.garbage
            if isinstance(o, types.FrameType) and o.f_code.co_filename.endswith("proxy/handler.py")
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def test_a_client_that_leaves_while_the_model_works_cancels_its_request(world):
    call = Call(world.app, "/v1/chat/completions", BODY)
    await world.model.arrived.wait()
    call.disconnect.set()
    await call.done()
    assert not call.task.cancelled() and call.task.exception() is None  # the handler ends quietly
    assert call.status is None  # nothing was sent
    await settled()
    assert list(world.recorder.finished.values()) == [Outcome.CANCELLED_RUNNING]
    # The next request is served at once: the turn was given back.
    world.model.release.set()
    nxt = Call(world.app, "/v1/chat/completions", BODY)
    await nxt.done()
    assert nxt.status == 200


async def test_the_server_giving_up_cancels_the_request_and_ends_its_turn(world):
    call = Call(world.app, "/v1/chat/completions", BODY)
    await world.model.arrived.wait()
    call.task.cancel()  # daphne's application timeout
    await call.done()
    assert call.task.cancelled()  # the cancellation reaches the server, as it asked
    await settled()
    assert list(world.recorder.finished.values()) == [Outcome.CANCELLED_RUNNING]


async def test_requests_that_end_or_are_left_leave_no_cycle_for_the_gc(world):
    gc.collect()
    gc.disable()
    try:
        left = Call(world.app, "/v1/chat/completions", BODY)
        await world.model.arrived.wait()
        left.disconnect.set()
        await left.done()
        world.model.release.set()
        served = Call(world.app, "/v1/chat/completions", BODY)
        await served.done()
        assert served.status == 200
        await settled()
        del left, served
        assert handler_frames_in_garbage() == []
    finally:
        gc.enable()
