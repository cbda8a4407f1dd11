"""One proxied request's whole life, in the order it happens.

1. Before any handler (the router in ``llamaswap_site/asgi.py`` asks :class:`ProxyHandler`
   for every HTTP request, pages included): a browser's preflight is answered
   (:meth:`ProxyHandler.preflight`, as llama-swap answers it: ``web.cors``); an allowed
   origin gets ``Access-Control-Allow-Origin``; then the access rules of ``web.access``
   (the cross-site rule, the Host header, the API key) may refuse it
   (:meth:`ProxyHandler.admit`).
2. The body is read whole, within ``limits`` (:func:`read_body`: 413, 408).
3. The view runs (Django's URL resolution, no middleware, no signals) and its response is
   sent; a relayed stream's pieces go out as they come (:meth:`ProxyHandler.send_response`).
   The client leaving cancels the view.
4. The request's turn (``proxy.turn.Turn``, set by the view as ``request.turn``) is closed
   in a ``finally``, whatever happened: the one place a proxied request's ticket ends.

No middleware and none of the per-request ``request_started``/``request_finished``
receivers, which under ASGI each cost a thread hop and an OS thread per waiting request
(halving memory per waiting request, see BENCHMARKS.md). The handler is given the
:class:`scheduler.runtime.Runtime` it serves (limits, keys, ``security``) when it is built.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import io
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import IO, Any

from django.core.exceptions import RequestAborted, SuspiciousOperation, TooManyFieldsSent
from django.core.handlers.asgi import ASGIHandler, ASGIRequest
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import ResolverMatch, URLResolver, get_resolver, set_script_prefix

from proxy.turn import Turn
from scheduler.config import RequestLimits, Security
from scheduler.runtime import Runtime
from web.access import (
    DEFAULT_SECURITY,
    access_refusal,
    cross_site_refusal,
    header,
    host_allowed,
    needs_key,
)
from web.cors import preflight_headers, response_origin, with_allowed_origin
from web.errors import error_response, invalid_host

log = logging.getLogger("llamaswap.proxy")

Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]
Scope = MutableMapping[str, Any]

DEFAULT_LIMITS = RequestLimits()
"""``limits`` when the handler serves no runtime (tests of the bare handler)."""
RESOLVE_CACHE_SIZE = 256
RESOLVE_CACHE_MAX_CHARS = 512
"""A path's URL match is kept (Django's resolver tries the URLconf's patterns one by one:
17 µs for ``/v1/chat/completions``, 48 for ``/health``), for this many paths this short at
most (``/upstream/...`` paths vary): the cache stays bounded whatever clients send."""


class RefuseSuspicious(ASGIHandler):
    """``create_request`` that answers a 400 instead of raising: Django parses the query
    string while building an ASGIRequest (the ``encoding`` setter looks at ``GET`` when
    the Content-Type has a charset), so TooManyFieldsSent and friends escape the handler
    and daphne answers 500."""

    def create_request(
        self, scope: Mapping[str, Any], body_file: IO[bytes]
    ) -> tuple[ASGIRequest, None] | tuple[None, HttpResponseBase]:
        try:
            return super().create_request(scope, body_file)
        except SuspiciousOperation as exc:
            code = "too_many_fields" if isinstance(exc, TooManyFieldsSent) else "invalid_request"
            return None, error_response(400, str(exc), code=code)


class ProxyHandler(RefuseSuspicious):
    """Django's ASGI handler minus middleware, signals and thread hops: async views only.

    It owns the whole life of a proxied request, so it is where a request's turn on the GPU
    (``proxy.turn.Turn``, set by the view as ``request.turn``) is closed: in a ``finally``
    after the response has been sent or abandoned, whatever happened (see proxy/turn.py).
    """

    def __init__(self, runtime: Runtime | None = None) -> None:
        super().__init__()
        self.runtime = runtime
        """What it serves: the config's ``limits`` and ``security``, the API keys. None:
        the defaults and no keys."""

    @property
    def limits(self) -> RequestLimits:
        return self.runtime.config.limits if self.runtime is not None else DEFAULT_LIMITS

    @property
    def security(self) -> Security:
        return self.runtime.config.security if self.runtime is not None else DEFAULT_SECURITY

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware: list[Any] = []
        self._template_response_middleware: list[Any] = []
        self._exception_middleware: list[Any] = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)  # type: ignore[attr-defined]

    def resolve_request(self, request: HttpRequest) -> ResolverMatch:
        """Django's, with the match of a path kept (:data:`RESOLVE_CACHE_SIZE`): the
        URLconf does not change while it serves (a new one is a new resolver, another
        key). A path that matches nothing raises ``Resolver404`` every time."""
        path = request.path_info
        if hasattr(request, "urlconf") or len(path) > RESOLVE_CACHE_MAX_CHARS:
            return super().resolve_request(request)
        match = _resolved(get_resolver(), path)
        request.resolver_match = match
        return match

    # -- before any handler ------------------------------------------------------------

    async def preflight(self, scope: Scope, send: Send) -> None:
        """``OPTIONS`` on any path: ``204`` with llama-swap's CORS headers
        (:func:`web.cors.preflight_headers`), before any key; a Host not allowed is
        refused."""
        ok, host = host_allowed(scope)
        if not ok:
            await self.refuse(invalid_host(host, scope["path"]), send)
            return
        headers = preflight_headers(
            header(scope, b"origin"),
            header(scope, b"access-control-request-headers"),
            self.security,
            private_network=header(scope, b"access-control-request-private-network") == b"true",
        )
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body"})

    async def admit(self, scope: Scope, send: Send) -> Send | None:
        """The ``send`` to answer this request with (one that adds
        ``Access-Control-Allow-Origin`` for an allowed origin on an API path: ``web.cors``,
        no cost unless one is configured), or None when the access rules refused it: the
        refusal has been sent (``web.access``: cross-site first, then Host and key)."""
        origin = response_origin(scope, self.security)
        if origin is not None and needs_key(scope["path"]):
            send = _allowing(send, origin)
        refusal = await self.refusal(scope)
        if refusal is None:
            return send
        await self.refuse(refusal, send)
        return None

    async def refusal(self, scope: Scope) -> HttpResponseBase | None:
        """What refuses this request (HTTP or websocket) before any handler, or None: the
        cross-site rule first (the same 403 whatever the credential, no key hashed), then
        the Host header and the API key (``web.access``), with this runtime's settings."""
        keys = self.runtime.keys if self.runtime is not None else None
        return cross_site_refusal(scope, self.security) or await access_refusal(scope, keys)

    async def refuse(self, response: HttpResponseBase, send: Send) -> None:
        await self.send_response(response, send)
        close_response(response)

    # -- the request -------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = await read_body(scope, receive, self.limits)
        except RequestAborted:
            return
        except BodyRefused as refused:
            await self.send_response(refused.response, send)
            return
        set_script_prefix(self.get_script_prefix(scope))
        request, error = self.create_request(scope, io.BytesIO(body))
        if request is None:
            assert error is not None
            await self.refuse(error, send)
            return
        # The body as one bytes object: Django's ``request.body`` would copy the stream
        # (and refuse more than DATA_UPLOAD_MAX_MEMORY_SIZE); the BytesIO above shares it.
        request._body = body
        del body
        request.scope = scope
        request.turn = None  # type: ignore[attr-defined]

        # The view runs in this task; a listener waits for the client to leave and cancels
        # it (Django's own behaviour, with one task per request instead of two and no
        # asyncio.wait: BENCHMARKS.md, "Where a relayed request's CPU goes"; on daphne's
        # queue, with no second task at all: _QueueListener).
        task = asyncio.current_task()
        assert task is not None
        before = task.cancelling()  # another party's cancellations, older than this request
        watch = _DisconnectWatch(task)
        queue = _queue_of(receive)
        listener: asyncio.Task[Any] | _QueueListener
        if queue is not None:
            listener = _QueueListener(queue, watch)
        else:
            listener = asyncio.create_task(self.listen_for_disconnect(receive))
            listener.add_done_callback(watch.listener_done)
        response: HttpResponseBase | None = None
        failure: BaseException | None = None
        try:
            response = await self.run_get_response(request)
            await self.send_response(response, send)
        except asyncio.CancelledError as exc:
            if response is None:  # the view was cancelled (in send: client gone while sending)
                failure = exc
        except BaseException as exc:
            failure = exc
        finally:
            # Also when this task itself is cancelled by the server (it gave up on the
            # request): nothing below may be skipped.
            watch.watching = False
            if not listener.done():
                listener.cancel()
            if watch.cancel_sent:
                task.uncancel()
            cancelled = task.cancelling() > before  # the server gave up: as good as a disconnect
            left = watch.client_left or (listener.done() and not listener.cancelled())
            disconnected = left or cancelled
            turn: Turn | None = request.turn  # type: ignore[attr-defined]
            request.turn = None  # type: ignore[attr-defined]
            if turn is not None:
                status = response.status_code if response is not None and failure is None else None
                await turn.close(disconnected=disconnected, error=failure, status=status)
        try:
            if cancelled:
                raise asyncio.CancelledError()
            if failure is not None and not isinstance(failure, asyncio.CancelledError):
                raise failure
            if response is not None and failure is None:
                close_response(response)
        finally:
            # A raised exception's traceback holds this frame: without this the frame
            # would hold the exception, a reference cycle per failed request left to the
            # cyclic GC, whose collections showed as latency spikes.
            failure = None

    async def send_response(self, response: HttpResponseBase, send: Send) -> None:
        """Django's, sent with fewer layers: a whole answer within one of Django's chunks
        in one body message (Django's own sends just that, through a generator and a
        conversion per header); a relayed stream (``response.relay_stream``, set by
        proxy/relay.py) piece by piece as they come, without the three generator layers and
        the re-chunking Django puts around every piece."""
        stream = getattr(response, "relay_stream", None)
        if stream is None:
            body = None if response.streaming else response.content  # type: ignore[attr-defined]
            if body is None or len(body) > self.chunk_size:
                await super().send_response(response, send)
                return
            await send(_start(response))
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await send(_start(response))
        try:
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await stream.aclose()
        await send({"type": "http.response.body"})

    @staticmethod
    def get_script_prefix(scope: Mapping[str, Any]) -> str:
        prefix: str = scope.get("root_path", "") or "/"
        return prefix


