"""``GET /api/events``: llama-swap's web-UI event stream (Server-Sent Events).

Each message is ``event:message`` with ``data:`` an envelope ``{"type", "data"}`` whose
``data`` is itself a JSON text, as llama-swap sends it. Types (llama-swap's names and
payload keys):

* ``modelStatus``: every configured model ``{id, name, description, state, unlisted,
  peerID, aliases?, capabilities?, context_length?}`` (sorted by id), then each peer model;
  sent on connect and whenever a model's state changes (coalesced: one per loop turn);
* ``logData``: ``{source: "proxy"|"upstream", data}``: the history on connect, then
  each new line of llamaswap's own log and of the models' output;
* ``inflight``: ``{operation: "snapshot", requests: [...]}`` on connect, then
  ``{operation: "upsert", request}`` when a request arrives or is granted and
  ``{operation: "remove", id}`` when it ends; ``id`` is the request's id
  (``X-LlamaSwap-Request-Id``, what ``POST /api/inflight/{id}/cancel`` takes);
* ``uiConfig``: ``{activity: {session_id: [...]}}`` (llama-swap's default);
* ``profileChanged``: ``{active: name|null}``, on connect and when it changes.

Not sent: ``activity`` (a new activity row's id: rows are written in batches, after the
answer; the UI's table reads ``/api/metrics/activity``).

Bounds: each subscriber has a queue of :data:`QUEUE_SIZE` messages, filled by the
dispatcher's callbacks (:class:`EventHub`, an observer: nothing is built while nobody
listens); a subscriber whose queue is full is dropped (its stream ends; the browser's
EventSource reconnects and gets a fresh snapshot), as llama-swap drops messages. At most
:data:`MAX_SUBSCRIBERS` streams at once (503 beyond). An idle stream gets an SSE comment
every :data:`KEEPALIVE` seconds, so proxies do not cut it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from proxy.views import render_capabilities
from scheduler import proxylog
from scheduler.dispatcher import Dispatcher, Ticket, TicketState
from scheduler.process import ModelState
from scheduler.runtime import Runtime
from web.errors import error_response
from web.runtime import runtime_of

log = logging.getLogger("llamaswap.proxy")

QUEUE_SIZE = 1024
MAX_SUBSCRIBERS = 64
KEEPALIVE = 15.0
TICK = 1.0
"""How often an idle stream looks for a profile switch or a reload."""
SNAPSHOT_WAITING = 1000
"""Most waiting requests a snapshot lists (the oldest; each arrival after is an upsert)."""
UI_CONFIG = {"activity": {"session_id": ["X-Session-ID", "X-Litellm-Session-Id"]}}


def frame(kind: str, data: Any) -> bytes:
    """One message, framed as llama-swap frames it (no space after the colons)."""
    envelope = {"type": kind, "data": json.dumps(data, separators=(",", ":"))}
    return b"event:message\ndata:" + json.dumps(envelope, separators=(",", ":")).encode() + b"\n\n"


class Subscriber:
    __slots__ = ("queue", "dropped", "runtime")

    def __init__(self, runtime: Runtime) -> None:
        self.queue: asyncio.Queue[bytes] = asyncio.Queue(QUEUE_SIZE)
        self.dropped = False
        self.runtime = runtime
        """The server whose stream this is (its models are the ``modelStatus``)."""


class EventHub:
    """The dispatcher's observer that feeds every ``/api/events`` subscriber."""

    def __init__(self) -> None:
        self.subscribers: set[Subscriber] = set()
        self._models_pending = False

    # -- subscribers ----------------------------------------------------------------------

    def subscribe(self, runtime: Runtime) -> Subscriber | None:
        if len(self.subscribers) >= MAX_SUBSCRIBERS:
            return None
        subscriber = Subscriber(runtime)
        self.subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)

    def publish(self, message: bytes) -> None:
        for subscriber in tuple(self.subscribers):
            offer(subscriber, message)

    # -- the dispatcher's callbacks (its task: cheap, nothing while nobody listens) ---------

    def on_enqueue(self, ticket: Ticket) -> None:
        if self.subscribers:
            self.publish(frame("inflight", {"operation": "upsert", "request": entry(ticket)}))

    def on_dispatch(self, ticket: Ticket) -> None:
        self.on_enqueue(ticket)

    def on_finish(self, ticket: Ticket) -> None:
        if self.subscribers:
            self.publish(frame("inflight", {"operation": "remove", "id": ticket.request_id}))

    def on_model_state(self, model: str, state: ModelState) -> None:
        if self.subscribers and not self._models_pending:
            self._models_pending = True  # one modelStatus for every change of this turn
            asyncio.get_running_loop().call_soon(self._send_models)

    def on_settings(self, settings: object, source: str) -> None:
        pass

    def _send_models(self) -> None:
        """Each subscriber its server's ``modelStatus`` (built once per server: one, but
        for tests running several in turn)."""
        self._models_pending = False
        built: dict[int, bytes] = {}
        for subscriber in tuple(self.subscribers):
            message = built.get(id(subscriber.runtime))
            if message is None:
                message = frame("modelStatus", model_status(subscriber.runtime))
                built[id(subscriber.runtime)] = message
            offer(subscriber, message)


def offer(subscriber: Subscriber, message: bytes) -> None:
    if subscriber.dropped:
        return
    try:
        subscriber.queue.put_nowait(message)
    except asyncio.QueueFull:
        subscriber.dropped = True  # its stream ends; EventSource reconnects, snapshot anew
        log.warning("/api/events subscriber too slow: dropped")


_hub: EventHub | None = None


