"""The dispatcher: the one asyncio task that owns the waiting queue and the model processes.

Events come in through an inbox (a request arrived, its client went away, it finished, a
model became ready or failed or exited, settings changed, an unload was asked for); the
task applies each to its state, asks the pure core (:mod:`scheduler.core.queue`) which request
goes next, and carries out the effects (grant a request, start or stop a model). Nothing
else touches the queue or the processes, so there are no locks.

Views talk to it through :meth:`Dispatcher.submit` (returns a :class:`Ticket` to await),
:meth:`Dispatcher.finish` and :meth:`Dispatcher.cancel`; all three only post an event.

Lanes (:mod:`scheduler.core.lanes`): each GPU is a lane with its own queue, processes and
loads; lanes run at once, and nothing one lane does waits for another. By default there
is one lane for the whole box.

Serial (the spec's scheduler), per lane: one inference request at a time, across that
lane's models (with ``slots: N``, up to N of the running model's while the lane's best
waiting request is for it); a swap is part of the picked request's turn. Fifo
(llama-swap's): requests for a ready model are served at once up to its
``concurrencyLimit`` (beyond it :class:`Overloaded`, a 429); a request that needs a swap
waits in the queue; a busy model is never stopped to make room. In both, what stays
loaded beside a starting model is the router's call (``Config.router``: llama-swap's
groups or matrix, by default one model per lane), and a lane starts one model at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import itertools
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.config import Config, ModelConfig
from scheduler.core.estimate import WaitEstimator
from scheduler.core.lanes import DEFAULT_LANE, LaneQueues, fill_slots
from scheduler.core.policy import Decision, Policy, QueuedRequest, SchedulerSettings
from scheduler.core.priority import Band
from scheduler.process import LogBuffer, ModelProcess, ModelProcessLike, ModelStartError, ModelState

log = logging.getLogger("llamaswap.dispatcher")

SUSPECT_WAIT = 0.5
"""Seconds a model that broke off an answer gets to show it died, before the next request
is sent to it (see :meth:`Dispatcher.suspect`)."""

ANNOUNCE_AFTER = 4
"""Loop turns a dispatch's log line and observer calls wait: the grant resolves the
ticket's future, whose callback wakes ``Ticket.wait``'s shield, which wakes the view,
which writes the request to the model (see :meth:`Dispatcher._announce`)."""


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

    async def wait(self) -> str:
        """Wait for this request's turn; returns the upstream base URL.

        Raises :class:`ModelStartError` or a :class:`Refused` (:class:`Overloaded`,
        :class:`QueueFull`, :class:`WaitExpired`, :class:`ShuttingDown`). Whoever submitted
        the ticket must end it (:meth:`Dispatcher.finish` or :meth:`Dispatcher.cancel`) on
        every path: ``proxy.turn.Turn`` does that for the proxy.
        """
        return await asyncio.shield(self.granted)


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


# -- events -----------------------------------------------------------------------------


@dataclass
class _Arrived:
    ticket: Ticket


@dataclass
class _Gone:
    ticket: Ticket


@dataclass
class _Finished:
    ticket: Ticket


@dataclass
class _SwapDone:
    model: str
    process: ModelProcessLike | None
    error: ModelStartError | None
    seconds: float
    lane: str


@dataclass
class _Exited:
    process: ModelProcessLike


@dataclass
class _Settings:
    settings: SchedulerSettings
    source: str


@dataclass
class _Unload:
    models: tuple[str, ...] | None
    done: asyncio.Future[None]


@dataclass
class _Tick:
    pass


@dataclass
class _Expire:
    pass


@dataclass
class _Resend:
    ticket: Ticket


@dataclass
class _Suspect:
    model: str
    generation: int
    lane: str


@dataclass
class _Checked:
    process: ModelProcessLike


@dataclass
class _Unhealthy:
    model: str
    generation: int
    lane: str


@dataclass
class _Stop:
    pass


@dataclass
class _Drain:
    pass


@dataclass
class _Reload:
    config: Config
    source: str | None
    done: asyncio.Future[ReloadReport]


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


@dataclass(eq=False)
class _Lane:
    """One GPU's share of the dispatcher's state, owned by the run task."""

    name: str
    processes: dict[str, ModelProcessLike] = field(default_factory=dict)
    """Started (ready) model processes on this lane, by model id."""
    generation: dict[str, int] = field(default_factory=dict)
    """Which start each process is (see :meth:`Dispatcher.resend`)."""
    running: dict[str, set[Ticket]] = field(default_factory=dict)
    """Granted or loading tickets by model id."""
    swapping: str | None = None
    """Model id being started by the swap task, if any (one load per lane at a time)."""
    swap_task: asyncio.Task[None] | None = None
    loading: ModelProcessLike | None = None
    """The process the swap task is starting, once it exists."""
    swap_aborted: bool = False
    """The load in progress was given up (unloaded, or all its waiters left)."""
    checking: ModelProcessLike | None = None
    """A model that broke off an answer, given a moment to show it died (see
    :meth:`Dispatcher.suspect`); nothing is dispatched on this lane meanwhile."""
    stops: set[asyncio.Task[None]] = field(default_factory=set)
    """This lane's processes being stopped: no process of the lane starts before these
    are reaped, so a replaced model is gone before its successor exists (VRAM, ports)."""
    stale: set[str] = field(default_factory=set)
    """Loaded models whose definition changed in a reload (or that moved to another
    lane): they take no new request and are stopped once their running ones end."""
    estimator: WaitEstimator = field(default_factory=WaitEstimator)
    """Measured service and load times and arrival rates, for estimated waits."""

    def busy(self) -> int:
        return sum(len(t) for t in self.running.values())

    def ready(self, model: str) -> bool:
        proc = self.processes.get(model)
        return (
            proc is not None
            and proc.state is ModelState.READY
            and self.swapping != model
            and model not in self.stale
        )

    def resident(self) -> list[str]:
        """Models loaded or loading on this lane."""
        return [*self.processes, *([self.swapping] if self.swapping else [])]


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


ProcessFactory = Callable[..., ModelProcessLike]
"""Builds a model process: ``ModelProcess`` in production, ``scheduler.testing``'s fake in tests."""


