"""Requests for a peer's model (``peers`` in the config): forwarded at once, never queued.

A peer is a remote OpenAI-compatible server: another llama-swap, another llamaswap,
OpenRouter. Its requests take no local turn (the GPU here is not involved), so they go
straight out. What they carry:

* ``model`` rewritten to the peer's own name for it, then the peer's ``filters``;
* ``X-LlamaSwap-Priority`` set to the request's priority here (after the API key's rule),
  so a peer that is another llamaswap schedules it by the same rule;
* the peer's ``apiKey``, when set, as both ``Authorization: Bearer`` and ``x-api-key``
  (llama-swap's rule). The credential the client presented to *this* server is never
  passed on: without an ``apiKey`` the client's own ``Authorization``/``x-api-key`` go
  through only when this server requires no key (then they were not meant for it).

Timeouts are the peer's ``timeouts`` (llama-swap's peer defaults: ``responseHeader`` 60 s;
``connect`` 30 s). The request is recorded like a local one (``RequestRecord`` with
``peer`` set and ``policy`` ``peer``) through the dispatcher's observers, when it ends:
:class:`PeerTurn` is closed by the lean handler exactly as a local ``Turn`` is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
from django.http import HttpRequest, HttpResponseBase

from proxy.relay import (
    PRIORITY_META,
    STREAM_TAIL,
    WRITE_TIMEOUT,
    event_stream,
    note_stream_usage,
    note_usage,
    whole_answer,
)
from proxy.upstream import forward_headers
from scheduler import runtime
from scheduler.config import ModelConfig
from scheduler.core.priority import HEADER, parse_priority
from scheduler.dispatcher import Dispatcher, Outcome, Ticket, TicketState
from scheduler.keys import ApiKey
from scheduler.names import PeerModel, Route
from web.errors import error_response
from web.paths import upstream_path

log = logging.getLogger("llamaswap.proxy")

_in_flight: Counter[str] = Counter()
"""``peer/model`` -> requests being forwarded now (for ``spillover`` selectors)."""
_CREDENTIALS = frozenset({b"authorization", b"x-api-key"})
_PRIORITY = HEADER.lower().encode("latin-1")


def load(fqn: str) -> int:
    """Requests of a peer model (``peer/model``) in flight now."""
    return _in_flight.get(fqn, 0)


class PeerTurn:
    """A peer request's life here, closed once by the lean handler (as ``proxy.turn.Turn``
    is): closes the peer's response and records the request through the observers."""

    __slots__ = ("dispatcher", "ticket", "fqn", "upstream", "_noted", "_closed")

    def __init__(self, dispatcher: Dispatcher, ticket: Ticket, fqn: str) -> None:
        self.dispatcher = dispatcher
        self.ticket = ticket
        self.fqn = fqn
        self.upstream: httpx.Response | None = None
        self._noted: tuple[Outcome, int | None, str | None] | None = None
        self._closed = False
        _in_flight[fqn] += 1

    def note(self, outcome: Outcome, status: int | None = None, error: str | None = None) -> None:
        self._noted = (outcome, status, error)

    async def close(
        self,
        *,
        disconnected: bool = False,
        error: BaseException | None = None,
        status: int | None = None,
    ) -> None:
        if self._closed:
            return
        self._closed = True
        self._finish(disconnected, error, status)  # first: a cancelled close still records
        upstream = self.upstream
        if upstream is not None and not upstream.is_closed:
            try:
                await upstream.aclose()
            except Exception:
                log.warning("closing a peer response failed", exc_info=True)

    def _finish(self, disconnected: bool, error: BaseException | None, status: int | None) -> None:
        _in_flight[self.fqn] -= 1
        if _in_flight[self.fqn] <= 0:
            del _in_flight[self.fqn]
        ticket = self.ticket
        if self._noted is not None:
            ticket.outcome, ticket.status, ticket.error = self._noted
        elif disconnected or isinstance(error, asyncio.CancelledError):
            ticket.outcome = Outcome.CANCELLED_RUNNING
        elif error is not None:
            ticket.outcome, ticket.status = Outcome.FAILED, 500
            ticket.error = f"{type(error).__name__}: {error}"
        else:
            ticket.outcome, ticket.status, ticket.error = (
                Outcome.FAILED,
                status,
                "ended without an outcome",
            )
        ticket.state = TicketState.DONE
        ticket.finished_at = self.dispatcher.now()
        log.info(
            "peer request",
            extra={
                "request_id": ticket.request_id,
                "model": self.fqn,
                "peer": ticket.extra.get("peer", ""),
                "priority": ticket.priority,
                "outcome": ticket.outcome.value,
                "status": ticket.status,
                "ms": round((ticket.finished_at - ticket.arrival) * 1000.0, 1),
            },
        )
        for observer in list(getattr(self.dispatcher, "observers", ())):
            try:
                observer.on_finish(ticket)
            except Exception:
                log.exception("observer failed", extra={"observer": type(observer).__name__})


def _model_config(target: PeerModel) -> ModelConfig:
    """What the record and the observers see as the model: ``peer/model`` at the peer."""
    return ModelConfig(id=target.fqn, cmd=(), proxy=target.peer.proxy)


