"""The dispatcher's state and what both its halves share (see :mod:`scheduler.dispatcher`).

The events the run task handles, one lane's state (:class:`DispatchLane`, the shape the
admission strategies read), and :class:`DispatcherBase`: the state the run task owns, the
read-only views of it (``waiting``, ``lanes``, ``model_states``, ...), and the turn's
bookkeeping every handler uses (grant, end a turn, refuse, announce, stop a process, the
ttl timer). Only the run task changes any of it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from scheduler.config import Config, ModelConfig
from scheduler.core.admission import (
    Cooldowns,
    Refuse,
    Strategy,
    next_mean,
    retry_after,
    ttl_deadlines,
)
from scheduler.core.estimate import WaitEstimator
from scheduler.core.lanes import LaneQueues
from scheduler.core.policy import SchedulerSettings
from scheduler.process import LogBuffer, ModelProcess, ModelProcessLike, ModelStartError, ModelState
from scheduler.rules import rules_of
from scheduler.tickets import (
    LaneView,
    Observer,
    Outcome,
    Refused,
    ReloadReport,
    Ticket,
    TicketState,
    refusal_answer,
)

log = logging.getLogger("llamaswap.dispatcher")

SUSPECT_WAIT = 0.5
"""Seconds a model that broke off an answer gets to show it died, before the next request
is sent to it (see :meth:`Dispatcher.suspect`)."""

ANNOUNCE_AFTER = 4
"""Loop turns a dispatch's log line and observer calls wait: the grant settles what
``Ticket.wait`` awaits, which wakes the view on the next turn, which writes the request to
the model (the view may await more on its way there; see :meth:`Dispatcher._announce`)."""


# -- events -----------------------------------------------------------------------------


@dataclass
class Arrived:
    ticket: Ticket


@dataclass
class Gone:
    ticket: Ticket


@dataclass
class Finished:
    ticket: Ticket


@dataclass
class SwapDone:
    model: str
    process: ModelProcessLike | None
    error: ModelStartError | None
    seconds: float
    lane: str


@dataclass
class Exited:
    process: ModelProcessLike


@dataclass
class SettingsChanged:
    settings: SchedulerSettings
    source: str


@dataclass
class Unload:
    models: tuple[str, ...] | None
    done: asyncio.Future[None]


@dataclass
class Tick:
    pass


@dataclass
class Expire:
    pass


@dataclass
class Resend:
    ticket: Ticket


@dataclass
class Suspect:
    model: str
    generation: int
    lane: str


@dataclass
class Checked:
    process: ModelProcessLike


@dataclass
class Unhealthy:
    model: str
    generation: int
    lane: str


@dataclass
class StopLoop:
    pass


@dataclass
class Drain:
    pass


@dataclass
class Reload:
    config: Config
    source: str | None
    done: asyncio.Future[ReloadReport]


@dataclass(eq=False)
class DispatchLane:
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

    def loaded(self) -> list[str]:
        return list(self.processes)


ProcessFactory = Callable[..., ModelProcessLike]
"""Builds a model process: ``ModelProcess`` in production, ``scheduler.testing``'s fake in tests."""


