"""The progress stream's own turn handling, in-process: a client that leaves while it is
being told its place in line frees that place at once, and a request granted at once gets
no progress at all (its answer is the model's, headers and all)."""

from __future__ import annotations

import asyncio
import json

import pytest

from scheduler.config import parse_config
from scheduler.dispatcher import Outcome
from tests.asgi import Call, Gate, in_process

pytestmark = pytest.mark.timeout(20)

CONFIG = {"sendLoadingState": True, "models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}}}


def chat(content: str, stream: bool) -> bytes:
    return json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": content}]}).encode()


async def test_a_client_leaving_its_progress_stream_leaves_the_queue():
    gate = Gate()
    async with in_process(parse_config(CONFIG), transport=gate) as world:
        running = Call(world.app, "/v1/chat/completions", chat("running", False))
        await gate.entered.wait()
        waiting = Call(world.app, "/v1/chat/completions", chat("waiting", True))
        async with asyncio.timeout(5):
            while b"llamaswap: waiting" not in waiting.body:
                await asyncio.sleep(0.01)
        assert waiting.status == 200 and b'"reasoning_content"' in waiting.body
        waiting.disconnect.set()
        await waiting.done()
        async with asyncio.timeout(1):
            while len(world.dispatcher.queue):
                await asyncio.sleep(0.01)
        assert world.recorder.finished[waiting.request_id] is Outcome.CANCELLED_WAITING
        gate.open.set()
        await running.done()
        assert running.status == 200 and gate.served == ["running"]


async def test_a_request_granted_at_once_gets_the_models_answer_as_is():
    gate = Gate(opened=True)
    async with in_process(parse_config(CONFIG), transport=gate) as world:
        first = Call(world.app, "/v1/chat/completions", chat("warm", True))
        await first.done()
        again = Call(world.app, "/v1/chat/completions", chat("again", True))
        await again.done()
        # The model is loaded and the GPU free: granted within the grace, no progress.
        assert again.status == 200 and b"reasoning_content" not in again.body
        assert again.headers[b"content-type"].startswith(b"application/json")
