"""Relay one scheduled request: take a turn, wait for it, send upstream, relay the answer.

Every path ends the turn through :class:`proxy.turn.Turn` (closed by the lean handler, see
``proxy/handler.py``); this module only notes how each request ended. The per-chunk
path does nothing but yield the upstream's bytes and keep a short tail for usage figures.

Timeouts per model (``timeouts`` in the config; 0 disables one):

* ``connect``: seconds to connect to the model (httpx connect timeout);
* ``responseHeader``: seconds from sending to the response headers, then 504;
* ``idle``: while waiting for the headers, every ``idle`` seconds of silence the model's
  health check is asked; healthy models keep working (a long prompt, a 12-hour render),
  a model that fails it gets the request 504'd and is stopped. Once the answer has begun,
  ``idle`` seconds without a byte cut it (504, or a stream ending without ``[DONE]``), and
  the model is stopped if its health check then fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import weakref
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import httpx
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from proxy import progress as progress_mod
from proxy.collector import collector
from proxy.headers import forward_headers, response_headers
from proxy.turn import Turn
from proxy.upstream import read_whole
from proxy.usage import Tally
from scheduler import runtime
from scheduler.config import ModelConfig
from scheduler.core.priority import HEADER
from scheduler.dispatcher import Outcome, Refused, Ticket
from scheduler.keys import ApiKey, priority_of
from scheduler.process import ModelStartError
from scheduler.runtime import UpstreamPool
from web import cancel, captures
from web.errors import REQUEST_ID_HEADER, clip, error_body, error_response

log = logging.getLogger("llamaswap.proxy")

PRIORITY_META = "HTTP_" + HEADER.upper().replace("-", "_")
STREAM_TAIL = 4096
"""Bytes of a stream's end kept to read usage and timings from (see :func:`stream_answer`)."""
HEALTH_PROBE_TIMEOUT = 5.0
WRITE_TIMEOUT = 60.0


class UpstreamTimeout(Exception):
    """The model did not answer in time (HTTP 504)."""


async def relay(
    request: HttpRequest,
    model: ModelConfig,
    request_id: str,
    path: str,
    body: bytes,
    progress: bool = False,
) -> HttpResponseBase:
    """Take a turn for ``model`` and relay the request to it. With ``progress``
    (``sendLoadingState``, streaming chat), a request that waits is told where it stands."""
    query = request.META.get("QUERY_STRING", "")
    try:
        # Built before the request takes a turn: a path that is no valid URL is the
        # caller's mistake and costs nobody the GPU.
        url = upstream_url(model.proxy, path, query)
    except (httpx.InvalidURL, ValueError) as exc:
        return error_response(
            400, f"invalid path: {exc}", code="invalid_path", request_id=request_id
        )
    scope = getattr(request, "scope", None)
    # A parsed multipart form holds copies of its files: only the raw body is sent on.
    request.__dict__.pop("_post", None)
    request.__dict__.pop("_files", None)
    header = request.META.get(PRIORITY_META)
    key: ApiKey | None = scope.get("llamaswap.api_key") if scope is not None else None
    priority, requested, key_name = priority_of(key, header)
    turn = Turn(
        runtime.current().dispatcher,
        model,
        priority,
        request_id,
        path,
        api_key=key_name,
        requested_priority=requested,
    )
    request.turn = turn  # type: ignore[attr-defined]  # the handler closes it, whatever happens
    ticket = turn.ticket
    cancel.track(ticket)  # POST /api/inflight/{id}/cancel, the dashboard's Cancel
    ticket.extra["method"] = request.method  # /api/events' in-flight list

    async def answer() -> HttpResponseBase:
        return await _answer(request, turn, model, url, request_id, body, scope)

    try:
        if progress:
            # sendLoadingState: a streaming chat request that is not granted at once is told
            # where it stands (or that its model loads) until its turn comes (proxy/progress.py).
            shown = await progress_mod.maybe(ticket, model, request_id, answer)
            if shown is not None:
                return shown
        return await answer()
    except asyncio.CancelledError:
        cancelled = cancel.cancelled_answer(ticket, turn.dispatcher.cancel)
        if cancelled is None:
            raise  # the client left (or the server gives up): the handler ends the turn
        return cancelled


URL_CACHE_SIZE = 256
URL_CACHE_MAX_CHARS = 512
"""Upstream URLs are kept parsed (``httpx.URL`` parses and quotes: ~30 µs a request), up
to this many, for a path and query this short at most: a client's longer or rarer ones
are parsed each time, so the cache stays bounded (~0.3 MB) whatever clients send."""


