"""proxy/upstream.py's LeanTransport against scripted HTTP/1.1 servers on loopback.

The relay's tests drive it through the whole proxy (tests/test_relay_timeouts.py,
tests/test_e2e_proxy.py); these pin the HTTP details: framings, keep-alive and what ends
it, interim answers, large bodies in both directions, and the failures as httpx's
exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import httpx
import pytest

from proxy.upstream import LeanTransport, Upstreams

pytestmark = pytest.mark.timeout(20)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes, bytes], Awaitable[bool]]
"""Answers one request (its head and body); returns False to close the connection."""


class Scripted:
    """A loopback server that reads each request (head and Content-Length body) and lets
    ``handler`` answer it; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.heads: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> Scripted:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    def url(self, path: str = "/x") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if not await self.handler(reader, writer, head, body):
                    break
                await writer.drain()
        writer.close()


def send(
    transport: LeanTransport, method: str, url: str, content: bytes = b"", read: float | None = None
):
    timeout = {"connect": 5.0, "read": read, "write": 5.0, "pool": None}
    request = httpx.Request(method, url, content=content, extensions={"timeout": timeout})
    return transport.handle_async_request(request)


async def body_of(response: httpx.Response) -> bytes:
    data = b"".join([piece async for piece in response.aiter_raw()])
    await response.aclose()
    return data


