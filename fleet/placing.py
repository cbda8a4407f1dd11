"""The request path's part of the fleet: place a request for a local model, once.

:func:`hop` runs in the proxy's view for a request for a local model, after its name is
resolved and before it is queued: it reads the fleet's view in memory (never Redis) and
asks :func:`scheduler.core.placement.place` where the request starts soonest. When that
is another node it returns a :class:`Hop`: a peer route to that node's base URL, which
the view forwards through the peer path (``proxy.peers.forward``: the request's
priority after its key's rule, the client's own key when this fleet requires keys), then
hands to :func:`sent` (the record names the local model, the node it went to and the
reason is sent back in ``X-LlamaSwap-Placement``).

A forwarded request carries ``X-LlamaSwap-Placed: <node> <token>``: the node that receives
it never places it again (nothing is placed twice), and when the token is that node's
(published with its view) it leaves the record (and the request's count in ``/metrics``) to the node the client
is talking to (``recorded_elsewhere`` in the ticket's extra: the recorder and the metrics
skip it): one record per request, with the outcome its client saw.

A node that went away before any byte of its answer arrived (connection refused or
reset, no response: :data:`NO_ANSWER`) is taken out of placement until it publishes again,
and the request is placed again (:func:`run`: another node, or here; at most
:data:`MAX_HOPS` nodes are tried): a killed node costs its clients nothing while their
requests wait there. Once any byte of an answer arrived the request is never run twice:
the client sees the error (a stream cut mid-way ends without ``[DONE]``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponseBase

from fleet.node import Fleet, current
from scheduler import runtime
from scheduler.config import ModelConfig
from scheduler.config.models import ModelTimeouts
from scheduler.config.peers import Peer, PeerModel
from scheduler.core.placement import Placement, place
from scheduler.core.priority import HEADER, parse_priority
from scheduler.names import Route

log = logging.getLogger("llamaswap.fleet")

PLACED_HEADER = "X-LlamaSwap-Placed"
PLACEMENT_HEADER = "X-LlamaSwap-Placement"
RECORDED_ELSEWHERE = "recorded_elsewhere"
"""The ticket's extra key (activity.recorder, activity.metrics skip it): the request's
record is another ticket's (the sending node's, or the local run after a failed hop)."""
NO_ANSWER = (
    "ConnectError:",
    "ConnectTimeout:",
    "RemoteProtocolError:",
    "ReadError:",
    "WriteError:",
)
"""Errors of a hop before any byte of its answer arrived (refused, reset, closed): the
request can be placed again. Not a timeout: a slow node may still be running it."""
MAX_HOPS = 3
"""Nodes a request is sent to at most (each one that went away is out of placement
until it publishes again) before it runs here."""
_PLACED = PLACED_HEADER.lower().encode("latin-1")
_PRIORITY_META = "HTTP_" + HEADER.upper().replace("-", "_")
HOP_CONNECT_TIMEOUT = 5.0


@dataclass(frozen=True)
class Hop:
    """A request placed on another node: the peer route to it and why."""

    route: Route
    placement: Placement

    @property
    def model(self) -> ModelConfig:
        """The local model the request names (its route carries it: :func:`hop`)."""
        assert self.route.model is not None
        return self.route.model


def _header(headers: Any, name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value)
    return None


def _credential(headers: Any) -> str | None:
    auth = _header(headers, b"authorization")
    if auth is not None and auth[:7].lower() == b"bearer ":
        return auth[7:].decode("latin-1").strip()
    key = _header(headers, b"x-api-key")
    return key.decode("latin-1").strip() if key is not None else None


def hop(request: HttpRequest, target: Route, extra: dict[str, Any]) -> Hop | None:
    """Where this request for a local model runs: None here, or the :class:`Hop` to the
    node that starts it sooner. Marks a request another node placed here (``extra``)."""
    fleet = current()
    model = target.model
    if fleet is None or model is None or target.peer is not None:
        return None
    scope = request.scope  # type: ignore[attr-defined]  # an ASGIRequest (the lean handler)
    headers = scope["headers"]
    placed = _header(headers, _PLACED)
    if placed is not None:  # placed once already: it runs here
        node, _, token = placed.decode("latin-1").partition(" ")
        if fleet.origin_ok(node, token):
            extra[RECORDED_ELSEWHERE] = node
        return None
    if request.method != "POST" or request.content_type != "application/json":
        return None  # multipart and GET requests stay here (their body is not rewritten)
    if model.use_model_name:
        return None  # the body names the upstream's model now: no other node would know it
    key = scope.get("llamaswap.api_key")
    header = request.META.get(_PRIORITY_META)
    priority = key.policy.grant(header)[0] if key is not None else parse_priority(header)
    placement = decide(fleet, model.id, priority)
    if not placement.forward:
        before = extra.get("placement")  # its record says why it stayed (the why-page)
        extra["placement"] = f"{before}; {placement.reason}" if before else placement.reason
        return None
    credential = ""
    if runtime.current().keys.enabled:
        credential = _credential(headers) or ""
        if not credential:  # a staff session: its cookie is this node's own
            return None
    view = fleet.view.views[placement.node]
    peer = Peer(
        id=placement.node,
        proxy=view.url,
        models=(target.name,),
        api_key=credential,
        timeouts=ModelTimeouts(
            connect=HOP_CONNECT_TIMEOUT, response_header=0, idle=model.timeouts.idle
        ),
    )
    scope["headers"] = [*headers, (_PLACED, f"{fleet.node} {fleet.token}".encode("latin-1"))]
    before = extra.get("placement")  # a node that went away before answering
    extra["placement"] = f"{before}; {placement.reason}" if before else placement.reason
    log.info(
        "placed on another node",
        extra={"model": model.id, "node": placement.node, "reason": placement.reason},
    )
    route = Route(target.requested, target.name, model=model, peer=PeerModel(peer, target.name))
    return Hop(route=route, placement=placement)


def decide(fleet: Fleet, model: str, priority: int) -> Placement:
    """:func:`place` on the fleet's view now; the request is counted against the node
    chosen until that node's next view. O(nodes), from memory."""
    views = fleet.view.views
    placement = place(
        model,
        priority,
        views.get(fleet.node),
        views,
        fleet.clock(),
        degraded=fleet.degraded(),
        pending=fleet.view.pending,
    )
    fleet.view.sent(placement.node or fleet.node)
    return placement