def _start(response: HttpResponseBase) -> dict[str, Any]:
    """The ``http.response.start`` message of ``response``, as Django's handler builds it."""
    headers = [(name.encode("ascii"), value.encode("latin1")) for name, value in response.items()]
    for cookie in response.cookies.values():
        headers.append((b"Set-Cookie", cookie.output(header="").encode("ascii").strip()))
    return {"type": "http.response.start", "status": response.status_code, "headers": headers}


@functools.lru_cache(maxsize=RESOLVE_CACHE_SIZE)
def _resolved(resolver: URLResolver, path: str) -> ResolverMatch:
    """``resolver.resolve(path)``, shared by the requests for ``path``: a match is never
    changed once made (the view gets its arguments unpacked)."""
    return resolver.resolve(path)


def _allowing(send: Send, origin: bytes) -> Send:
    """``send`` with ``Access-Control-Allow-Origin: origin`` on the response's headers."""

    async def sending(message: Mapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            headers = with_allowed_origin(message.get("headers", []), origin)
            message = {**message, "headers": headers}
        await send(message)

    return sending


# -- the body --------------------------------------------------------------------------------


class BodyRefused(Exception):
    """The body was not read: ``response`` says why (413, 408)."""

    def __init__(self, response: HttpResponse) -> None:
        self.response = response


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def read_body(scope: Scope, receive: Receive, limits: RequestLimits) -> bytes:
    """The whole request body as one bytes object, within ``limits`` (see RequestLimits):
    at most ``max_body_bytes`` (else a 413 before reading it), ``body_timeout`` in all and
    ``body_idle_timeout`` between chunks (else a 408)."""
    limit = limits.max_body_bytes
    declared = declared_length(scope)
    if declared is not None and declared > limit:
        raise BodyRefused(too_large(declared, limit))
    chunks = []
    size = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout if limits.body_timeout else None
    idle = limits.body_idle_timeout or None
    try:
        while True:
            message = _queued(receive)
            if message is None:  # the client still sends: wait, within the limits
                at = loop.time() + idle if idle is not None else deadline
                if at is not None and deadline is not None:
                    at = min(at, deadline)
                async with asyncio.timeout_at(at):
                    message = await receive()
            if message["type"] == "http.disconnect":
                raise RequestAborted()
            chunk: bytes = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise BodyRefused(too_large(size, limit))
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
    except TimeoutError:
        client = scope.get("client") or ("?", 0)
        log.warning(
            "request body too slow; connection cut",
            extra={
                "client": f"{client[0]}:{client[1]}",
                "path": scope.get("path", ""),
                "received": size,
            },
        )
        raise BodyRefused(
            error_response(408, "the request body did not arrive in time", code="request_timeout")
        ) from None
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


def _queue_of(receive: Receive) -> asyncio.Queue[Mapping[str, Any]] | None:
    """The queue ``receive`` reads when it is an ``asyncio.Queue``'s ``get`` (daphne's)
    whose waiting getters are where CPython keeps them (a deque, ``_getters``: 3.11 to
    3.13); None otherwise, and the handler uses Django's listener task instead."""
    if getattr(receive, "__func__", None) is not asyncio.Queue.get:
        return None
    queue = receive.__self__  # type: ignore[attr-defined]
    if not isinstance(getattr(queue, "_getters", None), collections.deque):
        return None
    return queue  # type: ignore[no-any-return]


def _queued(receive: Receive) -> Mapping[str, Any] | None:
    """The next message, when ``receive`` reads a queue (:func:`_queue_of`) and one is
    waiting in it: taken without a wait, so without a timer (a timeout's timer costs
    10 µs; daphne queues a short body before the handler starts). None otherwise."""
    queue = _queue_of(receive)
    return queue.get_nowait() if queue is not None and queue.qsize() else None


def too_large(size: int, limit: int) -> HttpResponse:
    return error_response(
        413,
        f"request body of {size} bytes is over the limit of {limit} bytes (limits.maxBodyBytes)",
        code="request_too_large",
    )


class _DisconnectWatch:
    """The done callback of a request's disconnect listener: the client left (or sent
    something unexpected) while the request's task still works on it: cancel that task."""

    __slots__ = ("task", "watching", "client_left", "cancel_sent")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.watching = True
        self.client_left = False
        self.cancel_sent = False

    def listener_done(self, listener: asyncio.Task[Any]) -> None:
        if listener.cancelled():
            return
        listener.exception()  # retrieved (RequestAborted): no "never retrieved" log
        self.left()

    def left(self) -> None:
        self.client_left = True
        if self.watching:
            self.watching = False
            self.cancel_sent = True
            self.task.cancel()


class _QueueListener:
    """Django's ``listen_for_disconnect`` on daphne's queue, without a task (its creation,
    first step and cancel cost ~7 µs a request): a waiter among the queue's getters, put
    there as ``asyncio.Queue.get`` puts its own, so the next message (after the body:
    the client left, or sent something unexpected) wakes it; then the watch is told.
    ``done``/``cancelled``/``cancel`` answer as the listener task's would."""

    __slots__ = ("queue", "watch", "waiter")

    def __init__(self, queue: asyncio.Queue[Mapping[str, Any]], watch: _DisconnectWatch) -> None:
        self.queue = queue
        self.watch = watch
        self.waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if queue.qsize():  # a message already waits: ``get`` would return it at once
            self.waiter.set_result(None)
        else:
            queue._getters.append(self.waiter)  # type: ignore[attr-defined]
        self.waiter.add_done_callback(self._woken)

    def _woken(self, waiter: asyncio.Future[None]) -> None:
        if waiter.cancelled():
            return
        with contextlib.suppress(asyncio.QueueEmpty):
            self.queue.get_nowait()  # taken, as ``get`` would
        self.watch.left()

    def done(self) -> bool:
        return self.waiter.done()

    def cancelled(self) -> bool:
        return self.waiter.cancelled()

    def cancel(self) -> None:
        if self.waiter.cancel():
            with contextlib.suppress(ValueError):
                self.queue._getters.remove(self.waiter)  # type: ignore[attr-defined]


def close_response(response: HttpResponseBase) -> None:
    """HttpResponse.close() without the request_finished signal."""
    for closer in response._resource_closers:  # type: ignore[attr-defined]
        try:
            closer()
        except Exception:
            pass
    response._resource_closers.clear()  # type: ignore[attr-defined]
    response.closed = True
