"""A request's passage through the dispatcher, as the views and observers see it.

:class:`Ticket` (one request's turn), its :class:`TicketState` and :class:`Outcome`, the
:class:`Refused` answers (:class:`Overloaded`, :class:`QueueFull`, :class:`WaitExpired`,
:class:`ShuttingDown`), the :class:`Observer` protocol, and what :meth:`Dispatcher.reload`
and :meth:`Dispatcher.lanes` report. :mod:`scheduler.dispatcher` re-exports them all.

Who issues a ticket and is told how it ended (:class:`Issuer`): the dispatcher, for a
local model's request; :class:`Unqueued`, for a request that takes no turn here (a
peer's model). Both are ended the same way, by ``proxy.turn.Turn``.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.config import ModelConfig
from scheduler.core.admission import Refusal
from scheduler.core.lanes import DEFAULT_LANE
from scheduler.core.policy import Decision, SchedulerSettings
from scheduler.process import ModelState

log = logging.getLogger("llamaswap.dispatcher")


class Refused(Exception):
    """A request the dispatcher will not serve. ``status`` and ``code`` say how to answer it;
    ``retry_after`` (seconds) is the estimated time until the queue has room again."""

    status = 503
    code = "unavailable"

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Overloaded(Refused):
    """fifo: the ready model already serves ``concurrencyLimit`` requests (HTTP 429)."""

    status = 429
    code = "too_many_requests"


class QueueFull(Refused):
    """``maxQueueDepth`` requests are already waiting (HTTP 429)."""

    status = 429
    code = "queue_full"


class WaitExpired(Refused):
    """The request waited longer than its band's ``maxWait`` (HTTP 503)."""

    status = 503
    code = "queue_wait_exceeded"


class ShuttingDown(Refused):
    """The server is stopping and takes no more work (HTTP 503)."""

    code = "shutting_down"


class Outcome(enum.Enum):
    """How a request's turn ended."""

    COMPLETED = "completed"
    """The upstream answered (any status) and the answer was relayed."""
    FAILED = "failed"
    """The model did not start, the upstream could not be reached, or the stream broke."""
    CANCELLED_WAITING = "cancelled_waiting"
    """The client left while the request waited; it was never dispatched."""
    CANCELLED_RUNNING = "cancelled_running"
    """The client left while its request was being served."""
    REJECTED = "rejected"
    """Refused without waiting (fifo concurrency limit, shutdown)."""
    QUEUE_FULL = "queue_full"
    """Refused on arrival: ``maxQueueDepth`` requests were already waiting."""
    EXPIRED = "expired"
    """Waited longer than its band's ``maxWait``; never dispatched."""