def hub() -> EventHub:
    """The process's hub (one observer of the dispatcher, see llamaswap_site/observers.py)."""
    global _hub
    if _hub is None:
        _hub = EventHub()
    return _hub


# -- payloads ------------------------------------------------------------------------------


def model_status(rt: Runtime) -> list[dict[str, Any]]:
    states = rt.dispatcher.model_states()
    models: list[dict[str, Any]] = []
    for model_id in sorted(rt.config.models):
        model = rt.config.models[model_id]
        record: dict[str, Any] = {
            "id": model_id,
            "name": model.name,
            "description": model.description,
            "state": states.get(model_id, ModelState.STOPPED).value,
            "unlisted": model.unlisted,
            "peerID": "",
        }
        if model.aliases:
            record["aliases"] = list(model.aliases)
        caps = render_capabilities(model.capabilities)
        if caps.get("capabilities"):
            record["capabilities"] = caps["capabilities"]
        if caps.get("context_length"):
            record["context_length"] = caps["context_length"]
        models.append(record)
    for peer_id, peer in rt.config.peers.items():
        for model_id in getattr(peer, "models", ()):
            models.append(
                {
                    "id": f"{peer_id}/{model_id}",
                    "name": "",
                    "description": "",
                    "state": "",
                    "unlisted": False,
                    "peerID": peer_id,
                }
            )
    return models


def entry(ticket: Ticket, now: float | None = None) -> dict[str, Any]:
    """An in-flight request as llama-swap's UI lists it (what this server knows of it)."""
    elapsed = (now if now is not None else time.time()) - ticket.arrival_wall
    return {
        "id": ticket.request_id,
        "timestamp": datetime.fromtimestamp(ticket.arrival_wall, UTC).isoformat(),
        "model": ticket.model.id,
        "req_path": ticket.path,
        "method": str(ticket.extra.get("method") or "POST"),
        "req_headers": {},
        "remote_ip": "",
        "resp_headers": {},
        "resp_bytes": 0,
        "elapsed_ms": max(0, int(elapsed * 1000)),
        "metadata": {
            "state": ticket.state.value,
            "priority": str(ticket.priority),
            "lane": ticket.lane,
        },
    }


def inflight_snapshot(dispatcher: Dispatcher) -> dict[str, Any]:
    now = time.time()
    running = [t for t in dispatcher.in_flight() if t.state is not TicketState.DONE]
    waiting = itertools.islice(dispatcher.queue_views()[0].values(), SNAPSHOT_WAITING)
    requests = [entry(t, now) for t in [*running, *waiting]]
    # As llama-swap's (Go's omitempty): no "requests" key when there are none.
    return (
        {"operation": "snapshot", "requests": requests} if requests else {"operation": "snapshot"}
    )


def profile(rt: Runtime) -> dict[str, Any]:
    return {"active": rt.profile or None}


# -- the view ------------------------------------------------------------------------------


async def events(request: HttpRequest) -> HttpResponseBase:
    """GET /api/events: the stream (see the module's doc)."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if request.method == "HEAD":
        return HttpResponse(content_type="text/event-stream", headers=headers)
    the_hub = hub()
    rt = runtime_of(request)
    subscriber = the_hub.subscribe(rt)
    if subscriber is None:
        return error_response(
            503,
            f"too many /api/events streams (at most {MAX_SUBSCRIBERS})",
            code="too_many_streams",
        )
    response = StreamingHttpResponse(
        _stream(the_hub, subscriber), content_type="text/event-stream", headers=headers
    )
    return response


async def _stream(the_hub: EventHub, subscriber: Subscriber) -> AsyncIterator[bytes]:
    rt = subscriber.runtime
    pumps: list[asyncio.Task[None]] = []
    try:
        first = [
            frame(
                "logData",
                {"source": "proxy", "data": proxylog.proxy_log.history().decode(errors="replace")},
            ),
            frame(
                "logData",
                {
                    "source": "upstream",
                    "data": rt.dispatcher.logs.history().decode(errors="replace"),
                },
            ),
            frame("modelStatus", model_status(rt)),
            frame("uiConfig", UI_CONFIG),
            frame("profileChanged", profile(rt)),
            frame("inflight", inflight_snapshot(rt.dispatcher)),
        ]
        yield b"".join(first)
        for source, buffer in (("proxy", proxylog.proxy_log), ("upstream", rt.dispatcher.logs)):
            pumps.append(asyncio.create_task(_pump(subscriber, source, buffer)))
        seen = (rt.profile, rt.config)
        idle = 0.0
        while not subscriber.dropped:
            try:
                message = await asyncio.wait_for(subscriber.queue.get(), TICK)
            except TimeoutError:
                idle += TICK
                now = (rt.profile, rt.config)
                if now != seen:  # a profile switch or a reload
                    seen = now
                    yield frame("profileChanged", profile(rt)) + frame(
                        "modelStatus", model_status(rt)
                    )
                    idle = 0.0
                elif idle >= KEEPALIVE:
                    idle = 0.0
                    yield b": keepalive\n\n"
                continue
            idle = 0.0
            batch = [message]
            while not subscriber.queue.empty() and len(batch) < 64:
                batch.append(subscriber.queue.get_nowait())
            yield b"".join(batch)
    finally:
        the_hub.unsubscribe(subscriber)
        for pump in pumps:
            pump.cancel()


async def _pump(subscriber: Subscriber, source: str, buffer: Any) -> None:
    """One log's new lines into the subscriber's queue (the subscription is this task's)."""
    subscription = buffer.subscribe()
    try:
        async for line in subscription:
            offer(
                subscriber,
                frame("logData", {"source": source, "data": line.decode(errors="replace")}),
            )
    finally:
        buffer.unsubscribe(subscription)
