"""Progress for a streaming chat request while it waits: llama-swap's ``sendLoadingState``.

llama-swap streams "loading model ..." in ``reasoning_content`` while a model starts.
llamaswap does that, and beyond it tells a request that waits in the queue where it
stands: its place in its lane's line, its band and an estimated wait, updated as the
queue moves. Everything is sent as ordinary ``chat.completion.chunk`` events whose delta
carries only ``reasoning_content``, so an OpenAI client shows it as reasoning (or ignores
it) and never breaks; the answer follows in the same stream.

Only for ``stream: true`` requests to ``/v1/chat/completions`` of a model with
``sendLoadingState`` (its own or the global one), and only when the request is not
granted within :data:`PROGRESS_AFTER` (a free GPU answers as usual, headers and all). Once
the progress stream has started, the status is 200: an error that comes later (the model
failed to start, ``maxWait`` ran out, the model answered 4xx/5xx) is sent as an OpenAI
error event (``data: {"error": {...}}``), which the OpenAI SDKs raise as ``APIError``.

The positions come from one board shared by every waiting stream and refreshed at most
once per :data:`TICK` (:meth:`Dispatcher.waiting`, one pass over the queue), so a
thousand waiting streams cost one pass a second, not a thousand.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from django.http import HttpResponseBase, StreamingHttpResponse

from scheduler import runtime
from scheduler.config import ModelConfig
from scheduler.dispatcher import Ticket, TicketState
from web.errors import REQUEST_ID_HEADER

PROGRESS_AFTER = 0.25
"""Seconds a request may take to be granted before it gets a progress stream."""
TICK = 1.0
"""Seconds between two progress updates (and two refreshes of the shared board)."""
CHAT_PATH = "/v1/chat/completions"


def wanted(model: ModelConfig, path: str, data: Any) -> bool:
    """Does this request get progress while it waits?"""
    return (
        model.send_loading_state
        and path == CHAT_PATH
        and isinstance(data, dict)
        and data.get("stream") is True
    )


class _Board:
    """Where every waiting request stands, recomputed at most once per :data:`TICK`."""

    def __init__(self) -> None:
        self.at = float("-inf")
        self.where: dict[str, tuple[str, int, float]] = {}
        self.depth: dict[str, int] = {}

    def lookup(self, request_id: str) -> tuple[str, int, int, float] | None:
        now = time.monotonic()
        if now - self.at >= TICK:
            dispatcher = runtime.current().dispatcher
            self.where = dispatcher.waiting()
            self.depth = {name: len(dispatcher.queue.lane(name)) for name in dispatcher.queue.names}
            self.at = now
        found = self.where.get(request_id)
        if found is None:
            return None
        lane, position, eta = found
        return lane, position, self.depth.get(lane, position), eta


_board = _Board()


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def status_line(ticket: Ticket) -> str | None:
    """What a waiting request is told now (None: nothing to say)."""
    if ticket.state is TicketState.LOADING:
        return f"llamaswap: loading model {ticket.model.id}"
    if ticket.state is not TicketState.WAITING:
        return None
    found = _board.lookup(ticket.request_id)
    if found is None:
        return "llamaswap: waiting for the GPU"
    lane, position, depth, eta = found
    where = "" if lane == "default" else f" on {lane}"
    band = _band(ticket.priority)
    return (
        f"llamaswap: waiting{where}: #{position} of {depth} in line ({band}), "
        f"about {_duration(eta)}"
    )


def _band(priority: int) -> str:
    from scheduler.core.priority import band_of

    return band_of(priority).value


class _Events:
    """``chat.completion.chunk`` events carrying text in ``reasoning_content``."""

    def __init__(self, request_id: str, model: str) -> None:
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.first = True

    def text(self, text: str) -> bytes:
        delta: dict[str, Any] = {"reasoning_content": text}
        if self.first:
            delta = {"role": "assistant", **delta}
            self.first = False
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def error_event(status: int, content: bytes) -> bytes:
    """An answer that is no stream, sent into a stream already started: an OpenAI error
    event when it is an error (its own ``error`` object when it has one)."""
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        error = {
            "message": content.decode(errors="replace")[:2000],
            "type": "upstream_error",
            "code": status,
        }
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


async def maybe(
    ticket: Ticket,
    model: ModelConfig,
    request_id: str,
    answer: Callable[[], Awaitable[HttpResponseBase]],
) -> HttpResponseBase | None:
    """None when the request was granted (or refused) within :data:`PROGRESS_AFTER`: the
    caller answers as usual. Otherwise a 200 event stream: progress until the turn comes,
    then ``answer()``'s response, streamed on."""
    granted = ticket.granted
    if not granted.done():
        await asyncio.wait({granted}, timeout=PROGRESS_AFTER)
    if granted.done():
        return None
    response = StreamingHttpResponse(_stream(ticket, model, request_id, answer), status=200)
    response["Content-Type"] = "text/event-stream"
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    response[REQUEST_ID_HEADER] = request_id
    return response


async def _stream(
    ticket: Ticket,
    model: ModelConfig,
    request_id: str,
    answer: Callable[[], Awaitable[HttpResponseBase]],
) -> AsyncIterator[bytes]:
    events = _Events(request_id, model.id)
    said: str | None = None
    loading_since: float | None = None
    while not ticket.granted.done():
        line = status_line(ticket)
        if ticket.state is TicketState.LOADING and loading_since is None:
            loading_since = time.monotonic()
        if line is not None and line != said:
            yield events.text(("\n" if said else "") + line + " ")
            said = line
        elif loading_since is not None:
            yield events.text(".")  # llama-swap's heartbeat while a model loads
        await asyncio.wait({ticket.granted}, timeout=TICK)
    granted = ticket.granted
    if loading_since is not None and not granted.cancelled() and granted.exception() is None:
        yield events.text(f"\nDone! ({time.monotonic() - loading_since:.1f}s)\n\n")
    elif said is not None:
        yield events.text("\n\n")
    response = await answer()
    if isinstance(response, StreamingHttpResponse):
        if response.status_code < 400 and response.get("Content-Type", "").startswith(
            "text/event-stream"
        ):
            async for chunk in response.streaming_content:  # type: ignore[union-attr,unused-ignore]
                yield chunk
            return
        content = b"".join([c async for c in response.streaming_content])  # type: ignore[union-attr,unused-ignore]
    else:
        content = response.content  # type: ignore[attr-defined]  # an HttpResponse
    if response.status_code >= 400:
        yield error_event(response.status_code, content)
    else:  # a model that ignored "stream": its answer as one event
        yield b"data: " + content + b"\n\n"
    yield b"data: [DONE]\n\n"
