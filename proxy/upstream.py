"""HTTP to the model processes: one connection pool of plain asyncio protocols.

httpx's own client stack (``AsyncClient.send`` -> httpcore's pool -> anyio -> h11) took
0.4-0.7 ms from a granted turn to the request's first byte on the socket, and as much again
to read a short answer, on this project's machines; per streamed chunk, a cancel scope, a
checkpoint (an extra loop turn) and h11's event parsing (BENCHMARKS.md, "Dispatch gap at
the model"). A model server on loopback needs
none of it, so :class:`LeanTransport` speaks HTTP/1.1 itself: one ``asyncio.Protocol``
per connection, keep-alive connections kept per host, the request written with one
``write`` (large bodies in slices, with flow control, never a second copy), the answer
parsed from the bytes as they arrive (Content-Length, chunked, or until the connection
closes), chunked bodies de-chunked and every complete piece already received handed over
at once. It is an ``httpx.AsyncBaseTransport``: requests and responses stay
``httpx.Request``/``httpx.Response`` objects, failures httpx's exceptions
(``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``, ``WriteTimeout``, ``ReadError``,
``RemoteProtocolError``), and the timeouts those of ``request.extensions["timeout"]``,
read anew before every wait (the relay lengthens ``read`` once the headers are in). Plain
``http://`` only; anything else goes through httpx's own transport.

:meth:`Upstreams.send` hands a built request straight to the transport: no redirects, no
auth flow, no cookie jar (a proxy must not keep its upstream's cookies). Tests inject
their own transport (``Upstreams(transport=...)``).
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from proxy.headers import HOP_BY_HOP as HOP_BY_HOP
from proxy.headers import forward_headers as forward_headers
from proxy.headers import response_headers as response_headers

TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
MAX_IDLE_PER_HOST = 64
KEEPALIVE_EXPIRY = 30.0
MAX_HEAD_BYTES = 100 * 1024
"""The response line and headers at most (httpcore's limit)."""
READ_HIGH_WATER = 1 << 20
"""Stop reading from the model while this much is received but not yet relayed."""
WRITE_SLICE = 1 << 20
"""Large request bodies are written in slices of this size, each after the last drained:
the socket buffer never holds a second copy of the body."""
SMALL_BODY = 64 * 1024
"""Bodies up to this size go out in the same write as the headers."""
_BLANKS = (0x20, 0x09)  # space, tab: as indexing bytes gives them (10x cheaper than slices)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
"""Methods httpx gives ``Content-Length: 0`` when they have no body."""


class Upstreams:
    """The connection pool to the model processes, and an httpx client for anything else
    (health probes): both over one transport, created on first use inside the running loop.
    ``size`` is kept for callers; one pool serves every request."""

    def __init__(self, size: int = 1, transport: httpx.AsyncBaseTransport | None = None):
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._defaults: list[tuple[bytes, tuple[bytes, bytes]]] | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            if self._transport is None:
                self._transport = LeanTransport()
            self._client = httpx.AsyncClient(
                timeout=TIMEOUT, transport=self._transport, trust_env=False
            )
        return self._client

    def request(
        self,
        method: str,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        content: bytes,
        timeout: dict[str, float | None],
    ) -> httpx.Request:
        """The request :meth:`client`'s ``build_request`` would build, header for header
        (``Host`` first, then ``Content-Length: 0`` for an empty POST, PUT or PATCH, the
        client's default headers where the caller sent none of that name, the caller's,
        ``Content-Length`` of a body last; ``timeout`` as the extension httpx's transports
        read), for a sixth of its cost: the body is given as a stream, so httpx neither
        inspects its type nor rebuilds the headers (tests/test_upstream_transport.py
        compares the two)."""
        defaults = self._defaults
        if defaults is None:
            defaults = self._defaults = [(k.lower(), (k, v)) for k, v in self.client().headers.raw]
        given = {k.lower() for k, _ in headers}
        merged = [(b"Host", url.netloc)] if b"host" not in given and url.host else []
        framed = b"content-length" in given or b"transfer-encoding" in given
        if not content and not framed and method.upper() in _BODY_METHODS:
            merged.append((b"Content-Length", b"0"))
        merged += [kv for low, kv in defaults if low not in given]
        merged += headers
        if content and not framed:
            merged.append((b"Content-Length", str(len(content)).encode("ascii")))
        request = httpx.Request(
            method,
            url,
            headers=merged,
            stream=httpx.ByteStream(content),
            extensions={"timeout": timeout},
        )
        request.read()  # ``request.content``: the body itself, no copy
        return request

    async def send(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` (built with :meth:`client`'s ``build_request``); returns once the
        response headers are in, the body unread (``aiter_raw``, then ``aclose``)."""
        transport = self._transport
        if transport is None:
            self.client()
            transport = self._transport
        assert transport is not None
        response = await transport.handle_async_request(request)
        response.request = request
        return response

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()  # closes the transport too
        elif self._transport is not None:
            await self._transport.aclose()
        self._client = None


async def read_whole(response: httpx.Response) -> bytes:
    """The whole body of ``response``, then closed (its connection back to the pool): what
    joining ``aiter_raw()``'s pieces gives, without httpx's generator layers around a body
    of :class:`LeanTransport`'s (8 µs a short answer)."""
    stream = response.stream
    if type(stream) is not _Body or response.is_stream_consumed or response.is_closed:
        return b"".join([chunk async for chunk in response.aiter_raw()])
    response.is_stream_consumed = True
    content = await stream.read_all()
    response.is_closed = True
    await stream.aclose()
    return content


# -- the transport ---------------------------------------------------------------------------


class LeanTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over asyncio protocols with keep-alive (see the module's docstring)."""

    def __init__(
        self, max_idle_per_host: int = MAX_IDLE_PER_HOST, keepalive_expiry: float = KEEPALIVE_EXPIRY
    ) -> None:
        self.max_idle_per_host = max_idle_per_host
        self.keepalive_expiry = keepalive_expiry
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._fallback: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport(trust_env=False)
            return await self._fallback.handle_async_request(request)
        timeouts = request.extensions.get("timeout") or {}
        key = (url.host, url.port or 80)
        conn = self._reuse(key)
        if conn is None:
            conn = await _connect(key, timeouts.get("connect"), request)
        try:
            await conn.write_request(request, timeouts)
            status, headers, extensions, framing = await conn.read_response(request)
        except BaseException:
            conn.close()
            raise
        return httpx.Response(
            status,
            headers=headers,
            stream=_Body(self, key, conn, request, framing),
            extensions=extensions,
            request=request,
        )

    def _reuse(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now - self.keepalive_expiry):
                return conn
            conn.close()
        return None

    def _release(self, key: tuple[str, int], conn: _Connection) -> None:
        if not conn.keep_alive or conn.closed:
            conn.close()
            return
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()
            self._fallback = None


async def _connect(
    key: tuple[str, int], timeout: float | None, request: httpx.Request
) -> _Connection:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            _, conn = await loop.create_connection(_Connection, key[0], key[1])
    except TimeoutError:
        raise httpx.ConnectTimeout(
            f"connecting to {key[0]}:{key[1]} timed out", request=request
        ) from None
    except OSError as exc:
        raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from None
    return conn


class _Connection(asyncio.Protocol):
    """One connection to a model server; what it received waits in ``buf``."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.eof = False
        self.closed = False
        self.error: BaseException | None = None
        self.keep_alive = True
        self.idle_since = 0.0
        self.waiter: asyncio.Future[None] | None = None
        self.drained: asyncio.Future[None] | None = None
        self.write_paused = False
        self.read_paused = False
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > READ_HIGH_WATER and not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self.keep_alive = False
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.eof = True
        self.keep_alive = False
        self.error = exc
        self._wake()
        drained = self.drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drained = self.drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the pool's side

    def usable(self, expired_before: float) -> bool:
        """Still open, not idle too long, and nothing (not even a close) arrived while idle:
        the kernel is asked, since the close may not have been read yet."""
        if self.closed or self.eof or self.buf or self.idle_since < expired_before:
            return False
        transport = self.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None:
            return False
        try:
            readable, _, _ = select.select((sock.fileno(),), (), (), 0)
        except (OSError, ValueError):
            return False
        return not readable  # readable while idle: closed, or bytes nobody asked for

    def close(self) -> None:
        self.keep_alive = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    # -- one exchange

    async def write_request(self, request: httpx.Request, timeouts: dict[str, Any]) -> None:
        transport = self.transport
        assert transport is not None
        url = request.url
        parts = [request.method.encode("ascii"), b" ", url.raw_path, b" HTTP/1.1\r\n"]
        raw = request.headers.raw
        for name, value in raw:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"\r\n")
        head = b"".join(parts)
        # A line break in a name or a value adds one to these counts: two scans of the
        # head instead of four tests per header (1 µs a header).
        lines = len(raw) + 2
        if head.count(b"\n") != lines or head.count(b"\r") != lines:
            for name, value in raw:
                if b"\n" in value or b"\r" in value or b"\n" in name or b"\r" in name:
                    raise httpx.LocalProtocolError(f"invalid header {name!r}", request=request)
            raise httpx.LocalProtocolError("invalid request line", request=request)
        stream = request.stream
        if isinstance(stream, httpx.ByteStream):
            body = request.content
            if len(body) <= SMALL_BODY:
                transport.write(head + body)
            else:
                transport.write(head)
                view = memoryview(body)
                for start in range(0, len(view), WRITE_SLICE):
                    await self._drain(timeouts, request)
                    transport.write(view[start : start + WRITE_SLICE])
                del view
        else:  # an async iterable body: as it comes, chunked when the headers say so
            transport.write(head)
            chunked = b"chunked" in request.headers.get("transfer-encoding", "").encode()
            async for piece in stream:  # type: ignore[union-attr]
                if not piece:
                    continue
                await self._drain(timeouts, request)
                if chunked:
                    transport.write(b"%x\r\n" % len(piece) + bytes(piece) + b"\r\n")
                else:
                    transport.write(piece)
            if chunked:
                transport.write(b"0\r\n\r\n")
        await self._drain(timeouts, request)

    async def _drain(self, timeouts: dict[str, Any], request: httpx.Request) -> None:
        if self.closed:
            raise httpx.WriteError("the model closed the connection", request=request)
        if not self.write_paused:
            return
        self.drained = self.loop.create_future()
        try:
            async with asyncio.timeout(timeouts.get("write")):
                await self.drained
        except TimeoutError:
            raise httpx.WriteTimeout("writing the request timed out", request=request) from None
        finally:
            self.drained = None
        if self.closed:
            raise httpx.WriteError("the model closed the connection", request=request)

    async def wait(self, request: httpx.Request) -> None:
        """Until more bytes arrive or the connection ends; ``ReadTimeout`` after the read
        timeout the request has now. One timer per connection, moved lazily: a wait costs
        a future and a clock read, not a timer."""
        if self.eof:
            return
        if self.read_paused and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
        waiter = self.waiter = self.loop.create_future()
        timeout = (request.extensions.get("timeout") or {}).get("read")
        if timeout is not None:
            self.deadline = self.loop.time() + timeout
            if self.timer is None:
                self.timer = self.loop.call_at(self.deadline, self._check_deadline)
        await waiter
        if waiter.result() is not None:
            raise httpx.ReadTimeout("timed out reading from the model", request=request)

    def _check_deadline(self) -> None:
        self.timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms the timer again
        if self.loop.time() < self.deadline:
            self.timer = self.loop.call_at(self.deadline, self._check_deadline)
            return
        waiter.set_result(True)  # type: ignore[arg-type]

    def ended(self, request: httpx.Request, what: str) -> Exception:
        if self.error is not None:
            return httpx.ReadError(f"{what}: {self.error}", request=request)
        return httpx.RemoteProtocolError(what, request=request)

    async def read_response(
        self, request: httpx.Request
    ) -> tuple[int, list[tuple[bytes, bytes]], dict[str, Any], tuple[str, int | None]]:
        """Status, headers, extensions and framing (``length``/``chunked``/``eof``, the
        length) of the answer; its body stays in ``buf``."""
        while True:
            end = self.buf.find(b"\r\n\r\n")
            while end < 0:
                if len(self.buf) > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError("response headers too large", request=request)
                if self.eof:
                    raise self.ended(request, "Server disconnected without sending a response.")
                await self.wait(request)
                end = self.buf.find(b"\r\n\r\n")
            head = bytes(self.buf[:end])
            del self.buf[: end + 4]
            lines = head.split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            code, _, reason = rest.partition(b" ")
            if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
                raise httpx.RemoteProtocolError(
                    f"malformed status line {lines[0][:100]!r}", request=request
                )
            status = int(code)
            headers = []
            length: int | None = None
            chunked = False
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if not sep or not name or name[-1] in _BLANKS or line[0] in _BLANKS:
                    raise httpx.RemoteProtocolError(
                        f"malformed header line {line[:100]!r}", request=request
                    )
                value = value.strip(b" \t")
                headers.append((name, value))
                lower = name.lower()
                if lower == b"content-length":
                    try:
                        declared = int(value.split(b",")[0])
                    except ValueError:
                        raise httpx.RemoteProtocolError(
                            "malformed Content-Length", request=request
                        ) from None
                    if declared < 0 or (length is not None and declared != length):
                        raise httpx.RemoteProtocolError("malformed Content-Length", request=request)
                    length = declared
                elif lower == b"transfer-encoding":
                    chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
                elif lower == b"connection" and b"close" in value.lower():
                    self.keep_alive = False
            if 100 <= status < 200 and status != 101:
                continue  # an interim answer (100 Continue): the real one follows
            if version == b"HTTP/1.0":
                self.keep_alive = False
            if request.method == "HEAD" or status in (101, 204, 304):
                mode, length = "length", 0
                if status == 101:
                    self.keep_alive = False
            elif chunked:
                mode = "chunked"
                if length is not None:
                    self.keep_alive = False  # both framings: chunked wins, never reuse
            elif length is not None:
                mode = "length"
            else:
                mode = "eof"
                self.keep_alive = False
            extensions = {"http_version": version, "reason_phrase": reason}
            return status, headers, extensions, (mode, length)


class _Body(httpx.AsyncByteStream):
    """The response body: its bytes as they arrive, de-chunked; every complete piece
    already received is handed over at once (no waiting to fill anything)."""

    def __init__(
        self,
        pool: LeanTransport,
        key: tuple[str, int],
        conn: _Connection,
        request: httpx.Request,
        framing: tuple[str, int | None],
    ) -> None:
        self.framing = framing
        self.pool = pool
        self.key = key
        self.conn: _Connection | None = conn
        self.request = request
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        if conn is None:
            return
        request = self.request
        mode, length = self.framing
        buf = conn.buf
        try:
            if mode == "length":
                left = length or 0
                while left:
                    if not buf:
                        if conn.eof:
                            raise conn.ended(
                                request,
                                f"peer closed connection without sending complete message body: "
                                f"{left} of {length} bytes missing",
                            )
                        await conn.wait(request)
                        continue
                    if len(buf) <= left:
                        piece = bytes(buf)
                        buf.clear()
                    else:
                        piece = bytes(buf[:left])
                        del buf[:left]
                    left -= len(piece)
                    yield piece
            elif mode == "chunked":
                async for piece in _dechunk(conn, request):
                    yield piece
            else:
                while True:
                    if buf:
                        piece = bytes(buf)
                        buf.clear()
                        yield piece
                    elif conn.eof:
                        if conn.error is not None:
                            raise conn.ended(request, "connection broken")
                        break
                    else:
                        await conn.wait(request)
        except BaseException:
            self._drop()
            raise
        self.done = True
        self._give_back()

    async def read_all(self) -> bytes:
        """The whole body, as joining :meth:`__aiter__`'s pieces gives it: with a length
        and every byte already received (a short answer comes with its headers), one copy
        and no generator."""
        conn = self.conn
        mode, length = self.framing
        if conn is None or mode != "length" or length is None or len(conn.buf) < length:
            return b"".join([piece async for piece in self])
        buf = conn.buf
        if len(buf) == length:
            content = bytes(buf)
            buf.clear()
        else:
            content = bytes(buf[:length])
            del buf[:length]
        self.done = True
        self._give_back()
        return content

    def _give_back(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            if conn.buf:  # more than the answer: nothing to trust on this connection
                conn.close()
                return
            self.pool._release(self.key, conn)

    def _drop(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()

    async def aclose(self) -> None:
        if self.done:
            self._give_back()
        else:
            self._drop()


async def _dechunk(conn: _Connection, request: httpx.Request) -> AsyncIterator[bytes]:
    """De-chunk what arrives; every round hands over all the data complete so far."""
    buf = conn.buf
    left = 0  # bytes of the current chunk's data still to come
    state = "size"  # size -> data -> crlf -> size ... -> trailer
    while True:
        pieces = []
        pos = 0
        size = len(buf)
        while pos < size:
            if state == "data":
                take = min(left, size - pos)
                pieces.append(bytes(buf[pos : pos + take]))
                pos += take
                left -= take
                if left == 0:
                    state = "crlf"
            elif state == "crlf":
                if size - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise httpx.RemoteProtocolError("malformed chunked body", request=request)
                pos += 2
                state = "size"
            elif state == "size":
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > 1024:
                        raise httpx.RemoteProtocolError("malformed chunk size", request=request)
                    break
                try:
                    left = int(bytes(buf[pos:end]).split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise httpx.RemoteProtocolError(
                        "malformed chunk size", request=request
                    ) from None
                if left < 0:
                    raise httpx.RemoteProtocolError("malformed chunk size", request=request)
                pos = end + 2
                state = "data" if left else "trailer"
            else:  # trailer lines up to an empty one
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    if size - pos > MAX_HEAD_BYTES:
                        raise httpx.RemoteProtocolError("trailers too large", request=request)
                    break
                if end == pos:
                    pos += 2
                    state = "done"
                    break
                pos = end + 2
        if pos:
            del buf[:pos]
        if pieces:
            yield pieces[0] if len(pieces) == 1 else b"".join(pieces)
        if state == "done":
            return
        if conn.eof:
            raise conn.ended(
                request, "peer closed connection without sending complete message body"
            )
        await conn.wait(request)
