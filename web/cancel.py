"""Cancelling a request that waits for its turn or is being answered: the one place that does it.

``POST /api/inflight/{id}/cancel`` (llama-swap's route) and the dashboard's Cancel button
both call :func:`cancel_request`. A scheduled request is tracked from the moment it takes
its turn (:func:`track`, called by ``proxy.relay``) until its task ends, so the table holds
only requests that are alive: it is bounded by the requests the server holds anyway.

Cancelling cancels the request's task, as a client's disconnect does, so its turn ends
through the one path every request ends by (``proxy.turn.Turn``), as "cancelled":

* waiting (or its model loading, or its request on the way to the model): the client gets
  ``499 request_cancelled`` (OpenAI-shaped JSON, a status no client library retries);
* being answered: the answer stops (a stream ends without ``[DONE]``).

Requests forwarded to a peer (``proxy.peers``) are tracked and cancelled the same way:
their turn is on ``runtime.unqueued`` (``scheduler.tickets.Unqueued``) instead of the
dispatcher's queue, always "running" (they are sent at once), and the peer sees the
connection close as it would for a client that left.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections.abc import Callable
from typing import Any

from django.http import HttpResponse, JsonResponse

from scheduler.dispatcher import Ticket, TicketState
from web.errors import echo, error_response

log = logging.getLogger("llamaswap.proxy")

CANCELLED_STATUS = 499
"""The status a cancelled request that was not yet answered gets (nginx's "closed
request"): a 4xx, so OpenAI's client libraries do not send it again."""


class CancelOutcome(enum.Enum):
    """What :func:`cancel_request` did."""

    NOT_FOUND = "not_found"
    """No such request in flight (never was, or already over)."""
    CANCELLED_WAITING = "cancelled_waiting"
    """It had not been granted its turn: it leaves the queue."""
    CANCELLED_RUNNING = "cancelled_running"
    """Its model was loading for it or answering it: that stops."""


class _Entry:
    __slots__ = ("ticket", "task", "by")

    def __init__(self, ticket: Ticket, task: asyncio.Task[Any]) -> None:
        self.ticket = ticket
        self.task = task
        self.by: str | None = None


_live: dict[str, _Entry] = {}
"""request id -> the request's ticket and task, while its task runs."""


def track(ticket: Ticket) -> None:
    """Make the current task's request cancellable by its id (until the task ends)."""
    task = asyncio.current_task()
    if task is None:
        return
    request_id = ticket.request_id
    _live[request_id] = _Entry(ticket, task)
    task.add_done_callback(functools.partial(_forget, request_id))


def _forget(request_id: str, task: asyncio.Task[Any]) -> None:
    entry = _live.get(request_id)
    if entry is not None and entry.task is task:
        del _live[request_id]


def cancel_request(request_id: str, by: str = "api") -> CancelOutcome:
    """Cancel the request ``request_id`` (waiting or being answered); ``by`` says who, for
    the log. Idempotent: a second call finds it being cancelled and says the same. Call it
    on the server's event loop (an async view); a sync view's thread may not cancel a task.
    """
    entry = _live.get(request_id)
    if entry is None or entry.task.done():
        return CancelOutcome.NOT_FOUND
    state = entry.ticket.state
    if entry.ticket.outcome is not None and entry.by is None:
        return CancelOutcome.NOT_FOUND  # over: its answer is being sent
    outcome = (
        CancelOutcome.CANCELLED_WAITING
        if state is TicketState.WAITING
        else CancelOutcome.CANCELLED_RUNNING
    )
    if entry.by is None:
        entry.by = by
        entry.ticket.extra["cancelled_by"] = by
        log.info(
            "request cancelled",
            extra={"request_id": request_id, "model": entry.ticket.model.id, "by": by},
        )
        entry.task.cancel(f"cancelled by {by}")
    return outcome


def cancel_answer(request_id: str, by: str) -> tuple[HttpResponse, str | None]:
    """:func:`cancel_request`, answered as both cancel routes answer: ``{"msg": "ok", "was":
    "waiting" | "running"}`` and what it was, or ``404 request_not_found`` and None."""
    outcome = cancel_request(request_id, by=by)
    if outcome is CancelOutcome.NOT_FOUND:
        message = f"request {echo(request_id)} is not in flight (it ended, or never was)"
        return error_response(404, message, code="request_not_found"), None
    was = "waiting" if outcome is CancelOutcome.CANCELLED_WAITING else "running"
    return JsonResponse({"msg": "ok", "was": was}), was


def cancelled_answer(ticket: Ticket, end: Callable[[Ticket], None]) -> HttpResponse | None:
    """Called where the current task's cancellation is caught, before the request was
    answered: the ``499 request_cancelled`` its client gets when :func:`cancel_request`
    cancelled it (the task's cancellation taken back, ``ticket`` ended by ``end``: its
    dispatcher's ``cancel``); None when someone else did (the client left, the server gives
    up): re-raise then."""
    by = cancelled_by(ticket.request_id)
    task = asyncio.current_task()
    if by is None or task is None or task.uncancel() > 0:
        return None
    end(ticket)
    return error_response(
        CANCELLED_STATUS,
        f"request cancelled by {by} before it was answered",
        code="request_cancelled",
        request_id=ticket.request_id,
    )


def cancelled_by(request_id: str) -> str | None:
    """Who cancelled ``request_id`` (None: nobody; a disconnect, say)."""
    entry = _live.get(request_id)
    return entry.by if entry is not None else None


def live_ids() -> list[str]:
    """The ids of the requests that can be cancelled now (for tests and snapshots)."""
    return list(_live)


def key_of(request_id: str) -> str | None:
    """The name of the API key ``request_id`` came with ("" none) while it can be
    cancelled; None when it cannot (not in flight)."""
    entry = _live.get(request_id)
    return entry.ticket.api_key if entry is not None else None