def upstream_url(base: str, path: str, query: str) -> httpx.URL:
    """The model's URL for ``path`` and ``query`` (``httpx.InvalidURL`` or ``ValueError``
    when it is none). ``httpx.URL`` is immutable, so requests share one."""
    if len(path) + len(query) > URL_CACHE_MAX_CHARS:
        return _parse_url(base, path, query)
    return _cached_url(base, path, query)


def _parse_url(base: str, path: str, query: str) -> httpx.URL:
    return httpx.URL(base.rstrip("/") + path + (f"?{query}" if query else ""))


_cached_url = functools.lru_cache(maxsize=URL_CACHE_SIZE)(_parse_url)


async def _answer(
    request: HttpRequest,
    turn: Turn,
    model: ModelConfig,
    url: httpx.URL,
    request_id: str,
    body: bytes,
    scope: Any,
) -> HttpResponseBase:
    """The request's turn: wait for it, send the request to the model, relay the answer."""
    try:
        await turn.wait()
    except ModelStartError as exc:
        return _start_failed(model, exc, request_id)
    except Refused as exc:
        retry = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        return error_response(
            exc.status, str(exc), code=exc.code, request_id=request_id, headers=retry
        )

    # The client's key is this server's credential when it checks keys: never the model's
    # (llama-swap has no model key to send instead). Without keys it passes, as in
    # llama-swap (a llama-server started with --api-key). The dashboard's cookies never.
    credentials = not runtime.current().keys.enabled
    headers = (
        forward_headers(scope["headers"], credentials=credentials) if scope is not None else []
    )
    try:
        upstream = await _send(turn, request.method or "POST", url, headers, body)
    except ModelStartError as exc:  # restarted after it died at grant, and did not start
        return _start_failed(model, exc, request_id)
    except UpstreamTimeout as exc:
        turn.note(Outcome.FAILED, 504, str(exc))
        return error_response(504, str(exc), code="upstream_timeout", request_id=request_id)
    except httpx.HTTPError as exc:
        cause = f"{type(exc).__name__}: {exc}"
        turn.note(Outcome.FAILED, 502, cause)
        turn.suspect = True
        return error_response(
            502,
            f"model {model.id!r} did not answer: {cause}",
            code="upstream_unavailable",
            request_id=request_id,
        )
    turn.upstream = upstream
    capture = None
    if captures.enabled(runtime.current().config):  # captureBuffer (web/captures.py)
        capture = _Capture(request_id, request.path, scope, body)
    body = b""  # the request body is no longer needed while the answer is relayed
    return await relay_answer(turn, upstream, request_id, capture)


async def relay_answer(
    turn: Turn, upstream: httpx.Response, request_id: str, capture: _Capture | None = None
) -> HttpResponseBase:
    """The answer of ``upstream`` (a model's, or a peer's: proxy/peers.py) relayed to the
    client: an event stream as it comes (:func:`stream_answer`), anything else read whole;
    how it ended is noted on ``turn``."""
    ticket, model = turn.ticket, turn.ticket.model
    status = upstream.status_code
    content_type = upstream.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        return event_stream(stream_answer(turn, upstream, capture), upstream, request_id, lean=True)

    try:
        content = await read_whole(upstream)
    except httpx.ReadTimeout:
        message = await _went_silent(turn, "its answer")
        return error_response(504, message, code="upstream_timeout", request_id=request_id)
    except httpx.HTTPError as exc:
        cause = f"{type(exc).__name__}: {exc}"
        turn.note(Outcome.FAILED, 502, cause)
        turn.suspect = True
        return error_response(
            502,
            f"model {model.id!r} broke off its answer: {cause}",
            code="upstream_broken",
            request_id=request_id,
        )
    if status < 300 and content_type.startswith("application/json"):
        note_usage(ticket, content)
    turn.note(Outcome.COMPLETED, status)
    if capture is not None:
        capture.keep(upstream, [content])
    await turn.close()  # the GPU's part is done: the next request need not wait for the send
    await hand_over(turn)
    return whole_answer(content, upstream, request_id)


def whole_answer(content: bytes, upstream: httpx.Response, request_id: str) -> HttpResponse:
    """A model's (or a peer's) answer read whole, relayed with its headers and the request
    id (its usage is noted first: :func:`note_usage`)."""
    response = HttpResponse(content, status=upstream.status_code)
    for name, value in response_headers(upstream.headers):
        response[name] = value
    response[REQUEST_ID_HEADER] = request_id
    return response


