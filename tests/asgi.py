"""The real ASGI application in-process, driven the way daphne drives it.

:func:`in_process` installs a runtime (config, a dispatcher over in-memory model processes,
upstream clients over the given httpx transport, or real sockets when none is given) and
yields the pieces; :class:`Call` is one HTTP request through the app, with a client that
can disconnect at any moment (ASGI ``http.disconnect``), as a browser or SDK would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import types
import urllib.parse
from collections.abc import AsyncIterator

import httpx

from proxy.upstream import Upstreams
from scheduler import runtime
from scheduler.config import Config
from scheduler.dispatch_state import ANNOUNCE_AFTER
from scheduler.dispatcher import Dispatcher, Outcome
from scheduler.keys import KeyRing
from scheduler.testing import FakeProcessFactory
from web.runtime import carrying


def http_scope(
    method: str, raw_path: str, query: bytes = b"", headers: list[tuple[bytes, bytes]] = ()
) -> dict:
    """An HTTP scope as daphne builds it: ``raw_path`` as on the request line
    (percent-escaped), ``path`` what daphne makes of it (``unquote``), lowercase headers."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": urllib.parse.unquote(raw_path),
        "raw_path": raw_path.encode("latin-1"),
        "query_string": query,
        "root_path": "",
        "headers": [(k.lower(), v) for k, v in headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
    }


class FinishLog:
    def __init__(self) -> None:
        self.finished: dict[str, Outcome | None] = {}
        self.tickets: dict[str, object] = {}

    def on_enqueue(self, ticket): ...
    def on_dispatch(self, ticket): ...
    def on_model_state(self, model, state): ...
    def on_settings(self, settings, source): ...

    def on_finish(self, ticket):
        self.finished[ticket.request_id] = ticket.outcome
        self.tickets[ticket.request_id] = ticket


class Call:
    """One HTTP request driven through the ASGI app the way daphne drives it."""

    def __init__(
        self,
        app,
        path: str,
        body: bytes,
        method: str = "POST",
        *,
        content_type: bytes = b"application/json",
        chunk: int | None = None,
        announce_length: bool = True,
        stall_after: int | None = None,
        headers: list[tuple[bytes, bytes]] = (),
    ) -> None:
        """``chunk``: send the body in pieces of this size; ``stall_after``: stop sending
        after that many pieces (a client that announced more than it sends)."""
        self.disconnect = asyncio.Event()
        self.status: int | None = None
        self.body = b""
        self.complete = asyncio.Event()
        self.headers: dict[bytes, bytes] = {}
        path_part, _, query = path.partition("?")
        request_headers = [(b"host", b"127.0.0.1:8080"), (b"content-type", content_type), *headers]
        if announce_length:
            request_headers.append((b"content-length", str(len(body)).encode()))
        scope = http_scope(method, path_part, query.encode(), request_headers)
        size = chunk or max(1, len(body))
        self._pieces = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
        self._stall_after = stall_after
        self._sent = 0
        self.task = asyncio.create_task(app(scope, self._receive, self._send))

    async def _receive(self):
        if self._pieces and (self._stall_after is None or self._sent < self._stall_after):
            piece = self._pieces.pop(0)
            self._sent += 1
            return {"type": "http.request", "body": piece, "more_body": bool(self._pieces)}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message):
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.lower(): v for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                self.complete.set()

    @property
    def request_id(self) -> str:
        return self.headers[b"x-llamaswap-request-id"].decode()

    async def done(self, timeout: float = 2.0) -> None:
        """The client has its whole answer and the dispatcher has told its observers (the
        recorder): they hear of a finish ``ANNOUNCE_AFTER`` loop turns after it."""
        async with asyncio.timeout(timeout):
            await asyncio.wait({self.task})
        for _ in range(ANNOUNCE_AFTER + 1):
            await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def in_process(
    config: Config,
    transport: httpx.AsyncBaseTransport | None = None,
    keys: KeyRing | None = None,
    **factory_options,
) -> AsyncIterator[types.SimpleNamespace]:
    from llamaswap_site.asgi import build_application

    factory = FakeProcessFactory(**factory_options)
    recorder = FinishLog()
    dispatcher = Dispatcher(config, process_factory=factory, observers=[recorder])
    upstreams = Upstreams(size=1, transport=transport)
    rt = runtime.Runtime(config, dispatcher, upstreams, keys=keys or KeyRing())
    runtime.install(rt)
    await dispatcher.start()
    try:
        yield types.SimpleNamespace(
            app=build_application(rt),
            runtime=rt,
            dispatcher=dispatcher,
            factory=factory,
            recorder=recorder,
        )
    finally:
        await dispatcher.stop(grace=0)
        await upstreams.aclose()
        runtime.install(None)


def served_client(rt: runtime.Runtime, **options):
    """Django's ``AsyncClient`` whose requests carry ``rt`` in their scope, as the router
    of ``build_application`` hands it to the views (``web.runtime``)."""
    from django.test import AsyncClient

    class Served(AsyncClient):
        async def request(self, **request):
            return await super().request(**request, **carrying(rt))

    return Served(**options)


class Body(httpx.AsyncByteStream):
    """A response body streamed as one piece, as a model server's would be (an
    ``httpx.Response(content=...)`` is already read, and ``aiter_raw`` refuses it)."""

    def __init__(self, data: bytes = b"{}") -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


class Gate(httpx.AsyncBaseTransport):
    """A model that answers 200 JSON once the test opens the gate (``open.set()``); keeps
    the first message's content of every request it receives, in order."""

    def __init__(self, opened: bool = False) -> None:
        self.open = asyncio.Event()
        if opened:
            self.open.set()
        self.entered = asyncio.Event()
        self.served: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            self.served.append(json.loads(request.content)["messages"][0]["content"])
        except (ValueError, KeyError, IndexError, TypeError):
            self.served.append("")
        self.entered.set()
        await self.open.wait()
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=Body())
