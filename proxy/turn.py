"""A proxied request's turn on the GPU, as one owned unit.

The serial scheduler hands the GPU to one request at a time, so the one thing it must never
lose is the end of a turn. :class:`Turn` is that end: created when a view puts its request in
line, ended exactly once by :meth:`Turn.close`, which the lean handler
(``proxy.handler.ProxyHandler``) awaits in a ``finally`` around the whole life of
every proxied request: the view, the response it returns, and every byte of a stream. So
no exception, cancellation, disconnect or early return can leave a turn open, and views
never end turns themselves; they only :meth:`~Turn.note` what happened, so the record shows
the right outcome.

Closing first closes the upstream response (if any: the connection to the model is
released before the next request is granted), then ends the ticket with:

1. the outcome the view noted, if any (answered, failed upstream, timed out);
2. else "cancelled" when the client disconnected (or the request was cancelled);
3. else "failed" (500) for an exception the view did not handle;
4. else "failed", logged as an error: the view returned without saying how it ended.

The dispatcher keeps a backstop (``owner=`` in :meth:`Dispatcher.submit`): a Turn collected
while its ticket is open ends the ticket and logs an error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

import httpx

from scheduler.config import ModelConfig
from scheduler.dispatcher import Outcome, Ticket
from scheduler.tickets import Issuer

log = logging.getLogger("llamaswap.proxy")

RECORD_EXTRA: ContextVar[Mapping[str, Any] | None] = ContextVar(
    "llamaswap_record_extra", default=None
)
"""Facts about the request its view knows before the turn is taken (the name the client
asked for, when a selector or profile resolved it to another model), copied into the
ticket's ``extra`` for its record. Set by the view in the request's own task (the lean
handler runs each request in one), so it never leaks into another request."""


class Turn:
    """One request's claim on the GPU, from :meth:`Dispatcher.submit` to :meth:`close`."""

    __slots__ = (
        "dispatcher",
        "ticket",
        "upstream",
        "unhealthy",
        "suspect",
        "_noted",
        "_closing",
        "__weakref__",
    )

    def __init__(
        self,
        dispatcher: Issuer,
        model: ModelConfig,
        priority: int,
        request_id: str,
        path: str,
        *,
        api_key: str = "",
        requested_priority: int | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.ticket: Ticket = dispatcher.submit(model, priority, request_id, path, owner=self)
        # Set before the dispatcher task sees the arrival, so every observer has them.
        self.ticket.api_key = api_key
        self.ticket.requested_priority = requested_priority
        extra = RECORD_EXTRA.get()
        if extra:
            self.ticket.extra.update(extra)
        self.upstream: httpx.Response | None = None
        """The model's response while it is being relayed; closed by :meth:`close`."""
        self.suspect = False
        """The model broke off its answer: let the dispatcher check it died before the next
        request goes to it."""
        self.unhealthy = False
        """The model stopped answering and failed its health check: stop it once the turn
        has ended (it may not be stopped under a request it is still serving)."""
        self._noted: tuple[Outcome, int | None, str | None] | None = None
        self._closing: asyncio.Task[None] | None = None

    async def wait(self) -> str:
        """The upstream base URL once it is this request's turn (see ``Ticket.wait``)."""
        return await self.ticket.wait()

    def note(self, outcome: Outcome, status: int | None = None, error: str | None = None) -> None:
        """How the request ended, as the view saw it; the last note wins."""
        self._noted = (outcome, status, error)

    @property
    def ended(self) -> bool:
        return self.ticket.outcome is not None

    async def close(
        self,
        *,
        disconnected: bool = False,
        error: BaseException | None = None,
        status: int | None = None,
    ) -> None:
        """Release the upstream response and end the turn. Idempotent; safe to cancel (the
        closing runs in a task of its own and ends the turn whatever happens)."""
        if self._closing is None:
            upstream = self.upstream
            if upstream is None or upstream.is_closed:
                self._end(disconnected, error, status)  # nothing to await: the common fast path
                return
            self._closing = asyncio.get_running_loop().create_task(
                self._close(upstream, disconnected, error, status), name="close-turn"
            )
        await asyncio.shield(self._closing)

    async def _close(
        self,
        upstream: httpx.Response,
        disconnected: bool,
        error: BaseException | None,
        status: int | None,
    ) -> None:
        try:
            await upstream.aclose()
        except Exception:
            log.warning(
                "closing the upstream response failed",
                exc_info=True,
                extra={"request_id": self.ticket.request_id},
            )
        finally:
            self._end(disconnected, error, status)

    def _end(self, disconnected: bool, error: BaseException | None, status: int | None) -> None:
        ticket = self.ticket
        if ticket.outcome is not None:
            return  # the dispatcher ended it (refused, failed start) or it was closed
        dispatcher = self.dispatcher
        if self._noted is not None:
            dispatcher.finish(ticket, *self._noted)
            if self.unhealthy:
                dispatcher.unhealthy(ticket)
            elif self.suspect:
                dispatcher.suspect(ticket)
        elif disconnected or isinstance(error, asyncio.CancelledError):
            dispatcher.cancel(ticket)
        elif error is not None:
            log.error(
                "request failed: %s: %s",
                type(error).__name__,
                error,
                exc_info=error,
                extra={"request_id": ticket.request_id, "model": ticket.model.id},
            )
            dispatcher.finish(ticket, Outcome.FAILED, 500, f"{type(error).__name__}: {error}")
        else:
            log.error(
                "request ended without an outcome",
                extra={"request_id": ticket.request_id, "model": ticket.model.id, "status": status},
            )
            dispatcher.finish(ticket, Outcome.FAILED, status, "ended without an outcome")