class Dispatcher:
    """Owns the queue and the processes. Create it, ``await start()``, ``await stop()``."""

    def __init__(
        self,
        config: Config,
        *,
        logs: LogBuffer | None = None,
        process_factory: ProcessFactory = ModelProcess,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        observers: Iterable[Observer] = (),
    ) -> None:
        self.config = config
        self.logs = logs or LogBuffer()
        self.observers: list[Observer] = list(observers)
        self.settings_source = "config file"
        self._process_factory = process_factory
        self._clock = clock
        self._wall = wall_clock
        self._queue = LaneQueues(config.scheduler, config.lane_of, config.lanes)
        self._lanes = {name: _Lane(name) for name in self._queue.names}
        self._evict = config.router.evict
        self._tickets: dict[str, Ticket] = {}
        """Waiting tickets by request id."""
        self._inbox: asyncio.Queue[object] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._preload_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()
        self._stops: set[asyncio.Task[None]] = set()
        """Every lane's stops and health checks, for shutdown to wait for."""
        self._closing = False
        self._ids = itertools.count(1)
        self._generations = itertools.count(1)
        """Numbers every successful start: which start a ticket was granted to."""
        self._service_mean: float | None = None
        """Moving average of seconds from dispatch to finish, for Retry-After estimates."""
        self._expire_handle: asyncio.TimerHandle | None = None
        self._expire_at: float | None = None
        self._last_used: dict[str, float] = {}
        self._ttl_handle: asyncio.TimerHandle | None = None
        self._ttl_at: float | None = None
        self._retired: dict[str, ModelConfig] = {}
        """Models a reload removed, by id, until what they had waiting has been served."""
        self._retiring = False
        """A reload left removed or changed models to stop once idle (see :meth:`_retire`)."""
        self._announcements: list[tuple[str, Ticket]] = []
        """Dispatched tickets not yet logged or shown to the observers (:meth:`_announce`)."""
        self._idle = asyncio.Event()
        self._idle.set()

    # -- the views' side ----------------------------------------------------------------

    @property
    def settings(self) -> SchedulerSettings:
        return self._queue.settings

    @property
    def queue(self) -> LaneQueues:
        """Read-only use (metrics, dashboard). Only the run task changes it."""
        return self._queue

    def now(self) -> float:
        return self._clock()

    def submit(
        self,
        model: ModelConfig,
        priority: int,
        request_id: str,
        path: str,
        owner: object | None = None,
    ) -> Ticket:
        """Put a request in line; await ``ticket.wait()`` for its turn.

        ``owner`` is the object that answers for ending the ticket (the proxy's ``Turn``).
        Should it be garbage-collected with the ticket still open, the dispatcher ends the
        ticket itself and logs an error: a backstop, so that a bug on some exit path costs
        one log line instead of the GPU.
        """
        loop = asyncio.get_running_loop()
        ticket = Ticket(
            request_id=request_id,
            model=model,
            priority=priority,
            path=path,
            arrival=self._clock(),
            arrival_wall=self._wall(),
            granted=loop.create_future(),
        )
        if owner is not None:
            # A plain weakref with a callback: no global registry (as weakref.finalize
            # keeps), a few hundred bytes less per waiting request. Dropping it (``guard
            # = None``, when the ticket ends) cancels the callback.
            ticket.guard = weakref.ref(owner, functools.partial(self._owner_gone, ticket))
        if self._closing:
            ticket.state = TicketState.DONE
            ticket.outcome = Outcome.REJECTED
            ticket.granted.set_exception(ShuttingDown("the server is shutting down"))
            ticket.granted.exception()  # mark retrieved
            return ticket
        self._inbox.put_nowait(_Arrived(ticket))
        return ticket

    def finish(
        self, ticket: Ticket, outcome: Outcome, status: int | None = None, error: str | None = None
    ) -> None:
        """The request's turn is over (answered, failed, or client gone). Idempotent."""
        if ticket.outcome is not None:
            return
        ticket.guard = None
        ticket.outcome, ticket.status, ticket.error = outcome, status, error
        ticket.finished_at = self._clock()
        self._inbox.put_nowait(_Finished(ticket))

    def cancel(self, ticket: Ticket) -> None:
        """The client went away before its turn came (or during its model's load)."""
        if ticket.outcome is not None:
            return
        ticket.guard = None
        if ticket.state is TicketState.WAITING:
            ticket.outcome = Outcome.CANCELLED_WAITING
        else:
            ticket.outcome = Outcome.CANCELLED_RUNNING
        ticket.finished_at = self._clock()
        self._inbox.put_nowait(_Gone(ticket))

    def resend(self, ticket: Ticket) -> None:
        """The granted request never reached its model (connection refused): the process
        it was granted to died before its exit was reaped. Its turn goes on: the model is
        restarted (or the fresh process used, if one was started meanwhile) and the ticket
        granted once more; await ``ticket.wait()`` again. Only for requests of which no
        byte can have reached the model, and only once per ticket."""
        if ticket.outcome is not None or ticket.resent:
            raise RuntimeError(f"ticket {ticket.request_id} cannot be resent")
        ticket.resent = True
        ticket.granted = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Resend(ticket))

    def suspect(self, ticket: Ticket) -> None:
        """The model this ticket was granted to broke off its answer (connection reset,
        stream cut): it may be dying. Before the next request goes to it, give its exit
        :data:`SUSPECT_WAIT` seconds to show; a request sent into a dying process's listen
        backlog is reset, and such a request may have reached it, so it is never resent."""
        self._inbox.put_nowait(_Suspect(ticket.model.id, ticket.generation, ticket.lane))

    def unhealthy(self, ticket: Ticket) -> None:
        """The model this ticket was granted to stopped answering and failed its health
        check: stop it (the next request for it starts it afresh)."""
        self._inbox.put_nowait(_Unhealthy(ticket.model.id, ticket.generation, ticket.lane))

    def _owner_gone(self, ticket: Ticket, _ref: weakref.ref[Any]) -> None:
        self._abandoned(ticket)

    def _abandoned(self, ticket: Ticket) -> None:
        """The ticket's owner was collected with the ticket open (see :meth:`submit`)."""
        ticket.guard = None
        if ticket.outcome is not None:
            return
        log.error(
            "turn abandoned by its request; ended by the dispatcher",
            extra={"request_id": ticket.request_id, "model": ticket.model.id, "state": ticket.state.value},
        )

        def end() -> None:
            if ticket.state is TicketState.WAITING:
                self.cancel(ticket)
            else:
                self.finish(ticket, Outcome.FAILED, 500, "turn abandoned by its request")

        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(end)

    def set_settings(self, settings: SchedulerSettings, source: str = "admin") -> None:
        """New settings from the next pick on (admin edit). Safe to call from any thread
        (the admin's sync views run in a worker thread)."""
        self._post_threadsafe(_Settings(settings, source))

    def _post_threadsafe(self, event: object) -> None:
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            self._inbox.put_nowait(event)
        else:
            loop.call_soon_threadsafe(self._inbox.put_nowait, event)

    async def reload(self, config: Config, source: str | None = None) -> ReloadReport:
        """Put a new config in force without losing the queue (SIGHUP, ``--watch-config``).

        Waiting requests stay queued (on their model's lane in the new config); running
        ones finish. An unchanged model keeps its process; a changed one (or one moved to
        another lane) takes no new request, is stopped once its running requests end, and
        starts with its new definition when next needed; a removed one serves what it
        had waiting, then stops (new requests for it are the views' 404). ``config`` is
        already valid: a config with errors never gets here. ``source`` describes where
        its scheduler settings came from (admin overrides, see the ``serve`` command).
        """
        done: asyncio.Future[ReloadReport] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Reload(config, source, done))
        return await done

    async def unload(self, models: Iterable[str] | None = None) -> None:
        """Stop the given models (all when None); returns when their processes are gone."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Unload(tuple(models) if models is not None else None, done))
        await done

    def running_models(self) -> list[dict[str, str]]:
        """llama-swap's /running: the loaded models and their states (and lanes)."""
        return [
            {"model": model, "state": state.name.lower(), "lane": self._queue.lane_for(model)}
            for model, state in self.model_states().items()
        ]

    def model_states(self) -> dict[str, ModelState]:
        """Model id -> state for every model started or starting; absent means stopped."""
        states: dict[str, ModelState] = {}
        for lane in self._lanes.values():
            for model, proc in lane.processes.items():
                if proc.state is not ModelState.STOPPED:
                    states[model] = proc.state
            if lane.swapping is not None:
                states[lane.swapping] = ModelState.STARTING
        return states

    def model_state(self) -> tuple[str | None, ModelState]:
        """One loaded model and its state (the loading one first): the whole answer on a
        box with one lane and one model at a time; see :meth:`model_states` otherwise."""
        states = self.model_states()
        for model, state in states.items():
            if state is ModelState.STARTING:
                return model, state
        for model, state in states.items():
            return model, state
        return None, ModelState.STOPPED

    def load(self, model: str) -> int:
        """Requests of ``model`` waiting or being served."""
        lane = self._lanes[self._queue.lane_for(model)]
        return self._queue.waiting_for(model) + len(lane.running.get(model, ()))

    def in_flight(self) -> list[Ticket]:
        return [t for lane in self._lanes.values() for tickets in lane.running.values() for t in tickets]

    def waiting(self, limit: int | None = None) -> dict[str, tuple[str, int, float]]:
        """For the first ``limit`` waiting requests of each lane: request id -> (lane,
        position in the lane (1 goes next), estimated seconds until it is picked).

        The estimate (:class:`scheduler.core.estimate.WaitEstimator`): what is left of the
        lane's running job, then for each request ahead its model's measured time and a
        load where the model changes, stretched by the load of the bands above."""
        now = self._clock()
        out: dict[str, tuple[str, int, float]] = {}
        for name in self._queue.names:
            queue = self._queue.lane(name)
            if not queue:
                continue
            lane = self._lanes[name]
            ranked = queue.peek(now, limit)
            left = 0.0
            for ticket in (t for ts in lane.running.values() for t in ts):
                if ticket.decision is None:
                    continue
                started = ticket.ready_at if ticket.ready_at is not None else ticket.dispatched_at or now
                loading = ticket.state is TicketState.LOADING
                left = max(left, lane.estimator.running_left(ticket.model.id, ticket.decision.band, started, now, loading))
            estimates = lane.estimator.estimates(ranked, lane.resident(), left, now)
            for position, (r, eta) in enumerate(zip(ranked, estimates, strict=True), start=1):
                out[r.request.request_id] = (name, position, eta)
        return out

    def lanes(self) -> list[LaneView]:
        """Each lane as the dashboard shows it (read-only snapshot)."""
        views = []
        for lane in self._lanes.values():
            loaded: dict[str, ModelState] = {
                m: p.state for m, p in lane.processes.items() if p.state is not ModelState.STOPPED
            }
            if lane.swapping is not None:
                loaded[lane.swapping] = ModelState.STARTING
            models = tuple(m for m in self.config.models if self._queue.lane_for(m) == lane.name)
            waiting = len(self._queue.lane(lane.name))
            if not (models or loaded or lane.running or waiting):
                continue  # the default lane when every model is on a named one
            views.append(
                LaneView(
                    name=lane.name,
                    models=models,
                    loaded=loaded,
                    running=[t for ts in lane.running.values() for t in ts],
                    waiting=waiting,
                )
            )
        return views

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Start the run task (and preload the configured models)."""
        if self._task is not None:
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._task = loop.create_task(self._run(), name="dispatcher")
        models = [m for m in map(self.config.resolve, self.config.preload) if m is not None]
        if models:
            self._preload_task = loop.create_task(self._preload(models), name="preload")

    async def _preload(self, models: list[ModelConfig]) -> None:
        """hooks.on_startup.preload: load each model in turn, like a request at priority 0
        that nobody waits for. With one model loaded at a time, the last one stays."""
        for model in models:
            ticket = self.submit(model, 0, f"preload-{model.id}", "preload")
            ticket.extra["preload"] = True
            try:
                await ticket.wait()
            except (ModelStartError, ShuttingDown) as error:
                log.warning("preload failed", extra={"model": model.id, "cause": str(error)})
            finally:
                self.finish(ticket, Outcome.COMPLETED, 200)

    async def stop(self, grace: float = 30.0) -> None:
        """Refuse new work, fail what waits, let running requests finish for up to
        ``grace`` seconds, then stop every model process.

        Calling it again while it runs (a second SIGINT) with ``grace=0`` cuts the grace
        period short; either call returns once everything is stopped.
        """
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop(grace))
        elif grace <= 0:
            self._hurry.set()
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        self._closing = True
        self._inbox.put_nowait(_Drain())
        if self._preload_task is not None:
            self._preload_task.cancel()
        idle = asyncio.ensure_future(self._idle.wait())
        hurry = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait((idle, hurry), timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        hurry.cancel()
        if self._task is not None:
            self._inbox.put_nowait(_Stop())
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for lane in self._lanes.values():
            if lane.swap_task is not None:
                lane.swap_task.cancel()
                with contextlib.suppress(BaseException):
                    await lane.swap_task
            for proc in lane.processes.values():
                self._stop_process(lane, proc)
            lane.processes.clear()
        while self._stops:
            await asyncio.wait(set(self._stops))
        if self._expire_handle is not None:
            self._expire_handle.cancel()

    def _on_drain(self) -> None:
        """Shutdown: every waiting request fails at once with 503."""
        for ticket in list(self._tickets.values()):
            self._queue.cancel(ticket.request_id)
            del self._tickets[ticket.request_id]
            ticket.state = TicketState.DONE
            ticket.outcome = Outcome.REJECTED
            ticket.granted.set_exception(ShuttingDown("the server is shutting down"))
            ticket.granted.exception()
            self._notify("on_finish", ticket)
        self._update_idle()

    # -- the run task -------------------------------------------------------------------

    async def _run(self) -> None:
        inbox = self._inbox
        while True:
            event = await inbox.get()
            if isinstance(event, _Stop):
                return
            self._handle(event)
            # Apply everything that arrived meanwhile before deciding, so a burst is
            # ordered by the policy rather than by who got into the inbox first.
            while not inbox.empty():
                event = inbox.get_nowait()
                if isinstance(event, _Stop):
                    return
                self._handle(event)
            try:
                self._dispatch()
                if self._max_wait:
                    self._arm_expiry()
                if self._retiring:
                    self._retire()
            except Exception:  # never let one bad decision kill the loop
                log.exception("dispatch failed")

    def _handle(self, event: object) -> None:
        if self._announcements and not isinstance(event, _Arrived):
            # An arrival is about another ticket: it may go first (arrivals stream in
            # during a job change under load).
            self._flush_announcements()
        try:
            if isinstance(event, _Arrived):
                self._on_arrived(event.ticket)
            elif isinstance(event, _Finished):
                self._on_finished(event.ticket)
            elif isinstance(event, _Gone):
                self._on_gone(event.ticket)
            elif isinstance(event, _SwapDone):
                self._on_swap_done(event)
            elif isinstance(event, _Exited):
                self._on_exited(event.process)
            elif isinstance(event, _Settings):
                self._queue.set_settings(event.settings)
                self.settings_source = event.source
                log.info("settings changed", extra={"source": event.source, **event.settings.as_dict()})
                self._notify("on_settings", event.settings, event.source)
            elif isinstance(event, _Unload):
                self._on_unload(event)
            elif isinstance(event, _Tick):
                self._on_tick()
            elif isinstance(event, _Resend):
                self._on_resend(event.ticket)
            elif isinstance(event, _Expire):
                self._on_expire()
            elif isinstance(event, _Suspect):
                self._on_suspect(event)
            elif isinstance(event, _Checked):
                self._on_checked(event)
            elif isinstance(event, _Unhealthy):
                self._on_unhealthy(event)
            elif isinstance(event, _Drain):
                self._on_drain()
            elif isinstance(event, _Reload):
                self._on_reload(event)
        except Exception:
            log.exception("dispatcher event failed", extra={"event": type(event).__name__})

    def _notify(self, method: str, *args: object) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(*args)
            except Exception:
                log.exception("observer failed", extra={"observer": type(observer).__name__})

    @property
    def _fifo(self) -> bool:
        return self._queue.settings.use is Policy.FIFO

    def _lane(self, model: str) -> _Lane:
        return self._lanes[self._queue.lane_for(model)]

    def _model(self, model: str) -> ModelConfig:
        """A model's definition: the config's, or a removed one's still being drained."""
        found = self.config.models.get(model) or self._retired.get(model)
        if found is None:
            raise KeyError(model)
        return found

    def _on_arrived(self, ticket: Ticket) -> None:
        model = ticket.model.id
        lane = self._lane(model)
        ticket.lane = lane.name
        if self._fifo and lane.ready(model) and not self._queue.waiting_for(model):
            limit = ticket.model.concurrency_limit
            if len(lane.running.get(model, ())) >= limit:
                self._notify("on_enqueue", ticket)
                self._refuse(
                    ticket,
                    Outcome.REJECTED,
                    Overloaded(f"model {model!r} is serving its concurrencyLimit ({limit}) requests", 1),
                )
                return
        depth = self._max_depth
        if depth is not None and len(self._queue) >= depth and not ticket.extra.get("preload"):
            self._notify("on_enqueue", ticket)
            self._refuse(
                ticket,
                Outcome.QUEUE_FULL,
                QueueFull(
                    f"the queue is full: {len(self._queue)} requests are waiting (maxQueueDepth {depth})",
                    self.retry_after(1),
                ),
            )
            log.warning("queue full", extra=self._fields(ticket))
            return
        self._tickets[ticket.request_id] = ticket
        queued = QueuedRequest(ticket.request_id, model, ticket.priority, ticket.arrival)
        self._queue.add(queued)
        lane.estimator.arrived(queued)
        self._idle.clear()
        if not ticket.extra.get("preload"):
            self._notify("on_enqueue", ticket)

    def _on_gone(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.DONE:
            return
        if ticket.state is TicketState.WAITING:
            if self._queue.cancel(ticket.request_id) is not None:
                del self._tickets[ticket.request_id]
            ticket.state = TicketState.DONE
            log.info("cancelled while waiting", extra=self._fields(ticket))
            self._notify("on_finish", ticket)
        else:
            was_loading = ticket.state is TicketState.LOADING
            self._end_turn(ticket)
            if was_loading:
                self._maybe_abandon_load(self._lanes[ticket.lane], ticket.model.id)
        self._update_idle()

    def _maybe_abandon_load(self, lane: _Lane, model: str) -> None:
        """A load whose waiters all left is given up when other work waits on its lane;
        otherwise it completes and leaves the model loaded for whoever is next."""
        if lane.swapping != model or lane.swap_aborted:
            return
        if any(t.state is TicketState.LOADING for t in lane.running.get(model, ())):
            return
        queue = self._queue.lane(lane.name)
        if not queue or queue.waiting_for(model):
            return
        log.info("load abandoned: its requests left and other work waits", extra={"model": model})
        self._abort_load(lane)

    def _abort_load(self, lane: _Lane) -> None:
        lane.swap_aborted = True
        if lane.loading is not None:
            self._stop_process(lane, lane.loading)

    def _refuse(self, ticket: Ticket, outcome: Outcome, error: Refused) -> None:
        """End a ticket that will never be dispatched, with the error its view answers."""
        ticket.state = TicketState.DONE
        ticket.outcome = outcome
        ticket.status = error.status
        ticket.error = str(error)
        ticket.finished_at = self._clock()
        ticket.guard = None
        if not ticket.granted.done():
            ticket.granted.set_exception(error)
            ticket.granted.exception()  # retrieved: its view may be gone already
        self._notify("on_finish", ticket)

    def retry_after(self, ahead: int) -> int:
        """Whole seconds until about ``ahead`` requests have been served, from the measured
        mean time per request (1 s before anything has been measured); at least 1."""
        mean = self._service_mean if self._service_mean is not None else 1.0
        return max(1, min(3600, math.ceil(ahead * mean)))

    # -- bounds -------------------------------------------------------------------------

    @property
    def _max_depth(self) -> int | None:
        return self.config.bounds.max_queue_depth

    @property
    def _max_wait(self) -> Mapping[str, float]:
        return self.config.bounds.max_wait

    def _arm_expiry(self) -> None:
        """Keep one timer at the earliest maxWait deadline: the oldest of each band."""
        deadline = None
        for band, limit in self._max_wait.items():
            oldest = self._queue.oldest(Band(band))
            if oldest is not None:
                at = oldest.arrival + limit
                deadline = at if deadline is None else min(deadline, at)
        if deadline == self._expire_at:
            return
        if self._expire_handle is not None:
            self._expire_handle.cancel()
            self._expire_handle = None
        self._expire_at = deadline
        if deadline is not None:
            self._expire_handle = asyncio.get_running_loop().call_later(
                max(0.0, deadline - self._clock()), self._inbox.put_nowait, _Expire()
            )

    def _on_expire(self) -> None:
        self._expire_handle = None
        self._expire_at = None
        now = self._clock()
        for band, limit in self._max_wait.items():
            while True:
                oldest = self._queue.oldest(Band(band))
                if oldest is None or now - oldest.arrival < limit - 1e-6:
                    break
                self._queue.cancel(oldest.request_id)
                ticket = self._tickets.pop(oldest.request_id)
                waited = now - ticket.arrival
                self._refuse(
                    ticket,
                    Outcome.EXPIRED,
                    WaitExpired(
                        f"waited {waited:.0f}s without being served (maxWait for {band}: {limit:g}s)",
                        self.retry_after(len(self._queue) + 1),
                    ),
                )
                log.warning("wait expired", extra={**self._fields(ticket), "waited_s": round(waited, 1)})
        self._update_idle()

    def _on_finished(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.DONE:
            return
        if ticket.state is TicketState.WAITING:
            # Its request failed before its turn came: it leaves the queue, undispatched.
            self._on_gone(ticket)
            return
        self._end_turn(ticket)
        self._update_idle()

    def _end_turn(self, ticket: Ticket) -> None:
        was = ticket.state
        ticket.state = TicketState.DONE
        lane = self._lanes[ticket.lane]
        running = lane.running.get(ticket.model.id)
        if running is not None:
            running.discard(ticket)
            if not running:
                del lane.running[ticket.model.id]
        now = self._clock()
        self._last_used[ticket.model.id] = now
        if ticket.outcome is Outcome.COMPLETED and ticket.dispatched_at is not None:
            took = now - ticket.dispatched_at
            mean = self._service_mean
            self._service_mean = took if mean is None else mean + 0.1 * (took - mean)
            if ticket.ready_at is not None and ticket.decision is not None:
                lane.estimator.finished(
                    ticket.model.id, ticket.decision.band, now - ticket.ready_at, ticket.load_seconds
                )
        if was is TicketState.LOADING and not ticket.granted.done():
            ticket.granted.cancel()
        if not ticket.extra.get("preload"):
            if log.isEnabledFor(logging.DEBUG):
                outcome = ticket.outcome.value if ticket.outcome else None
                log.debug("finished", extra={**self._fields(ticket), "outcome": outcome})
            self._announce("on_finish", ticket)
        self._schedule_ttl()

    def _on_reload(self, event: _Reload) -> None:
        old, new = self.config, event.config
        added = tuple(m for m in new.models if m not in old.models)
        removed = tuple(m for m in old.models if m not in new.models)
        changed = tuple(
            m
            for m in new.models
            if m in old.models
            and (new.models[m] != old.models[m] or new.lane_of.get(m) != old.lane_of.get(m))
        )
        kept = tuple(m for m in new.models if m in old.models and m not in changed)
        for model in removed:
            self._retired[model] = old.models[model]
        for model in added:
            self._retired.pop(model, None)
        # Removed models keep their lane until they are drained.
        lane_of = {m: self._queue.lane_for(m) for m in self._retired} | dict(new.lane_of)
        queue = LaneQueues(new.scheduler, lane_of, new.lanes)
        for name in queue.names:
            self._lanes.setdefault(name, _Lane(name))
        for ticket in self._tickets.values():  # arrival order: dicts keep insertion order
            if ticket.model.id in new.models:
                ticket.model = new.models[ticket.model.id]
            ticket.lane = queue.add(
                QueuedRequest(ticket.request_id, ticket.model.id, ticket.priority, ticket.arrival)
            )
        self.config = new
        self._evict = new.router.evict
        self._queue = queue
        for lane in self._lanes.values():
            for model in [*lane.processes, *([lane.swapping] if lane.swapping else [])]:
                if model in changed or (model in new.models and lane_of.get(model) != lane.name):
                    lane.stale.add(model)
            queue.lane(lane.name).set_loaded_models(lane.resident())
        self._retiring = True
        if new.scheduler != old.scheduler:
            self.settings_source = event.source or self.settings_source
            self._notify("on_settings", new.scheduler, self.settings_source)
        report = ReloadReport(added, removed, changed, kept)
        log.info(
            "config reloaded",
            extra={"added": list(added), "removed": list(removed), "changed": list(changed), "kept": len(kept)},
        )
        if not event.done.done():
            event.done.set_result(report)

    def _retire(self) -> None:
        """Stop what a reload left behind once it is idle: changed models with nothing
        running, removed ones with nothing waiting or running."""
        pending = False
        for lane in self._lanes.values():
            for model in list(lane.stale):
                if lane.running.get(model) or lane.swapping == model:
                    pending = True
                    continue
                lane.stale.discard(model)
                proc = lane.processes.pop(model, None)
                if proc is not None:
                    log.info("stopping a model whose definition changed", extra={"model": model})
                    self._stop_process(lane, proc)
                    self._loaded_changed(lane)
        for model in list(self._retired):
            lane = self._lanes[self._queue.lane_for(model)]
            if self._queue.waiting_for(model) or lane.running.get(model) or lane.swapping == model:
                pending = True
                continue
            del self._retired[model]
            proc = lane.processes.pop(model, None)
            if proc is not None:
                log.info("stopping a model the config no longer has", extra={"model": model})
                self._stop_process(lane, proc)
                self._loaded_changed(lane)
        self._retiring = pending

    def _update_idle(self) -> None:
        if not self._tickets and not any(lane.running for lane in self._lanes.values()):
            self._idle.set()

    # -- deciding -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Grant whatever may run now, lane by lane. Called after every batch of events."""
        if not self._queue:
            return
        fifo = self._fifo
        for lane in self._lanes.values():
            if lane.checking is not None or not self._queue.lane(lane.name):
                continue
            if fifo:
                self._dispatch_fifo(lane)
            else:
                self._dispatch_serial(lane)

    def _dispatch_serial(self, lane: _Lane) -> None:
        """The spec's rule, per lane: one request at a time, picked by score; with
        ``slots: N`` up to N of the running model's while the lane's best waiting request
        is for it (:func:`fill_slots`); otherwise the lane drains before it swaps."""
        now = self._clock()
        busy = lane.busy()
        if busy == 0:
            if lane.swapping is not None:
                return  # a load nobody waits for any more settles first
            decision = self._queue.pick(now, lane.name)
            if decision is None:
                return
            self._start_turn(lane, decision)
            model, busy = decision.model, 1
        else:
            model = next(iter(lane.running))
        slots = self._model(model).slots
        if slots > 1 and busy < slots and model not in lane.stale:
            for decision in fill_slots(self._queue, lane.name, now, model, busy, slots):
                self._start_turn(lane, decision)

    def _dispatch_fifo(self, lane: _Lane) -> None:
        """llama-swap's rule: requests for a ready model go at once, up to its
        ``concurrencyLimit``; the first request for any other model starts a swap once
        every model that swap would stop is idle (a busy model is never stopped)."""
        now = self._clock()
        for model in list(lane.processes):
            if not lane.ready(model):
                continue
            limit = self._model(model).concurrency_limit
            while len(lane.running.get(model, ())) < limit:
                decision = self._queue.pick(now, lane.name, model=model)
                if decision is None:
                    break
                self._start_turn(lane, decision)
        if lane.swapping is not None:
            return
        queue = self._queue.lane(lane.name)
        nxt = queue.next_model()
        if nxt is None or lane.ready(nxt) or lane.running.get(nxt):
            return  # (a model with running requests but not ready: changed, draining)
        if any(lane.running.get(m) for m in self._evict(nxt, lane.resident())):
            return
        self._start_turn(lane, self._queue.pick(now, lane.name))

    def _start_turn(self, lane: _Lane, decision: Decision | None) -> None:
        if decision is None:
            return
        ticket = self._tickets.pop(decision.request_id)
        ticket.decision = decision
        ticket.dispatched_at = self._clock()
        model = ticket.model.id
        lane.running.setdefault(model, set()).add(ticket)
        if lane.ready(model):
            self._grant(ticket)
        else:
            ticket.state = TicketState.LOADING
            ticket.swapped = True
            if lane.swapping != model:
                self._begin_swap(lane, ticket.model)
        if not ticket.extra.get("preload"):
            self._announce("on_dispatch", ticket)

    def _announce(self, method: str, ticket: Ticket) -> None:
        """Tell the observers (and log a dispatch) once the next granted view has had its
        turn: together ~0.15 ms that would otherwise sit between one job's end and the
        next one's first byte to the model (BENCHMARKS.md, "Dispatch gap"). Nothing is
        reordered: pending announcements go out, in order, before the next event is
        handled."""
        self._announcements.append((method, ticket))
        if len(self._announcements) == 1:
            asyncio.get_running_loop().call_soon(self._announce_later, ANNOUNCE_AFTER)

    def _announce_later(self, turns: int) -> None:
        if turns > 1 and self._announcements:
            asyncio.get_running_loop().call_soon(self._announce_later, turns - 1)
        else:
            self._flush_announcements()

    def _flush_announcements(self) -> None:
        pending, self._announcements = self._announcements, []
        for method, ticket in pending:
            if method == "on_dispatch":
                log.info("dispatch", extra=self._fields(ticket))
            self._notify(method, ticket)

    def _grant(self, ticket: Ticket) -> None:
        lane = self._lanes[ticket.lane]
        ticket.state = TicketState.RUNNING
        ticket.generation = lane.generation.get(ticket.model.id, 0)
        ticket.ready_at = self._clock()
        if not ticket.granted.done():
            ticket.granted.set_result(ticket.model.proxy)

    # -- swapping -----------------------------------------------------------------------

    def _begin_swap(self, lane: _Lane, model: ModelConfig) -> None:
        """Start ``model`` on its lane, first stopping what the router says cannot stay
        loaded beside it (llama-swap's groups or matrix; by default everything else)."""
        for other in self._evict(model.id, list(lane.processes)):
            proc = lane.processes.pop(other, None)
            if proc is not None:
                self._stop_process(lane, proc)
        stale = lane.processes.pop(model.id, None)
        if stale is not None:  # dead at grant (see resend), or its definition changed
            self._stop_process(lane, stale)
        lane.stale.discard(model.id)
        lane.swapping = model.id
        lane.swap_aborted = False
        self._queue.lane(lane.name).set_loaded_models(lane.resident())
        lane.swap_task = asyncio.get_running_loop().create_task(
            self._swap(lane, model), name=f"swap-{model.id}"
        )

    def _loaded_changed(self, lane: _Lane) -> None:
        self._queue.lane(lane.name).set_loaded_models(lane.resident())

    def _stop_process(self, lane: _Lane, process: ModelProcessLike) -> asyncio.Task[None]:
        """Stop a process in a task of its own, tracked until it is reaped: every start
        on its lane waits for all of these first (see :meth:`_swap`). ``stop()`` is
        idempotent, so stopping a process twice costs nothing."""

        async def stop() -> None:
            self._notify("on_model_state", process.config.id, ModelState.STOPPING)
            try:
                await process.stop()
            except Exception:
                log.exception("model stop failed", extra={"model": process.config.id})
            finally:
                self._notify("on_model_state", process.config.id, ModelState.STOPPED)

        task = asyncio.get_running_loop().create_task(stop(), name=f"stop-{process.config.id}")
        self._track(lane, task)
        return task

    def _track(self, lane: _Lane, task: asyncio.Task[None]) -> None:
        lane.stops.add(task)
        self._stops.add(task)
        task.add_done_callback(lane.stops.discard)
        task.add_done_callback(self._stops.discard)

    async def _swap(self, lane: _Lane, model: ModelConfig) -> None:
        """Start ``model`` once every process of its lane being stopped has been reaped.
        Always ends with a ``_SwapDone`` event (unless cancelled at shutdown)."""
        started = self._clock()
        process: ModelProcessLike | None = None
        error: ModelStartError | None = None
        try:
            # This lane's stops, and the model's own anywhere (a reload can move a model
            # to another lane: its old process must be gone before the new one starts).
            name = f"stop-{model.id}"
            while pending := lane.stops | {t for t in self._stops if t.get_name() == name}:
                await asyncio.wait(pending)
            if lane.swap_aborted:
                raise ModelStartError(model.id, "unloaded while loading")
            process = self._process_factory(model, self.logs, on_exit=self._process_exited)
            lane.loading = process
            self._notify("on_model_state", model.id, ModelState.STARTING)
            if lane.swap_aborted:
                raise ModelStartError(model.id, "unloaded while loading")
            await process.start()
        except ModelStartError as exc:
            error = exc
        except asyncio.CancelledError:
            lane.loading = None
            if process is not None:
                await asyncio.shield(self._stop_process(lane, process))
            raise
        except Exception as exc:  # a spawn failure (bad cmd) is a start failure too
            error = ModelStartError(model.id, str(exc))
        lane.loading = None
        if error is not None and process is not None:
            self._stop_process(lane, process)
        self._inbox.put_nowait(
            _SwapDone(model.id, None if error else process, error, self._clock() - started, lane.name)
        )

    def _process_exited(self, process: ModelProcessLike) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            self._inbox.put_nowait(_Exited(process))

    def _on_swap_done(self, event: _SwapDone) -> None:
        lane = self._lanes[event.lane]
        aborted = lane.swap_aborted
        lane.swapping = None
        lane.swap_task = None
        lane.swap_aborted = False
        loading = [t for t in lane.running.get(event.model, ()) if t.state is TicketState.LOADING]
        if event.error is None and aborted and event.process is not None:
            # Given up just as the start succeeded: it goes, like any unloaded process.
            self._stop_process(lane, event.process)
            event = _SwapDone(
                event.model, None, ModelStartError(event.model, "unloaded while loading"), event.seconds, lane.name
            )
        if event.error is not None and aborted:
            # Stopped by an unload (or given up by its waiters): the GPU is freed as asked.
            # Whoever still waits for the model keeps its turn (and its place): the model
            # starts again at once, once the stopped process is reaped, as llama-swap starts
            # a model for a request that comes after an unload. The queue is untouched.
            self._loaded_changed(lane)
            self._notify("on_model_state", event.model, ModelState.STOPPED)
            waiters = [t for t in loading if t.outcome is None]  # the others' end is posted
            log.info("load stopped", extra={"model": event.model, "waiting": len(waiters)})
            if waiters and self._closing:
                for ticket in waiters:
                    self._shut_out(ticket)
            elif waiters:
                self._begin_swap(lane, waiters[0].model)
            self._update_idle()
            return
        if event.error is not None:
            self._loaded_changed(lane)
            log.warning(
                "model failed to start", extra={"model": event.model, "cause": event.error.cause}
            )
            self._notify("on_model_state", event.model, ModelState.STOPPED)
            for ticket in loading:
                ticket.load_seconds = event.seconds
                self._fail_start(ticket, event.error)
            # Its waiters fail together now, rather than each retrying the start in turn
            # while every other model's requests wait behind them.
            for ticket in [t for t in self._tickets.values() if t.model.id == event.model]:
                self._queue.cancel(ticket.request_id)
                del self._tickets[ticket.request_id]
                self._fail_start(ticket, event.error)
            self._update_idle()
            return
        assert event.process is not None
        lane.processes[event.model] = event.process
        lane.generation[event.model] = next(self._generations)
        self._loaded_changed(lane)
        self._notify("on_model_state", event.model, ModelState.READY)
        log.info("model ready", extra={"model": event.model, "lane": lane.name, "load_seconds": round(event.seconds, 3)})
        for ticket in loading:
            ticket.load_seconds = event.seconds
            self._grant(ticket)
        # Tickets whose clients left during the load are already DONE; nothing to grant.
        self._schedule_ttl()

    def _shut_out(self, ticket: Ticket) -> None:
        """A loading ticket at shutdown whose load was stopped: 503, its turn over."""
        error = ShuttingDown("the server is shutting down")
        ticket.outcome, ticket.status, ticket.error = Outcome.REJECTED, error.status, str(error)
        ticket.finished_at = self._clock()
        ticket.guard = None
        if not ticket.granted.done():
            ticket.granted.set_exception(error)
            ticket.granted.exception()
        self._end_turn(ticket)

    def _fail_start(self, ticket: Ticket, error: ModelStartError) -> None:
        """A waiting or loading ticket whose model did not start: 503, its turn over."""
        was = ticket.state
        ticket.outcome, ticket.status, ticket.error = Outcome.FAILED, 503, error.cause
        ticket.finished_at = self._clock()
        ticket.guard = None
        if not ticket.granted.done():
            ticket.granted.set_exception(error)
            ticket.granted.exception()
        if was is TicketState.WAITING:
            ticket.state = TicketState.DONE
            self._notify("on_finish", ticket)
        else:
            self._end_turn(ticket)

    def _holder(self, process: ModelProcessLike) -> _Lane | None:
        """The lane whose loaded processes include ``process`` (None: no longer loaded)."""
        for lane in self._lanes.values():
            if lane.processes.get(process.config.id) is process:
                return lane
        return None

    def _on_exited(self, process: ModelProcessLike) -> None:
        lane = self._holder(process)
        if lane is not None:
            log.warning(
                "model process exited",
                extra={"model": process.config.id, "returncode": process.returncode},
            )
            del lane.processes[process.config.id]
            self._loaded_changed(lane)
            self._notify("on_model_state", process.config.id, ModelState.STOPPED)
            # Stop it anyway: stop() of an exited process returns once it is reaped, and
            # the tracked stop keeps any successor from starting before then.
            self._stop_process(lane, process)

    def _on_resend(self, ticket: Ticket) -> None:
        """See :meth:`resend`: the process this ticket was granted to is dead."""
        if ticket.state is not TicketState.RUNNING or ticket.outcome is not None:
            return
        model = ticket.model.id
        lane = self._lanes[ticket.lane]
        ticket.state = TicketState.LOADING
        log.warning("model unreachable at grant; restarting it", extra=self._fields(ticket))
        if lane.swapping == model:
            return  # granted when the load in progress completes
        if lane.ready(model) and lane.generation.get(model) != ticket.generation:
            self._grant(ticket)  # started afresh since this ticket's grant
            return
        ticket.swapped = True
        self._begin_swap(lane, ticket.model)

    def _on_suspect(self, event: _Suspect) -> None:
        lane = self._lanes[event.lane]
        proc = lane.processes.get(event.model)
        if proc is None or lane.generation.get(event.model) != event.generation:
            return  # already gone or replaced
        if lane.checking is not None:
            return
        lane.checking = proc

        async def check() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.exited.wait(), SUSPECT_WAIT)
            self._inbox.put_nowait(_Checked(proc))

        task = asyncio.get_running_loop().create_task(check(), name=f"check-{event.model}")
        self._track(lane, task)  # tracked like a stop: shutdown waits for it

    def _on_checked(self, event: _Checked) -> None:
        for lane in self._lanes.values():
            if lane.checking is event.process:
                lane.checking = None
        if not event.process.alive and self._holder(event.process) is not None:
            # Dead, its exit report not in yet: treat it as exited now.
            self._on_exited(event.process)

    def _on_unhealthy(self, event: _Unhealthy) -> None:
        lane = self._lanes[event.lane]
        proc = lane.processes.get(event.model)
        if proc is None or lane.generation.get(event.model) != event.generation:
            return
        if lane.running.get(event.model):
            return  # others are still being served by it
        log.warning("model stopped answering and failed its health check; stopping it", extra={"model": event.model})
        del lane.processes[event.model]
        self._loaded_changed(lane)
        self._stop_process(lane, proc)

    def _on_unload(self, event: _Unload) -> None:
        """Stop the targeted models, loads in progress included; ``done`` resolves once
        their processes are reaped. A stopped load's requests keep their turn: the model
        starts again for them (:meth:`_on_swap_done`)."""
        targets = event.models
        stops: list[asyncio.Task[None]] = []
        for lane in self._lanes.values():
            for model, proc in list(lane.processes.items()):
                if targets is None or model in targets:
                    del lane.processes[model]
                    stops.append(self._stop_process(lane, proc))
            if lane.swapping is not None and (targets is None or lane.swapping in targets):
                lane.swap_aborted = True
                if lane.loading is not None:
                    stops.append(self._stop_process(lane, lane.loading))
                elif lane.swap_task is not None:
                    stops.append(lane.swap_task)  # it gives up before starting anything
            self._loaded_changed(lane)
        if not stops:
            if not event.done.done():
                event.done.set_result(None)
            return

        def resolve(_: object) -> None:
            if not event.done.done() and all(t.done() for t in stops):
                event.done.set_result(None)

        for task in stops:
            task.add_done_callback(resolve)

    # -- ttl ----------------------------------------------------------------------------

    def _ttl_deadlines(self) -> Iterable[tuple[float, str]]:
        """(unload time, model) of every idle loaded model with a ttl."""
        for lane in self._lanes.values():
            for model, proc in lane.processes.items():
                if proc.config.ttl > 0 and not lane.running.get(model) and lane.swapping is None:
                    yield self._last_used.get(model, 0.0) + proc.config.ttl, model

    def _schedule_ttl(self) -> None:
        """Keep one timer at the earliest idle-unload time."""
        deadline = min((at for at, _ in self._ttl_deadlines()), default=None)
        if deadline == self._ttl_at:
            return
        if self._ttl_handle is not None:
            self._ttl_handle.cancel()
            self._ttl_handle = None
        self._ttl_at = deadline
        if deadline is not None:
            self._ttl_handle = asyncio.get_running_loop().call_later(
                max(0.0, deadline - self._clock()), self._inbox.put_nowait, _Tick()
            )

    def _on_tick(self) -> None:
        self._ttl_handle = None
        self._ttl_at = None
        now = self._clock()
        expired = [model for at, model in self._ttl_deadlines() if at <= now + 1e-3]
        for model in expired:
            idle = now - self._last_used.get(model, 0.0)
            log.info("ttl unload", extra={"model": model, "idle_seconds": round(idle, 1)})
        if expired:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._on_unload(_Unload(tuple(expired), done))
        self._schedule_ttl()

    # -- logging ------------------------------------------------------------------------

    @staticmethod
    def _fields(ticket: Ticket) -> dict[str, object]:
        d = ticket.decision
        fields: dict[str, object] = {
            "request_id": ticket.request_id,
            "model": ticket.model.id,
            "priority": ticket.priority,
            "lane": ticket.lane,
        }
        if d is not None:
            fields.update(
                band=d.band.value,
                score=round(d.score, 3),
                wait_ms=round(d.queue_wait * 1000, 1),
                swap=d.needs_swap,
                reordered_by=sorted(t.value for t in d.reordered_by),
            )
        return fields