class TicketState(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    """In the queue."""
    LOADING = "loading"
    """Picked; its model is being started."""
    RUNNING = "running"
    """Granted; the view is talking to the upstream."""
    DONE = "done"
    """Finished, failed or cancelled."""


@dataclass(eq=False)
class Ticket:
    """One inference request's passage through the dispatcher."""

    request_id: str
    model: ModelConfig
    priority: int
    path: str
    arrival: float
    """Monotonic seconds."""
    arrival_wall: float
    """Unix seconds, for records."""
    granted: asyncio.Future[str] = field(repr=False)
    state: TicketState = TicketState.WAITING
    decision: Decision | None = None
    dispatched_at: float | None = None
    ready_at: float | None = None
    finished_at: float | None = None
    swapped: bool = False
    load_seconds: float | None = None
    outcome: Outcome | None = None
    status: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Facts the proxy learns while relaying (usage, timings), for records."""
    guard: weakref.ref[Any] | None = field(default=None, repr=False)
    """A weak reference to its owner whose callback ends the ticket should the owner be
    collected first (see :meth:`Dispatcher.submit`); dropped (``None``) once it ends."""
    api_key: str = ""
    """The name of the API key it came with (never the key); empty without keys."""
    requested_priority: int | None = None
    """What the caller asked for, when its key's ceiling cut it to ``priority``."""
    generation: int = 0
    """Which start of its model it was granted to (see :meth:`Dispatcher.resend`)."""
    resent: bool = False
    """It was granted once more after its model turned out dead at grant."""
    lane: str = DEFAULT_LANE
    """The lane (GPU) its model is on."""
    _waiter: asyncio.Future[str] | None = field(default=None, repr=False)
    """What the latest :meth:`wait` in progress awaits (see :meth:`pass_on`)."""

    async def wait(self) -> str:
        """Wait for this request's turn; returns the upstream base URL.

        Raises :class:`ModelStartError` or a :class:`Refused` (:class:`Overloaded`,
        :class:`QueueFull`, :class:`WaitExpired`, :class:`ShuttingDown`). Whoever submitted
        the ticket must end it (:meth:`Dispatcher.finish` or :meth:`Dispatcher.cancel`) on
        every path: ``proxy.turn.Turn`` does that for the proxy.

        Cancelling the wait leaves ``granted`` alone (the dispatcher's), as
        ``asyncio.shield`` would; unlike a shield's, the waiter is settled by the grant
        itself (:meth:`pass_on`), so the view resumes one loop turn sooner. Any other end of
        ``granted`` reaches it through ``granted``'s callback.
        """
        granted = self.granted
        if granted.done():
            return granted.result()
        waiter: asyncio.Future[str] = granted.get_loop().create_future()
        settle = functools.partial(_settle, waiter)
        self._waiter = waiter
        granted.add_done_callback(settle)
        try:
            return await waiter
        finally:
            granted.remove_done_callback(settle)
            if self._waiter is waiter:
                self._waiter = None

    def pass_on(self) -> None:
        """Hand ``granted``'s outcome to the :meth:`wait` in progress at once (the grant
        calls it right after setting the result); without it, ``granted``'s callback
        does so on the next loop turn."""
        if self._waiter is not None:
            _settle(self._waiter, self.granted)


def _settle(waiter: asyncio.Future[str], granted: asyncio.Future[str]) -> None:
    """``granted``'s outcome, now that it has one, to ``waiter`` unless it has one already
    (its wait was cancelled, or the grant passed it on)."""
    if waiter.done():
        return
    if granted.cancelled():
        waiter.cancel()
    elif (error := granted.exception()) is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(granted.result())


class Observer(Protocol):
    """Something that watches the dispatcher (metrics, records, dashboard).

    Called synchronously from the dispatcher task: must be cheap and must not block
    (no database writes; hand work to a background task instead).
    """

    def on_enqueue(self, ticket: Ticket) -> None: ...
    def on_dispatch(self, ticket: Ticket) -> None: ...
    def on_finish(self, ticket: Ticket) -> None: ...
    def on_model_state(self, model: str, state: ModelState) -> None: ...
    def on_settings(self, settings: SchedulerSettings, source: str) -> None: ...


@dataclass(frozen=True)
class ReloadReport:
    """What a reload changed (model ids)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    """Served what they had waiting, then stopped."""
    changed: tuple[str, ...] = ()
    """Restarted with the new definition: stopped once idle, started by their next request."""
    kept: tuple[str, ...] = ()
    """Unchanged: a loaded one keeps running (same process)."""


@dataclass(frozen=True)
class LaneView:
    """A lane as :meth:`Dispatcher.lanes` reports it."""

    name: str
    models: tuple[str, ...]
    """Every model configured on the lane."""
    loaded: dict[str, ModelState]
    """Models started or starting on it."""
    running: list[Ticket]
    waiting: int


def refusal_answer(kind: Refusal, message: str, retry_after: int | None) -> tuple[Refused, Outcome]:
    """The error a view answers for a strategy's refusal, and the ticket's outcome."""
    if kind is Refusal.OVERLOADED:
        return Overloaded(message, retry_after), Outcome.REJECTED
    if kind is Refusal.QUEUE_FULL:
        return QueueFull(message, retry_after), Outcome.QUEUE_FULL
    return WaitExpired(message, retry_after), Outcome.EXPIRED


def issue(
    model: ModelConfig,
    priority: int,
    request_id: str,
    path: str,
    arrival: tuple[float, float],
    owner: object | None,
    abandoned: Callable[[Ticket], None],
    **fields: Any,
) -> Ticket:
    """A new open ticket, its ``granted`` future on the running loop (what an
    :class:`Issuer`'s ``submit`` hands out), arrived at ``arrival`` (monotonic, wall-clock
    seconds). ``owner`` answers for ending it (the proxy's
    ``Turn``): should it be garbage-collected with the ticket still open, ``abandoned(ticket)``
    is called (by the collector, on any thread; see :func:`end_abandoned`), a backstop so
    that a bug on some exit path costs one log line instead of the GPU. A plain weakref with
    a callback: no global registry (as ``weakref.finalize`` keeps), a few hundred bytes less
    per waiting request; dropping it (``guard = None``, when the ticket ends) cancels it."""
    ticket = Ticket(
        request_id=request_id,
        model=model,
        priority=priority,
        path=path,
        arrival=arrival[0],
        arrival_wall=arrival[1],
        granted=asyncio.get_running_loop().create_future(),
        **fields,
    )
    if owner is not None:
        ticket.guard = weakref.ref(owner, functools.partial(_owner_gone, abandoned, ticket))
    return ticket


def _owner_gone(
    abandoned: Callable[[Ticket], None], ticket: Ticket, _ref: weakref.ref[Any]
) -> None:
    abandoned(ticket)


def end_abandoned(
    ticket: Ticket, loop: asyncio.AbstractEventLoop | None, end: Callable[[], None]
) -> None:
    """:func:`issue`'s backstop: ``ticket``'s owner was collected with the ticket open. An
    error is logged and ``end`` (which ends the ticket) runs on ``loop``, the issuer's."""
    ticket.guard = None
    if ticket.outcome is not None:
        return
    log.error(
        "turn abandoned by its request; ended",
        extra={
            "request_id": ticket.request_id,
            "model": ticket.model.id,
            "state": ticket.state.value,
        },
    )
    if loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(end)


class Issuer(Protocol):
    """Who issues a request's ticket and is told how it ended: the :class:`Dispatcher`
    (a local model's turn) or :class:`Unqueued` (a peer's request). ``proxy.turn.Turn``
    holds one and ends its ticket through it, once, on every path."""

    def submit(
        self,
        model: ModelConfig,
        priority: int,
        request_id: str,
        path: str,
        owner: object | None = None,
    ) -> Ticket: ...

    def finish(
        self, ticket: Ticket, outcome: Outcome, status: int | None = None, error: str | None = None
    ) -> None: ...

    def cancel(self, ticket: Ticket) -> None: ...

    def resend(self, ticket: Ticket) -> None: ...

    def suspect(self, ticket: Ticket) -> None: ...

    def unhealthy(self, ticket: Ticket) -> None: ...


class Watched(Protocol):
    """What :class:`Unqueued` needs of the dispatcher: its observers and its clock."""

    observers: list[Observer]

    def now(self) -> float: ...


class Unqueued:
    """The tickets of requests that take no turn here (a peer's model: no GPU of this box
    is involved), issued as the dispatcher issues its own: granted at once, never queued,
    on no lane. They end the same way, through :meth:`finish` or :meth:`cancel` (called by
    ``proxy.turn.Turn``): ended once, then the dispatcher's observers see ``on_finish``, as
    for every ticket. Also counts them per model while they run (:meth:`load`, for
    ``spillover`` selectors)."""

    def __init__(self, dispatcher: Watched, wall_clock: Callable[[], float] = time.time) -> None:
        self._dispatcher = dispatcher
        self._wall = wall_clock
        self._load: Counter[str] = Counter()
        self._running: dict[Ticket, str] = {}
        """Each open ticket and the model it is counted for (its ``model`` may be renamed
        for the record meanwhile: ``fleet.placing.sent``)."""
        self._loop: asyncio.AbstractEventLoop | None = None

    def load(self, model: str) -> int:
        """Requests of ``model`` running now."""
        return self._load.get(model, 0)

    def submit(
        self,
        model: ModelConfig,
        priority: int,
        request_id: str,
        path: str,
        owner: object | None = None,
    ) -> Ticket:
        now = self._dispatcher.now()
        self._loop = asyncio.get_running_loop()
        ticket = issue(
            model,
            priority,
            request_id,
            path,
            (now, self._wall()),
            owner,
            self._abandoned,
            state=TicketState.RUNNING,
            dispatched_at=now,  # sent at once: no queue, no load
            ready_at=now,
            lane="",  # on no lane (GPU) here
        )
        ticket.granted.set_result(model.proxy)
        self._load[model.id] += 1
        self._running[ticket] = model.id
        return ticket

    def finish(
        self, ticket: Ticket, outcome: Outcome, status: int | None = None, error: str | None = None
    ) -> None:
        if ticket.outcome is not None:
            return
        ticket.outcome, ticket.status, ticket.error = outcome, status, error
        self._end(ticket)

    def cancel(self, ticket: Ticket) -> None:
        if ticket.outcome is not None:
            return
        ticket.outcome = Outcome.CANCELLED_RUNNING
        self._end(ticket)

    def resend(self, ticket: Ticket) -> None:
        raise RuntimeError(f"ticket {ticket.request_id} takes no turn here: never resent")

    def suspect(self, ticket: Ticket) -> None:
        """No process here to suspect."""

    def unhealthy(self, ticket: Ticket) -> None:
        """No process here to stop."""

    def _end(self, ticket: Ticket) -> None:
        ticket.guard = None
        ticket.state = TicketState.DONE
        ticket.finished_at = self._dispatcher.now()
        counted = self._running.pop(ticket, None)
        if counted is not None:
            self._load[counted] -= 1
            if self._load[counted] <= 0:
                del self._load[counted]
        log.info(
            "request forwarded",
            extra={
                "request_id": ticket.request_id,
                "model": ticket.model.id,
                "peer": ticket.extra.get("peer", ""),
                "priority": ticket.priority,
                "outcome": ticket.outcome.value if ticket.outcome else None,
                "status": ticket.status,
                "ms": round((ticket.finished_at - ticket.arrival) * 1000.0, 1),
            },
        )
        for observer in self._dispatcher.observers:
            try:
                observer.on_finish(ticket)
            except Exception:
                log.exception("observer failed", extra={"observer": type(observer).__name__})

    def _abandoned(self, ticket: Ticket) -> None:
        end_abandoned(
            ticket,
            self._loop,
            functools.partial(
                self.finish, ticket, Outcome.FAILED, 500, "turn abandoned by its request"
            ),
        )
