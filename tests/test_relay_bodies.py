"""Bodies of any reasonable size: no 2.5 MB ceiling on proxy paths, a clear 413 above the
configured limit (``limits.maxBodyBytes``), a 408 for a body that stops arriving."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from scheduler.config import parse_config
from tests.asgi import Body, Call, in_process

pytestmark = pytest.mark.timeout(20)


class Echo(httpx.AsyncBaseTransport):
    """A model that answers with the size of what it received."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        self.sizes.append(len(body))
        return httpx.Response(
            200, headers={"content-type": "application/json"}, stream=Body(b'{"ok": true}')
        )


def config(**limits):
    raw = {"models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}}}
    if limits:
        raw["limits"] = limits
    return parse_config(raw)


def big_chat(size: int) -> bytes:
    image = "A" * size  # a base64 image, say
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": image}]}).encode()


async def test_a_body_far_over_djangos_default_is_relayed_whole():
    echo = Echo()
    async with in_process(config(), transport=echo) as world:
        body = big_chat(8 * 1024 * 1024)
        call = Call(world.app, "/v1/chat/completions", body)
        await call.done(timeout=10)
        assert call.status == 200, call.body[:200]
        assert echo.sizes == [len(body)]


async def test_a_multipart_upload_over_djangos_default_is_relayed_whole():
    echo = Echo()
    async with in_process(config(), transport=echo) as world:
        audio = b"\x00\x01" * (3 * 1024 * 1024)
        boundary = b"llamaswapboundary"
        body = (
            b"--" + boundary + b'\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
            b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\n" + audio + b"\r\n--" + boundary + b"--\r\n"
        )
        call = Call(
            world.app,
            "/v1/audio/transcriptions",
            body,
            content_type=b"multipart/form-data; boundary=" + boundary,
        )
        await call.done(timeout=10)
        assert call.status == 200, call.body[:300]
        assert echo.sizes == [len(body)]


@pytest.mark.parametrize("announced", [True, False])
async def test_a_body_over_the_limit_is_a_413_and_never_queued(announced):
    echo = Echo()
    async with in_process(config(maxBodyBytes=1000), transport=echo) as world:
        body = big_chat(2000)
        call = Call(world.app, "/v1/chat/completions", body, chunk=300, announce_length=announced)
        await call.done()
        assert call.status == 413
        error = json.loads(call.body)["error"]
        assert error["code"] == "request_too_large" and "maxBodyBytes" in error["message"]
        assert echo.sizes == [] and world.recorder.finished == {}


async def test_a_body_that_stops_arriving_is_a_408():
    async with in_process(config(bodyIdleTimeout=0.2), transport=Echo()) as world:
        call = Call(world.app, "/v1/chat/completions", big_chat(1000), chunk=100, stall_after=3)
        await call.done()
        assert call.status == 408
        assert json.loads(call.body)["error"]["code"] == "request_timeout"
        assert world.recorder.finished == {}
        await asyncio.sleep(0)
