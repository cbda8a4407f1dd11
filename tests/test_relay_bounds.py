"""Bounds on the queue, as a client sees them: 429 or 503 with ``Retry-After`` and an
OpenAI-shaped error, and a record with its own outcome."""

from __future__ import annotations

import asyncio
import json

import pytest

from scheduler.config import parse_config
from scheduler.dispatcher import Outcome
from tests.asgi import Call, Gate, in_process

pytestmark = pytest.mark.timeout(20)


def config(**serial):
    return parse_config(
        {
            "models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}},
            "routing": {"scheduler": {"use": "serial", "settings": {"serial": serial}}},
        }
    )


def chat(priority: str = "normal") -> tuple[bytes, list[tuple[bytes, bytes]]]:
    return (
        json.dumps({"model": "m", "messages": []}).encode(),
        [(b"x-llamaswap-priority", priority.encode())],
    )


async def test_a_full_queue_answers_429_with_retry_after():
    gate = Gate()
    async with in_process(config(maxQueueDepth=1), transport=gate) as world:
        body, headers = chat()
        running = Call(world.app, "/v1/chat/completions", body, headers=headers)
        await gate.entered.wait()
        waiting = Call(world.app, "/v1/chat/completions", body, headers=headers)
        while not len(world.dispatcher.queue):
            await asyncio.sleep(0)
        vip_body, vip_headers = chat("interactive")
        refused = Call(world.app, "/v1/chat/completions", vip_body, headers=vip_headers)
        await refused.done()
        assert refused.status == 429
        assert int(refused.headers[b"retry-after"]) >= 1
        assert json.loads(refused.body)["error"]["code"] == "queue_full"
        assert world.recorder.finished[refused.request_id] is Outcome.QUEUE_FULL
        gate.open.set()
        await running.done()
        await waiting.done()
        assert running.status == waiting.status == 200


async def test_a_request_past_its_bands_max_wait_answers_503_with_retry_after():
    gate = Gate()
    async with in_process(config(maxWait={"batch": 0.1}), transport=gate) as world:
        body, headers = chat()
        running = Call(world.app, "/v1/chat/completions", body, headers=headers)
        await gate.entered.wait()
        batch_body, batch_headers = chat("batch")
        batch = Call(world.app, "/v1/chat/completions", batch_body, headers=batch_headers)
        await batch.done()
        assert batch.status == 503
        assert int(batch.headers[b"retry-after"]) >= 1
        error = json.loads(batch.body)["error"]
        assert error["code"] == "queue_wait_exceeded" and "maxWait" in error["message"]
        assert world.recorder.finished[batch.request_id] is Outcome.EXPIRED
        gate.open.set()
        await running.done()
        assert running.status == 200
