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
``connect`` 30 s). The request lives as a local one does: a ``proxy.turn.Turn`` on a ticket
issued by ``runtime.unqueued`` (granted at once, on no lane: ``scheduler.tickets.Unqueued``)
instead of the dispatcher's queue, closed by the lean handler whatever happens, its answer
relayed by the relay's own code (``proxy.relay.relay_answer``), its end told once to the
dispatcher's observers (a ``RequestRecord`` with ``peer`` set and ``policy`` ``peer``),
cancelled by ``POST /api/inflight/{id}/cancel`` as a local one is (``web/cancel.py``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from django.http import HttpRequest, HttpResponseBase

from proxy.relay import PRIORITY_META, WRITE_TIMEOUT, relay_answer
from proxy.turn import Turn
from proxy.upstream import forward_headers
from scheduler import runtime
from scheduler.config import ModelConfig, Peer
from scheduler.core.priority import HEADER, parse_priority
from scheduler.dispatcher import Outcome
from scheduler.keys import ApiKey
from scheduler.names import PeerModel, Route
from web import cancel
from web.errors import error_response
from web.paths import upstream_path
from web.runtime import runtime_of

log = logging.getLogger("llamaswap.proxy")

_CREDENTIALS = frozenset({b"authorization", b"x-api-key"})
_PRIORITY = HEADER.lower().encode("latin-1")


def load(fqn: str) -> int:
    """Requests of a peer model (``peer/model``) in flight now."""
    return runtime.current().unqueued.load(fqn)


def _model_config(target: PeerModel) -> ModelConfig:
    """What the record and the observers see as the model: ``peer/model`` at the peer."""
    return ModelConfig(
        id=target.fqn,
        cmd=(),
        proxy=target.peer.proxy,
        timeouts=target.peer.timeouts,  # what the relay's messages name (timeouts.idle)
        check_endpoint=None,  # a peer's health is not this box's to probe
    )


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
    rt = runtime_of(request)
    drop = {_PRIORITY}
    if peer.api_key or rt.keys.enabled:
        drop |= _CREDENTIALS
    headers = [(k, v) for k, v in forward_headers(scope["headers"]) if k.lower() not in drop]
    headers.append((_PRIORITY, str(priority).encode("latin-1")))
    if peer.api_key:
        secret = peer.api_key.encode("latin-1")
        headers += [(b"authorization", b"Bearer " + secret), (b"x-api-key", secret)]

    turn = Turn(
        rt.unqueued,
        _model_config(target.peer),
        priority,
        request_id,
        request.path,
        api_key=key_name,
        requested_priority=requested,
    )
    if target.model is not None:  # placed by this node's fleet: recorded as the local model
        turn.ticket.model = target.model
    turn.ticket.extra.update(extra, peer=peer.id)
    request.turn = turn  # type: ignore[attr-defined]  # the handler closes it, whatever happens
    cancel.track(turn.ticket)  # POST /api/inflight/{id}/cancel, as for a local request
    try:
        client = rt.upstreams.client()
        return await _exchange(client, turn, peer, url, request.method or "POST", headers, body)
    except asyncio.CancelledError:
        answer = cancel.cancelled_answer(turn.ticket, rt.unqueued.cancel)
        if answer is None:
            raise  # the client left: the handler ends the turn
        return answer


async def _exchange(
    client: httpx.AsyncClient,
    turn: Turn,
    peer: Peer,
    url: httpx.URL,
    method: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
) -> HttpResponseBase:
    """The request sent to ``peer`` and its answer relayed (or the error that stood in)."""
    timeouts = peer.timeouts
    request_id = turn.ticket.request_id
    outgoing = client.build_request(
        method,
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
    return await relay_answer(turn, upstream, request_id)
