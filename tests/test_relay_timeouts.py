"""A model that stops answering ends its turn: timeouts over real loopback sockets.

The app runs in-process (tests/asgi.py); the model's HTTP server is a small scripted asyncio
server on loopback, so httpx and httpcore read real sockets: the idle limit between a
stream's chunks lives in httpcore (see proxy/relay.py) and only a real socket shows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from scheduler.config import parse_config
from scheduler.dispatch_state import ANNOUNCE_AFTER
from scheduler.dispatcher import Outcome
from tests.asgi import Call, in_process

pytestmark = pytest.mark.timeout(20)


class ScriptedModel:
    """``mode``: ``ok`` (answer after ``delay``), ``hang`` (never answer), ``stall`` (send
    the headers and one event of a stream, then nothing). ``/health`` answers ``health``."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.delay = 0.0
        self.health = 200
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> ScriptedModel:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *headers = head.decode().split("\r\n")
                length = 0
                for header in headers:
                    if header.lower().startswith("content-length:"):
                        length = int(header.split(":")[1])
                await reader.readexactly(length)
                if " /health " in line:
                    body = b"{}"
                    writer.write(
                        f"HTTP/1.1 {self.health} X\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                    continue
                if self.mode == "hang":
                    await asyncio.Event().wait()
                if self.mode == "stall":
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n"
                    )
                    event = b'data: {"n": 1}\n\n'
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    await writer.drain()
                    await asyncio.Event().wait()
                await asyncio.sleep(self.delay)
                body = b'{"choices": []}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()


def config(port: int, **timeouts: float):
    return parse_config(
        {
            "models": {
                "m": {"cmd": "fake", "proxy": f"http://127.0.0.1:{port}", "timeouts": timeouts}
            }
        }
    )


def chat(stream: bool = False) -> bytes:
    return json.dumps({"model": "m", "stream": stream, "messages": []}).encode()


async def test_a_silent_model_that_fails_its_health_check_is_a_504_and_is_stopped():
    async with ScriptedModel() as model, in_process(config(model.port, idle=0.2)) as world:
        model.mode, model.health = "hang", 503
        call = Call(world.app, "/v1/chat/completions", chat())
        await call.done(timeout=5)
        assert call.status == 504
        assert json.loads(call.body)["error"]["code"] == "upstream_timeout"
        assert list(world.recorder.finished.values()) == [Outcome.FAILED]
        async with asyncio.timeout(2):
            while ("stopped", "m") not in world.factory.journal:
                await asyncio.sleep(0.01)
        # The next request gets the model started afresh.
        model.mode, model.health = "ok", 200
        nxt = Call(world.app, "/v1/chat/completions", chat())
        await nxt.done()
        assert nxt.status == 200
        assert world.factory.journal.count(("start", "m")) == 2


async def test_a_slow_but_healthy_model_is_waited_for():
    # A long prompt or a long render sends nothing for a long time and is still working.
    async with ScriptedModel() as model, in_process(config(model.port, idle=0.1)) as world:
        model.delay = 0.6  # six idle periods, each answered by a passing health check
        call = Call(world.app, "/v1/chat/completions", chat())
        await call.done(timeout=5)
        assert call.status == 200
        for _ in range(ANNOUNCE_AFTER):  # the observers' deferred on_finish (the recorder)
            await asyncio.sleep(0)
        assert list(world.recorder.finished.values()) == [Outcome.COMPLETED]


async def test_a_stream_that_stalls_is_cut_and_the_model_checked():
    async with ScriptedModel() as model, in_process(config(model.port, idle=0.3)) as world:
        model.mode, model.health = "stall", 503
        call = Call(world.app, "/v1/chat/completions", chat(stream=True))
        await call.done(timeout=5)
        assert call.status == 200
        assert b'data: {"n": 1}' in call.body and b"[DONE]" not in call.body
        ticket_outcomes = list(world.recorder.finished.values())
        assert ticket_outcomes == [Outcome.FAILED]
        async with asyncio.timeout(2):
            while ("stopped", "m") not in world.factory.journal:
                await asyncio.sleep(0.01)


async def test_response_header_timeout_is_a_504():
    async with (
        ScriptedModel() as model,
        in_process(config(model.port, responseHeader=0.2, idle=0)) as world,
    ):
        model.delay = 2
        call = Call(world.app, "/v1/chat/completions", chat())
        await call.done(timeout=5)
        assert call.status == 504
        assert "responseHeader" in json.loads(call.body)["error"]["message"]
        # A healthy model is not stopped for being slow once.
        assert ("stop", "m") not in world.factory.journal
