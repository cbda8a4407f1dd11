"""Cancelling a request forwarded to a peer (``POST /api/inflight/{id}/cancel``) works as
a local cancel does: through the real ASGI app in-process, the peer a real fakellm on
loopback that records what it received and when its client went away."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from proxy import peers
from scheduler.config import parse_config
from scheduler.dispatcher import Outcome
from tests.asgi import Call, in_process
from tests.server import chat
from web import cancel

pytestmark = pytest.mark.timeout(60)


def config(peer_url: str):
    return parse_config(
        {
            "models": {"local": {"cmd": "fake", "proxy": "http://127.0.0.1:1"}},
            "peers": {"remote": {"proxy": peer_url, "models": ["qwen-remote"]}},
        }
    )


def received(url: str) -> list[dict]:
    return httpx.get(url + "/fake/requests", timeout=5).json()


async def until(condition, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def cancel_call(world, request_id: str) -> Call:
    call = Call(world.app, f"/api/inflight/{request_id}/cancel", b"", method="POST")
    await call.done(5)
    return call


async def test_a_peer_request_waiting_for_its_answer_is_cancelled_with_499(fakellm):
    peer = await fakellm()
    async with in_process(config(peer.url)) as world:
        body = json.dumps(chat("remote/qwen-remote", fake_delay=5)).encode()
        call = Call(world.app, "/v1/chat/completions", body)
        await until(lambda: received(peer.url), "the peer got the request")
        (request_id,) = cancel.live_ids()

        answer = await cancel_call(world, request_id)
        assert answer.status == 200
        assert json.loads(answer.body) == {"msg": "ok", "was": "running"}

        await call.done(5)
        assert call.status == 499
        error = json.loads(call.body)["error"]
        assert error["code"] == "request_cancelled" and "cancelled by api" in error["message"]
        assert call.request_id == request_id
        await until(lambda: world.recorder.tickets, "the request's end was told")
        ticket = world.recorder.tickets[request_id]
        assert ticket.outcome is Outcome.CANCELLED_RUNNING
        assert ticket.extra["peer"] == "remote" and ticket.extra["cancelled_by"] == "api"
        assert peers.load("remote/qwen-remote") == 0 and cancel.live_ids() == []
        await until(lambda: received(peer.url)[-1]["disconnected"], "the peer saw it go")
        # A second cancel finds nothing in flight.
        assert (await cancel_call(world, request_id)).status == 404


async def test_a_peer_stream_being_answered_stops_with_an_error_event(fakellm):
    peer = await fakellm()
    async with in_process(config(peer.url)) as world:
        body = json.dumps(
            chat("remote/qwen-remote", stream=True, max_tokens=400, fake_tokens_per_second=20)
        ).encode()
        call = Call(world.app, "/v1/chat/completions", body)
        await until(lambda: call.body.count(b"data: ") >= 3, "tokens arrived")
        (request_id,) = cancel.live_ids()

        answer = await cancel_call(world, request_id)
        assert json.loads(answer.body) == {"msg": "ok", "was": "running"}

        await call.done(5)
        assert call.status == 200
        events = [line[6:] for line in call.body.decode().splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "request_cancelled"
        await until(lambda: world.recorder.tickets, "the request's end was told")
        assert world.recorder.tickets[request_id].outcome is Outcome.CANCELLED_RUNNING
        assert peers.load("remote/qwen-remote") == 0
        await until(lambda: received(peer.url)[-1]["disconnected"], "the peer saw it go")