async def forward(
    request: HttpRequest,
    target: Route,
    request_id: str,
    body: bytes,
    extra: dict[str, Any],
) -> HttpResponseBase:
    """Send the request to the peer and relay its answer (JSON or SSE) as it comes."""
    assert target.peer is not None
    peer = target.peer.peer
    timeouts = peer.timeouts
    query = request.META.get("QUERY_STRING", "")
    try:
        path = upstream_path(request.path)  # /v/... without its prefix, as llama-swap
        url = httpx.URL(peer.proxy.rstrip("/") + path + (f"?{query}" if query else ""))
    except (httpx.InvalidURL, ValueError) as exc:
        return error_response(
            400, f"invalid path: {exc}", code="invalid_path", request_id=request_id
        )
    scope = request.scope  # type: ignore[attr-defined]  # an ASGIRequest (the lean handler)
    key: ApiKey | None = scope.get("llamaswap.api_key")
    header = request.META.get(PRIORITY_META)
    if key is None:
        priority, requested, key_name = parse_priority(header), None, ""
    else:
        priority, requested = key.policy.grant(header)
        key_name = key.name
    rt = runtime.current()
    drop = {_PRIORITY}
    if peer.api_key or rt.keys.enabled:
        drop |= _CREDENTIALS
    headers = [(k, v) for k, v in forward_headers(scope["headers"]) if k.lower() not in drop]
    headers.append((_PRIORITY, str(priority).encode("latin-1")))
    if peer.api_key:
        secret = peer.api_key.encode("latin-1")
        headers += [(b"authorization", b"Bearer " + secret), (b"x-api-key", secret)]

    dispatcher = rt.dispatcher
    now = dispatcher.now()
    ticket = Ticket(
        request_id=request_id,
        model=_model_config(target.peer),
        priority=priority,
        path=request.path,
        arrival=now,
        arrival_wall=time.time(),
        granted=asyncio.get_running_loop().create_future(),
    )
    ticket.api_key = key_name
    ticket.requested_priority = requested
    ticket.extra.update(extra, peer=peer.id)
    ticket.state = TicketState.RUNNING
    ticket.dispatched_at = ticket.ready_at = now  # sent at once: no queue, no load
    ticket.lane = ""  # on no lane (GPU) here
    turn = PeerTurn(dispatcher, ticket, target.peer.fqn)
    request.turn = turn  # type: ignore[attr-defined]  # the handler closes it, whatever happens

    client = rt.upstreams.client()
    outgoing = client.build_request(
        request.method or "POST",
        url,
        headers=headers,
        content=body,
        timeout=httpx.Timeout(
            connect=timeouts.connect or None,
            read=timeouts.idle or None,
            write=WRITE_TIMEOUT,
            pool=None,
        ),
    )
    body = b""
    try:
        if timeouts.response_header:
            async with asyncio.timeout(timeouts.response_header):
                upstream = await client.send(outgoing, stream=True)
        else:
            upstream = await client.send(outgoing, stream=True)
    except TimeoutError:
        message = (
            f"peer {peer.id!r} sent no response within {timeouts.response_header:g}s "
            "(timeouts.responseHeader)"
        )
        turn.note(Outcome.FAILED, 504, message)
        return error_response(504, message, code="upstream_timeout", request_id=request_id)
    except httpx.HTTPError as exc:
        cause = f"{type(exc).__name__}: {exc}"
        turn.note(Outcome.FAILED, 502, cause)
        return error_response(
            502,
            f"peer {peer.id!r} did not answer: {cause}",
            code="peer_unavailable",
            request_id=request_id,
        )
    turn.upstream = upstream
    status = upstream.status_code
    content_type = upstream.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        return event_stream(_stream(turn, upstream), upstream, request_id)
    try:
        content = b"".join([chunk async for chunk in upstream.aiter_raw()])
    except httpx.HTTPError as exc:
        cause = f"{type(exc).__name__}: {exc}"
        turn.note(Outcome.FAILED, 502, cause)
        return error_response(
            502,
            f"peer {peer.id!r} broke off its answer: {cause}",
            code="peer_unavailable",
            request_id=request_id,
        )
    if status < 300 and content_type.startswith("application/json"):
        note_usage(ticket, content)
    turn.note(Outcome.COMPLETED, status)
    return whole_answer(content, upstream, request_id)


async def _stream(turn: PeerTurn, upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The peer's bytes as they arrive; how the stream ended is noted for the record."""
    tail = b""
    yield b""  # the headers now
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
            tail = (
                (tail + chunk)[-STREAM_TAIL:] if len(chunk) < STREAM_TAIL else chunk[-STREAM_TAIL:]
            )
    except httpx.HTTPError as exc:
        turn.note(
            Outcome.FAILED, upstream.status_code, f"stream broken: {type(exc).__name__}: {exc}"
        )
        return
    note_stream_usage(turn.ticket, tail)
    turn.note(Outcome.COMPLETED, upstream.status_code)
    await turn.close()
