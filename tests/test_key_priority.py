"""Priority follows the key: a key capped at normal cannot overtake an interactive request,
and its record keeps the key's name (never the key) and what it asked for."""

from __future__ import annotations

import asyncio
import json

import pytest

from scheduler.config import parse_config
from scheduler.keys import ApiKey, KeyPolicy, KeyRing
from tests.asgi import Call, Gate, in_process

pytestmark = pytest.mark.timeout(20)


def chat(tag: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": tag}]}).encode()


def call(world, tag: str, key: str, priority: str) -> Call:
    headers = [(b"authorization", b"Bearer " + key.encode()), (b"x-llamaswap-priority", priority.encode())]
    return Call(world.app, "/v1/chat/completions", chat(tag), headers=headers)


async def test_a_key_capped_at_normal_cannot_overtake_an_interactive_request():
    config = parse_config({"models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}}})
    keys = KeyRing(
        {
            "sk-capped": ApiKey("capped", KeyPolicy(ceiling=0)),
            "sk-person": ApiKey("person"),
        }
    )
    gate = Gate()
    async with in_process(config, transport=gate, keys=keys) as world:
        first = call(world, "first", "sk-person", "normal")
        await gate.entered.wait()
        capped = call(world, "capped", "sk-capped", "interactive")  # asks for 100, gets 0
        while len(world.dispatcher.queue) < 1:
            await asyncio.sleep(0)
        person = call(world, "person", "sk-person", "interactive")
        while len(world.dispatcher.queue) < 2:
            await asyncio.sleep(0)
        gate.open.set()
        for c in (first, capped, person):
            await c.done()
            assert c.status == 200, c.body
        assert gate.served == ["first", "person", "capped"]
        record = world.recorder.tickets[capped.request_id]
        assert (record.priority, record.requested_priority, record.api_key) == (0, 100, "capped")
        assert world.recorder.tickets[person.request_id].api_key == "person"