def event_stream(
    stream: AsyncIterator[bytes], upstream: httpx.Response, request_id: str, lean: bool = False
) -> StreamingHttpResponse:
    """A model's event stream relayed on, with its headers and no buffering on the way.
    ``lean``: ``ProxyHandler`` sends it without Django's response generators."""
    response = StreamingHttpResponse(stream, status=upstream.status_code)
    if lean:
        response.relay_stream = stream  # type: ignore[attr-defined]
    for name, value in response_headers(upstream.headers):
        response[name] = value
    response["X-Accel-Buffering"] = "no"
    response["Cache-Control"] = "no-cache"
    response[REQUEST_ID_HEADER] = request_id
    return response


HAND_OVER_STEPS = 2
"""Loop turns from a turn's end to the next request's first byte to its model: the
dispatcher's step (pick, grant: ``Ticket.pass_on`` settles the granted view's wait at
once), then that view's step up to the write (tests/test_relay_costs.py)."""


async def hand_over(turn: Turn) -> None:
    """Once a turn has ended, let the next one begin before this request's answer is sent.

    Ending the turn posts an event to the dispatcher; without this, the dispatcher runs
    only after the rest of this task's step: building the answer, Django's response
    handling and the write to the client, all while the model sits idle. A few loop turns
    let the dispatcher grant the next request and its view write to the model first
    (BENCHMARKS.md, "Dispatch gap at the model"); this client's answer waits that long.
    With no request waiting in the dispatcher's queue (a peer's request has none), nothing
    is to be granted, and the answer goes out at once."""
    queue = getattr(turn.dispatcher, "queue", None)
    if queue is None or not queue:
        return
    for _ in range(HAND_OVER_STEPS):
        await asyncio.sleep(0)


def _start_failed(model: ModelConfig, exc: ModelStartError, request_id: str) -> HttpResponse:
    return error_response(
        503,
        f"model {model.id!r} failed to start: {exc.cause}",
        code="model_start_failed",
        request_id=request_id,
    )


async def _send(
    turn: Turn, method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]], body: bytes
) -> httpx.Response:
    """Send and return once the response headers arrived.

    A refused connection means nothing reached the model: the process it was granted to
    died before its exit was reaped. The dispatcher restarts it and grants the turn once
    more, and the request is sent again, once. Any other failure may have reached the
    model, and is never resent.
    """
    ticket = turn.ticket
    model = ticket.model
    timeouts = model.timeouts
    upstreams = runtime.current().upstreams
    while True:
        request = upstreams.request(
            method,
            url,
            headers,
            body,
            {
                "connect": timeouts.connect or None,
                "read": None,
                "write": WRITE_TIMEOUT,
                "pool": None,
            },
        )
        try:
            response = await _await_headers(upstreams, request, turn)
        except httpx.ConnectError:
            if ticket.resent:
                raise
            turn.dispatcher.resend(ticket)
            await turn.wait()
            continue
        if timeouts.idle:
            # From here on each read of the body may wait ``idle`` seconds: the transport
            # (proxy/upstream.py) reads this dict before every wait
            # (tests/test_relay_timeouts.py fails if that changes).
            request.extensions["timeout"]["read"] = timeouts.idle
        return response


async def _await_headers(
    upstreams: UpstreamPool, request: httpx.Request, turn: Turn
) -> httpx.Response:
    model = turn.ticket.model
    limit = model.timeouts.response_header
    watchdog = (
        _Watchdog(turn, asyncio.current_task())  # type: ignore[arg-type]
        if model.timeouts.idle and model.check_endpoint is not None
        else None
    )
    # Runs once this task waits: once the request is on its way to the model.
    asyncio.get_running_loop().call_soon(collector.model_started)
    try:
        if limit:
            try:
                async with asyncio.timeout(limit):
                    return await upstreams.send(request)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"model {model.id!r} sent no response within {limit:g}s (timeouts.responseHeader)"
                ) from None
        return await upstreams.send(request)
    except asyncio.CancelledError:
        if watchdog is None or watchdog.tripped is None:
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        turn.unhealthy = True
        raise UpstreamTimeout(watchdog.tripped) from None
    finally:
        if watchdog is not None:
            watchdog.close()