async def test_content_length_answers_reuse_one_connection():
    async def answer(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        return True

    transport = LeanTransport()
    async with Scripted(answer) as server:
        for n in range(3):
            response = await send(transport, "POST", server.url(), b"hello %d" % n)
            assert response.status_code == 200
            assert await body_of(response) == b"hello %d" % n
        assert server.connections == 1
        assert server.heads[0].startswith(b"POST /x HTTP/1.1\r\n")
        assert b"Content-Length: 7" in server.heads[0]
    await transport.aclose()


async def test_chunked_answer_is_dechunked_with_trailers_and_pieces_split_anywhere():
    async def answer(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        wire = b"5;ext=1\r\nhello\r\n1\r\n \r\n6\r\nworld!\r\n0\r\nX-Trailer: 1\r\n\r\n"
        for i in range(0, len(wire), 3):  # the framing arrives cut at every third byte
            writer.write(wire[i : i + 3])
            await writer.drain()
            await asyncio.sleep(0.001)
        return True

    transport = LeanTransport()
    async with Scripted(answer) as server:
        response = await send(transport, "GET", server.url())
        assert await body_of(response) == b"hello world!"
        again = await send(transport, "GET", server.url())
        assert await body_of(again) == b"hello world!"
        assert server.connections == 1  # reused after a complete chunked body
    await transport.aclose()


async def test_an_interim_answer_is_skipped_and_head_has_no_body():
    async def answer(reader, writer, head, body):
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if head.startswith(b"HEAD"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\nX-A: 1\r\nX-A: 2\r\n\r\nok")
        return True

    transport = LeanTransport()
    async with Scripted(answer) as server:
        response = await send(transport, "POST", server.url(), b"{}")
        assert response.status_code == 201
        assert response.headers.get_list("x-a") == ["1", "2"]
        assert await body_of(response) == b"ok"
        response = await send(transport, "HEAD", server.url())
        assert await body_of(response) == b""
        assert server.connections == 1
    await transport.aclose()


async def test_connection_close_and_read_until_eof():
    async def answer(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        return False

    transport = LeanTransport()
    async with Scripted(answer) as server:
        for _ in range(2):
            response = await send(transport, "GET", server.url())
            assert await body_of(response) == b"until the end"
        assert server.connections == 2  # never reused
    await transport.aclose()


async def test_a_connection_the_server_closed_while_idle_is_not_reused():
    async def answer(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        return False  # closes right after a keep-alive answer

    transport = LeanTransport()
    async with Scripted(answer) as server:
        for _ in range(3):
            response = await send(transport, "GET", server.url())
            assert await body_of(response) == b"ok"
        assert server.connections == 3
    await transport.aclose()


async def test_failures_are_httpx_exceptions():
    async def broken(reader, writer, head, body):
        if b"/short" in head:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        elif b"/silent" in head:
            await asyncio.sleep(5)
        elif b"/garbage" in head:
            writer.write(b"NOT HTTP\r\n\r\n")
        return False

    transport = LeanTransport()
    async with Scripted(broken) as server:
        response = await send(transport, "GET", server.url("/short"))
        with pytest.raises(httpx.RemoteProtocolError):
            await body_of(response)
        with pytest.raises(httpx.RemoteProtocolError):
            await send(transport, "GET", server.url("/none"))  # closed without an answer
        with pytest.raises(httpx.ReadTimeout):
            await send(transport, "GET", server.url("/silent"), read=0.2)
        with pytest.raises(httpx.RemoteProtocolError):
            await send(transport, "GET", server.url("/garbage"))
        port = server.port
    with pytest.raises(httpx.ConnectError):
        await send(transport, "GET", f"http://127.0.0.1:{port}/gone")
    await transport.aclose()


async def test_the_read_timeout_is_read_before_every_wait():
    async def slow_stream(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(b"1\r\nb\r\n0\r\n\r\n")
        return True

    transport = LeanTransport()
    async with Scripted(slow_stream) as server:
        response = await send(transport, "GET", server.url())
        response.request.extensions["timeout"]["read"] = 0.1  # as the relay sets its idle limit
        with pytest.raises(httpx.ReadTimeout):
            await body_of(response)
        response = await send(transport, "GET", server.url())
        response.request.extensions["timeout"]["read"] = 2.0
        assert await body_of(response) == b"ab"
    await transport.aclose()


async def test_large_bodies_both_ways():
    size = 5 * 1024 * 1024 + 7
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)

    async def echo(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
        writer.write(body)
        return True

    transport = LeanTransport()
    async with Scripted(echo) as server:
        response = await send(transport, "POST", server.url(), payload)
        assert await body_of(response) == payload
    await transport.aclose()


async def test_upstreams_builds_what_the_client_would_and_probes_through_it():
    async def answer(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    upstreams = Upstreams()
    async with Scripted(answer) as server:
        url = httpx.URL(server.url())
        mine = upstreams.request("POST", url, [(b"accept", b"text/plain")], b"{}", {"connect": 1.0})
        theirs = upstreams.client().build_request(
            "POST", url, headers=[(b"accept", b"text/plain")], content=b"{}"
        )
        assert sorted(mine.headers.multi_items()) == sorted(theirs.headers.multi_items())
        response = await upstreams.send(mine)
        assert response.request is mine
        assert await body_of(response) == b"ok"
        probe = await upstreams.client().get(server.url("/health"))
        assert probe.status_code == 200 and probe.content == b"ok"
    await upstreams.aclose()


@pytest.mark.parametrize(
    ("method", "headers", "body"),
    [
        ("POST", [(b"Content-Type", b"application/json"), (b"accept", b"text/plain")], b"{}"),
        ("POST", [], b""),
        ("put", [(b"X-Priority", b"batch")], b""),
        ("GET", [(b"Accept-Encoding", b"br")], b""),
        ("DELETE", [], b"x"),
        ("POST", [(b"Host", b"model.example")], b"{}"),
    ],
)
async def test_the_request_is_the_clients_header_for_header(method, headers, body):
    """What the model receives is exactly what httpx's ``build_request`` would send: the
    same headers in the same order (Host, the defaults, the caller's, the length)."""
    upstreams = Upstreams()
    url = httpx.URL("http://127.0.0.1:9/v1/chat/completions?x=1")
    mine = upstreams.request(method, url, headers, body, {"connect": 1.0})
    theirs = upstreams.client().build_request(method, url, headers=headers, content=body)
    assert mine.method == theirs.method
    assert mine.headers.raw == theirs.headers.raw
    assert mine.content == theirs.content == body
    assert mine.extensions == {"timeout": {"connect": 1.0}}
    await upstreams.aclose()