class DispatcherBase:
    """The dispatcher's state (owned by its run task) and the helpers every handler uses."""

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
        self._lanes = {name: DispatchLane(name) for name in self._queue.names}
        self._rules = rules_of(config)
        self._cooldowns = Cooldowns()
        """Models whose start failed lately: their requests fail at once meanwhile."""
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

    @property
    def settings(self) -> SchedulerSettings:
        return self._queue.settings

    @property
    def queue(self) -> LaneQueues:
        """Read-only use (metrics, dashboard). Only the run task changes it."""
        return self._queue

    def now(self) -> float:
        return self._clock()

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
        return [
            t for lane in self._lanes.values() for tickets in lane.running.values() for t in tickets
        ]

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
                started = (
                    ticket.ready_at if ticket.ready_at is not None else ticket.dispatched_at or now
                )
                loading = ticket.state is TicketState.LOADING
                left = max(
                    left,
                    lane.estimator.running_left(
                        ticket.model.id, ticket.decision.band, started, now, loading
                    ),
                )
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

    def _notify(self, method: str, *args: object) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(*args)
            except Exception:
                log.exception("observer failed", extra={"observer": type(observer).__name__})

    @property
    def _strategy(self) -> Strategy:
        return self._rules.strategy(self._queue.settings.use)

    def _lane(self, model: str) -> DispatchLane:
        return self._lanes[self._queue.lane_for(model)]

    def _model(self, model: str) -> ModelConfig:
        """A model's definition: the config's, or a removed one's still being drained."""
        found = self.config.models.get(model) or self._retired.get(model)
        if found is None:
            raise KeyError(model)
        return found

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

    def _refuse_with(self, ticket: Ticket, refusal: Refuse) -> None:
        error, outcome = refusal_answer(refusal.kind, refusal.message, refusal.retry_after)
        self._refuse(ticket, outcome, error)

    def retry_after(self, ahead: int) -> int:
        """Whole seconds until about ``ahead`` requests have been served (see
        :func:`scheduler.core.admission.retry_after`)."""
        return retry_after(ahead, self._service_mean)

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
            self._service_mean = next_mean(self._service_mean, now - ticket.dispatched_at)
            if ticket.ready_at is not None and ticket.decision is not None:
                lane.estimator.finished(
                    ticket.model.id,
                    ticket.decision.band,
                    now - ticket.ready_at,
                    ticket.load_seconds,
                )
        if was is TicketState.LOADING and not ticket.granted.done():
            ticket.granted.cancel()
        if not ticket.extra.get("preload"):
            if log.isEnabledFor(logging.DEBUG):
                outcome = ticket.outcome.value if ticket.outcome else None
                log.debug("finished", extra={**self._fields(ticket), "outcome": outcome})
            self._announce("on_finish", ticket)
        self._schedule_ttl()

    def _update_idle(self) -> None:
        if not self._tickets and not any(lane.running for lane in self._lanes.values()):
            self._idle.set()

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
            ticket.pass_on()  # the view resumes on the next loop turn

    def _loaded_changed(self, lane: DispatchLane) -> None:
        self._queue.lane(lane.name).set_loaded_models(lane.resident())

    def _stop_process(self, lane: DispatchLane, process: ModelProcessLike) -> asyncio.Task[None]:
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

    def _track(self, lane: DispatchLane, task: asyncio.Task[None]) -> None:
        lane.stops.add(task)
        self._stops.add(task)
        task.add_done_callback(lane.stops.discard)
        task.add_done_callback(self._stops.discard)

    def _schedule_ttl(self) -> None:
        """Keep one timer at the earliest idle-unload time."""
        deadlines = ttl_deadlines(self._lanes.values(), self._rules, self._last_used)
        deadline = min((at for at, _, _ in deadlines), default=None)
        if deadline == self._ttl_at:
            return
        if self._ttl_handle is not None:
            self._ttl_handle.cancel()
            self._ttl_handle = None
        self._ttl_at = deadline
        if deadline is not None:
            self._ttl_handle = asyncio.get_running_loop().call_later(
                max(0.0, deadline - self._clock()), self._inbox.put_nowait, Tick()
            )

    @staticmethod
    def _fields(ticket: Ticket) -> dict[str, object]:
        """The key=value fields of a ticket's log lines (built per dispatch: one literal)."""
        d = ticket.decision
        if d is None:
            return {
                "request_id": ticket.request_id,
                "model": ticket.model.id,
                "priority": ticket.priority,
                "lane": ticket.lane,
            }
        return {
            "request_id": ticket.request_id,
            "model": ticket.model.id,
            "priority": ticket.priority,
            "lane": ticket.lane,
            "band": d.band.value,
            "score": round(d.score, 3),
            "wait_ms": round(d.queue_wait * 1000, 1),
            "swap": d.needs_swap,
            "reordered_by": sorted(t.value for t in d.reordered_by) if d.reordered_by else [],
        }