class _Watchdog:
    """While a request waits for its response headers: every ``timeouts.idle`` seconds,
    ask the model's health check; if it fails, cancel the waiting task. An entry in the
    loop's :class:`_Alarms`, no timer of its own and no task, until the first probe."""

    __slots__ = ("turn", "task", "alarms", "probe", "tripped")

    def __init__(self, turn: Turn, task: asyncio.Task[Any]) -> None:
        self.turn = turn
        self.task = task
        self.tripped: str | None = None
        self.probe: asyncio.Task[None] | None = None
        self.alarms = _Alarms.of(asyncio.get_running_loop())
        self.alarms.add(self, turn.ticket.model.timeouts.idle)

    def fire(self) -> None:
        self.probe = asyncio.get_running_loop().create_task(self._check())

    async def _check(self) -> None:
        model = self.turn.ticket.model
        if await probe_health(model):
            self.alarms.add(self, model.timeouts.idle)
            return
        self.tripped = f"model {model.id!r} sent nothing for {model.timeouts.idle:g}s and failed its health check"
        self.task.cancel()

    def close(self) -> None:
        self.alarms.due.pop(self, None)
        if self.probe is not None and not self.probe.done():
            self.probe.cancel()


class _Alarms:
    """The watchdogs of one loop under one timer: arming one is a dict entry, where a
    timer's creation and cancel cost ~7 µs a request. The timer is set for the earliest
    time it was asked for; when it rings, the watchdogs whose time has come fire, and it
    is set again for the earliest left (a closed watchdog's entry is simply gone). Kept
    per loop, which it does not hold (the loop's entry goes with the loop)."""

    _loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Alarms] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self) -> None:
        self.due: dict[_Watchdog, float] = {}
        self.timer: asyncio.TimerHandle | None = None

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Alarms:
        alarms = cls._loops.get(loop)
        if alarms is None:
            alarms = cls._loops[loop] = cls()
        return alarms

    def add(self, dog: _Watchdog, delay: float) -> None:
        loop = asyncio.get_running_loop()
        at = self.due[dog] = loop.time() + delay
        timer = self.timer
        if timer is None or at < timer.when():
            if timer is not None:
                timer.cancel()
            self.timer = loop.call_at(at, self._ring)

    def _ring(self) -> None:
        self.timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for dog in [dog for dog, at in self.due.items() if at <= now]:
            del self.due[dog]
            dog.fire()
        if self.due:
            self.timer = loop.call_at(min(self.due.values()), self._ring)


async def probe_health(model: ModelConfig) -> bool:
    """Does the model answer its health check (200) within a few seconds?"""
    if model.check_endpoint is None:
        return True
    url = model.proxy.rstrip("/") + "/" + model.check_endpoint.lstrip("/")
    try:
        response = await runtime.current().upstreams.client().get(url, timeout=HEALTH_PROBE_TIMEOUT)
    except httpx.HTTPError:
        return False
    status: int = response.status_code
    return status == 200


async def _went_silent(turn: Turn, what: str) -> str:
    """The model sent no byte of an answer for ``idle`` seconds: note a 504, and stop the
    model (via the turn's end) if it also fails its health check."""
    model = turn.ticket.model
    message = (
        f"model {model.id!r} sent nothing for {model.timeouts.idle:g}s in {what} (timeouts.idle)"
    )
    turn.note(Outcome.FAILED, 504, message)
    if not await probe_health(model):
        turn.unhealthy = True
    return message


class _Capture:
    """What a capture needs of the request, kept while its answer is relayed (only with
    ``captureBuffer``); the answer's pieces are added up to the store's whole budget."""

    __slots__ = ("request_id", "path", "headers", "body", "room")

    def __init__(self, request_id: str, path: str, scope: Any, body: bytes) -> None:
        self.request_id, self.path, self.body = request_id, path, body
        self.headers = list(scope["headers"]) if scope is not None else []
        self.room = captures.store.limit - len(body)

    def keep(self, upstream: httpx.Response, pieces: list[bytes]) -> None:
        captures.keep(
            self.request_id,
            self.path,
            self.headers,
            self.body,
            upstream.headers.items(),
            b"".join(pieces),
        )