async def run(
    request: HttpRequest,
    target: Route,
    extra: dict[str, Any],
    forward: Callable[[Route, dict[str, Any]], Awaitable[HttpResponseBase]],
) -> HttpResponseBase | None:
    """Place the request and send it (``forward``: ``proxy.peers.forward``); placed again
    when that node went away before answering. None: it runs here (``extra`` says why,
    for its record)."""
    for _ in range(MAX_HOPS):
        placed = hop(request, target, extra)
        if placed is None:
            return None
        response = await sent(request, placed, forward(placed.route, extra), extra)
        if response is not None:
            return response
    extra["placement"] = f"{extra.get('placement', '')}; ran here after {MAX_HOPS} nodes"
    return None


async def sent(
    request: HttpRequest,
    hop: Hop,
    forwarding: Awaitable[HttpResponseBase],
    extra: dict[str, Any] | None = None,
) -> HttpResponseBase | None:
    """Await ``proxy.peers.forward`` (its ticket names the local model, not ``node/model``:
    the hop's route carries it), the client sees where its request went and why. None when the node
    went away before any byte of its answer (:data:`NO_ANSWER`): the hop's record is
    dropped, the node left out of placement until it publishes again, and the request is
    placed again (:func:`run`)."""
    response = await forwarding
    turn = getattr(request, "turn", None)
    ticket = getattr(turn, "ticket", None)
    if ticket is None:
        return response
    cause = _no_answer(response, hop.placement.node)
    if cause is not None:
        fleet = current()
        if fleet is not None:
            fleet.view.unreachable(hop.placement.node, fleet.clock())
        ticket.extra[RECORDED_ELSEWHERE] = "here"
        await turn.close()  # type: ignore[union-attr]  # a proxy.peers.PeerTurn
        scope = request.scope  # type: ignore[attr-defined]  # ours: placed again from scratch
        scope["headers"] = [h for h in scope["headers"] if h[0] != _PLACED]
        log.warning(
            "placed node went away before answering: placed again",
            extra={"node": hop.placement.node, "model": hop.model.id, "cause": cause},
        )
        if extra is not None:  # the record of its run (here, or on the next node) says so
            before = extra.get("placement") or hop.placement.reason  # the chain so far
            extra["placement"] = (
                f"{before}; {hop.placement.node} went away before answering ({cause}): placed again"
            )
        return None
    fleet = current()
    if fleet is not None:
        fleet.placed_on(hop.placement.node)
    reason = str(ticket.extra.get("placement") or hop.placement.reason)
    response[PLACEMENT_HEADER] = reason.encode("ascii", "replace").decode("ascii")
    return response


def _no_answer(response: HttpResponseBase, node: str) -> str | None:
    """The error's kind when ``response`` is the peer path's own 502 for a hop to ``node``
    that got no byte of an answer (:data:`NO_ANSWER`); None for anything the node sent."""
    if response.status_code != 502:
        return None
    content = getattr(response, "content", b"")
    try:
        error = json.loads(content)["error"]
        code, message = error["code"], error["message"]
    except (ValueError, KeyError, TypeError):
        return None
    lead = f"peer {node!r} did not answer: "
    if code != "peer_unavailable" or not isinstance(message, str):
        return None
    if not message.startswith(lead):
        return None
    cause = message[len(lead) :]
    return cause.partition(":")[0] if cause.startswith(NO_ANSWER) else None