async def stream_answer(
    turn: Turn, upstream: httpx.Response, capture: _Capture | None = None
) -> AsyncIterator[bytes]:
    """Relay the upstream's bytes as they arrive: no re-splitting, no parsing per chunk.

    A client that leaves cancels this generator; the handler then ends the turn as
    cancelled. Only how the upstream side ended is noted here.
    """
    recent: deque[bytes] = deque()  # the last pieces, at least STREAM_TAIL bytes of them
    kept = 0
    head = b""  # the first piece: Anthropic's message_start holds the input token count
    kept_all: list[bytes] = []  # every piece, for a capture (captureBuffer) only
    yield b""  # daphne sends the headers with the first body write: send them now
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
            if not head:
                head = chunk[:STREAM_TAIL]
            if capture is not None:
                kept_all.append(chunk)
                capture.room -= len(chunk)
                if capture.room < 0:  # over the whole budget: never kept
                    capture, kept_all = None, []
            recent.append(chunk)
            kept += len(chunk)
            while kept - len(recent[0]) >= STREAM_TAIL:
                kept -= len(recent.popleft())
    except httpx.ReadTimeout:
        await _went_silent(turn, "its stream")  # the stream ends without [DONE]
        return
    except httpx.HTTPError as exc:
        # The model (or the peer) died mid-stream: no [DONE]; an event stream ends with an
        # error event (OpenAI's shape) so that a client tells a cut from a finished answer.
        why = f"{type(exc).__name__}: {exc}"
        turn.note(Outcome.FAILED, upstream.status_code, f"stream broken: {why}")
        turn.suspect = True
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            ended = not recent or recent[-1].endswith((b"\n\n", b"\r\n\r\n"))
            message = f"the model's stream broke off before it finished ({clip(why)})"
            event = b"data: " + error_body(502, message, "upstream_stream_broken") + b"\n\n"
            yield event if ended else b"\n\n" + event
        return
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if cancel.cancelled_by(turn.ticket.request_id) is None or task is None or task.uncancel():
            raise  # the client left: the handler ends the turn
        with contextlib.suppress(httpx.HTTPError):  # the model stops before the next turn
            await upstream.aclose()
        turn.dispatcher.cancel(turn.ticket)  # cancelled (web/cancel.py): ended as cut
        # The client is told why its stream stops (OpenAI's shape of an error event).
        by = cancel.cancelled_by(turn.ticket.request_id)
        message = f"request cancelled by {by} while it was being answered"
        yield (
            b"data: " + error_body(cancel.CANCELLED_STATUS, message, "request_cancelled") + b"\n\n"
        )
        return
    tail = b"".join(recent)[-STREAM_TAIL:]
    note_stream_usage(turn.ticket, tail, head)
    turn.note(Outcome.COMPLETED, upstream.status_code)
    if capture is not None:
        capture.keep(upstream, kept_all)
    await turn.close()
    await hand_over(turn)


def note_usage(ticket: Ticket, content: bytes) -> None:
    """Token counts and speeds from a whole JSON answer (up to 1 MB) into ``ticket.extra``
    (every API shape llama-swap reads: proxy/usage.py)."""
    if len(content) > 1 << 20:
        return
    try:
        data = json.loads(content)
    except (ValueError, RecursionError):
        return
    tally = Tally()
    tally.add(data)
    _keep(ticket, tally)


_USAGE_MARKS = (b'"usage"', b'"timings"', b'"metrics"')


def note_stream_usage(ticket: Ticket, tail: bytes, head: bytes = b"") -> None:
    """Token counts and speeds from a stream's events (proxy/usage.py): the last event of
    ``tail`` that gives any (servers send them last: llama-server, OpenAI, vLLM,
    Anthropic's ``message_delta``, ``response.completed``), read from the end; and, when
    it gives no input count, the events of ``head``, the stream's first piece, first
    (Anthropic's ``message_start`` holds it). A few lines are looked at, whatever the
    stream's length."""
    last, tally = _last_usage_event(tail)
    if head and "prompt_tokens" not in tally.usage and _USAGE_MARKS[0] in head:
        tally = Tally()
        for line in head.split(b"\n"):
            if line.startswith(b"data:") and _USAGE_MARKS[0] in line:
                with contextlib.suppress(ValueError, RecursionError):
                    tally.add(json.loads(line[5:]))
        if last is not None:
            tally.add(last)  # after: the last non-zero count wins
    _keep(ticket, tally)


def _last_usage_event(tail: bytes) -> tuple[Any, Tally]:
    """The last ``data:`` event of ``tail`` that holds counts or speeds (None: none), and
    what it says."""
    usage, timings, metrics = _USAGE_MARKS
    for line in reversed(tail.split(b"\n")):
        if line.startswith(b"data:") and (usage in line or timings in line or metrics in line):
            try:
                data = json.loads(line[5:])
            except (ValueError, RecursionError):
                continue  # cut at the tail's edge
            tally = Tally()
            tally.add(data)
            if tally.found:
                return data, tally
    return None, Tally()


def _keep(ticket: Ticket, tally: Tally) -> None:
    usage, timings = tally.result()
    if usage is not None:
        ticket.extra["usage"] = usage
    if timings is not None:
        ticket.extra["timings"] = timings
