"""The dispatcher: the one asyncio task that owns the waiting queue and the model processes.

Events come in through an inbox (a request arrived, its client went away, it finished, a
model became ready or failed or exited, settings changed, an unload was asked for); the
task applies each to its state, asks the pure core (:mod:`scheduler.queue`) which request
goes next, and carries out the effects (grant a request, start or stop a model). Nothing
else touches the queue or the processes, so there are no locks.

Views talk to it through :meth:`Dispatcher.submit` (returns a :class:`Ticket` to await),
:meth:`Dispatcher.finish` and :meth:`Dispatcher.cancel`; all three only post an event.

Serial (the spec's scheduler): exactly one inference request is in flight at a time,
across all models; a swap is part of the picked request's turn. Fifo (llama-swap's):
requests for the ready model are served at once up to its ``concurrencyLimit`` (beyond it
:class:`Overloaded`, a 429); a request that needs a swap waits in the queue; a busy model
is never stopped to make room. In both, at most one model is loaded at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from scheduler.config import Config, ModelConfig
from scheduler.policy import Decision, Policy, QueuedRequest, SchedulerSettings
from scheduler.process import LogBuffer, ModelProcess, ModelStartError, ModelState
from scheduler.queue import WaitingQueue

log = logging.getLogger("llamaswap.dispatcher")


class Overloaded(Exception):
    """fifo: the ready model already serves ``concurrencyLimit`` requests (HTTP 429)."""


class ShuttingDown(Exception):
    """The server is stopping and takes no more work (HTTP 503)."""


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

    async def wait(self) -> str:
        """Wait for this request's turn; returns the upstream base URL.

        Raises :class:`ModelStartError`, :class:`Overloaded` or :class:`ShuttingDown`.
        Cancelled (client gone) → the caller must call :meth:`Dispatcher.cancel`.
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
    process: ModelProcess | None
    error: ModelStartError | None
    seconds: float


@dataclass
class _Exited:
    process: ModelProcess


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
class _Stop:
    pass


@dataclass
class _Drain:
    pass


ProcessFactory = Callable[..., ModelProcess]


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
        self._queue = WaitingQueue(config.scheduler)
        self._tickets: dict[str, Ticket] = {}
        """Waiting tickets by request id."""
        self._inbox: asyncio.Queue[object] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._preload_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._hurry = asyncio.Event()
        self._unloading: set[asyncio.Task[None]] = set()
        self._closing = False
        self._ids = itertools.count(1)
        # Model state, owned by the run task.
        self._process: ModelProcess | None = None
        """The one loaded (or loading) model process."""
        self._swapping: str | None = None
        """Model id being started by a swap task, if any."""
        self._swap_task: asyncio.Task[None] | None = None
        self._running: dict[str, set[Ticket]] = {}
        """Granted or loading tickets by model id."""
        self._last_used: dict[str, float] = {}
        self._ttl_handle: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    # -- the views' side ----------------------------------------------------------------

    @property
    def settings(self) -> SchedulerSettings:
        return self._queue.settings

    @property
    def queue(self) -> WaitingQueue:
        """Read-only use (metrics, dashboard). Only the run task changes it."""
        return self._queue

    def now(self) -> float:
        return self._clock()

    def submit(self, model: ModelConfig, priority: int, request_id: str, path: str) -> Ticket:
        """Put a request in line; await ``ticket.wait()`` for its turn."""
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
        ticket.outcome, ticket.status, ticket.error = outcome, status, error
        ticket.finished_at = self._clock()
        self._inbox.put_nowait(_Finished(ticket))

    def cancel(self, ticket: Ticket) -> None:
        """The client went away before its turn came (or during its model's load)."""
        if ticket.outcome is not None:
            return
        if ticket.state is TicketState.WAITING:
            ticket.outcome = Outcome.CANCELLED_WAITING
        else:
            ticket.outcome = Outcome.CANCELLED_RUNNING
        ticket.finished_at = self._clock()
        self._inbox.put_nowait(_Gone(ticket))

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

    async def unload(self, models: Iterable[str] | None = None) -> None:
        """Stop the given models (all when None); returns when their processes are gone."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(_Unload(tuple(models) if models is not None else None, done))
        await done

    def running_models(self) -> list[dict[str, str]]:
        """llama-swap's /running: the loaded model and its state."""
        proc = self._process
        if proc is None or proc.state is ModelState.STOPPED:
            return []
        return [{"model": proc.config.id, "state": proc.state.name.lower()}]

    def model_state(self) -> tuple[str | None, ModelState]:
        proc = self._process
        if proc is None:
            return None, ModelState.STOPPED
        return proc.config.id, proc.state

    def in_flight(self) -> list[Ticket]:
        return [t for tickets in self._running.values() for t in tickets]

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
        if self._swap_task is not None:
            self._swap_task.cancel()
            with contextlib.suppress(BaseException):
                await self._swap_task
        if self._process is not None:
            await self._process.stop()
            self._process = None
        for task in list(self._unloading):
            with contextlib.suppress(BaseException):
                await task

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
            except Exception:  # never let one bad decision kill the loop
                log.exception("dispatch failed")

    def _handle(self, event: object) -> None:
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
            elif isinstance(event, _Drain):
                self._on_drain()
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

    def _ready_model(self) -> str | None:
        proc = self._process
        if proc is not None and proc.state is ModelState.READY and self._swapping is None:
            return proc.config.id
        return None

    def _busy(self) -> int:
        return sum(len(t) for t in self._running.values())

    def _on_arrived(self, ticket: Ticket) -> None:
        model = ticket.model.id
        if self._fifo and model == self._ready_model() and not self._queue.waiting_for(model):
            limit = ticket.model.concurrency_limit
            if len(self._running.get(model, ())) >= limit:
                ticket.state = TicketState.DONE
                ticket.outcome = Outcome.REJECTED
                ticket.granted.set_exception(
                    Overloaded(f"model {model!r} is serving its concurrencyLimit ({limit}) requests")
                )
                self._notify("on_enqueue", ticket)
                self._notify("on_finish", ticket)
                return
        self._tickets[ticket.request_id] = ticket
        self._queue.add(
            QueuedRequest(ticket.request_id, model, ticket.priority, ticket.arrival)
        )
        self._idle.clear()
        if not ticket.extra.get("preload"):
            self._notify("on_enqueue", ticket)

    def _on_gone(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.WAITING:
            if self._queue.cancel(ticket.request_id) is not None:
                del self._tickets[ticket.request_id]
            ticket.state = TicketState.DONE
            log.info("cancelled while waiting", extra=self._fields(ticket))
            self._notify("on_finish", ticket)
        else:
            # Loading or running: its turn ends now; a load in progress completes and
            # leaves the model loaded for whoever is next.
            self._end_turn(ticket)
        self._update_idle()

    def _on_finished(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.DONE:
            return
        self._end_turn(ticket)
        self._update_idle()

    def _end_turn(self, ticket: Ticket) -> None:
        was = ticket.state
        ticket.state = TicketState.DONE
        running = self._running.get(ticket.model.id)
        if running is not None:
            running.discard(ticket)
            if not running:
                del self._running[ticket.model.id]
        now = self._clock()
        self._last_used[ticket.model.id] = now
        if was is TicketState.LOADING and not ticket.granted.done():
            ticket.granted.cancel()
        if not ticket.extra.get("preload"):
            log.debug("finished", extra={**self._fields(ticket), "outcome": ticket.outcome.value if ticket.outcome else None})
            self._notify("on_finish", ticket)
        self._schedule_ttl()

    def _update_idle(self) -> None:
        if not self._tickets and not self._running:
            self._idle.set()

    # -- deciding -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Grant whatever may run now. Called after every batch of events."""
        if self._swapping is not None or not self._queue:
            return
        if self._fifo:
            self._dispatch_fifo()
        elif not self._running:
            self._start_turn(self._queue.pick(self._clock()))

    def _dispatch_fifo(self) -> None:
        ready = self._ready_model()
        if ready is not None:
            # Requests for the ready model go at once, up to its concurrency limit.
            limit = self.config.models[ready].concurrency_limit
            while len(self._running.get(ready, ())) < limit:
                decision = self._queue.pick(self._clock(), model=ready)
                if decision is None:
                    break
                self._start_turn(decision)
        if not self._running and self._queue:
            # Nothing is busy: the best waiting request may swap the model in.
            self._start_turn(self._queue.pick(self._clock()))

    def _start_turn(self, decision: Decision | None) -> None:
        if decision is None:
            return
        ticket = self._tickets.pop(decision.request_id)
        ticket.decision = decision
        ticket.dispatched_at = self._clock()
        self._running.setdefault(ticket.model.id, set()).add(ticket)
        if self._ttl_handle is not None:
            self._ttl_handle.cancel()
            self._ttl_handle = None
        if ticket.model.id == self._ready_model():
            self._grant(ticket)
        else:
            ticket.state = TicketState.LOADING
            ticket.swapped = True
            self._begin_swap(ticket.model)
        if not ticket.extra.get("preload"):
            log.info("dispatch", extra=self._fields(ticket))
            self._notify("on_dispatch", ticket)

    def _grant(self, ticket: Ticket) -> None:
        ticket.state = TicketState.RUNNING
        ticket.ready_at = self._clock()
        if not ticket.granted.done():
            ticket.granted.set_result(ticket.model.proxy)

    # -- swapping -----------------------------------------------------------------------

    def _begin_swap(self, model: ModelConfig) -> None:
        self._swapping = model.id
        self._queue.set_loaded_model(model.id)
        old = self._process
        self._process = None
        self._swap_task = asyncio.get_running_loop().create_task(
            self._swap(old, model), name=f"swap-{model.id}"
        )

    async def _swap(self, old: ModelProcess | None, model: ModelConfig) -> None:
        started = self._clock()
        if old is not None:
            self._notify("on_model_state", old.config.id, ModelState.STOPPING)
            await old.stop()
            self._notify("on_model_state", old.config.id, ModelState.STOPPED)
        process = self._process_factory(model, self.logs, on_exit=self._process_exited)
        self._notify("on_model_state", model.id, ModelState.STARTING)
        error: ModelStartError | None = None
        try:
            await process.start()
        except ModelStartError as exc:
            error = exc
        except asyncio.CancelledError:
            await process.stop()
            raise
        except Exception as exc:  # a spawn failure (bad cmd) is a start failure too
            error = ModelStartError(model.id, str(exc))
        if error is not None:
            await process.stop()
        self._inbox.put_nowait(
            _SwapDone(model.id, None if error else process, error, self._clock() - started)
        )

    def _process_exited(self, process: ModelProcess) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            self._inbox.put_nowait(_Exited(process))

    def _on_swap_done(self, event: _SwapDone) -> None:
        self._swapping = None
        self._swap_task = None
        loading = [t for t in self._running.get(event.model, ()) if t.state is TicketState.LOADING]
        if event.error is not None:
            self._queue.set_loaded_model(None)
            log.warning(
                "model failed to start", extra={"model": event.model, "cause": event.error.cause}
            )
            self._notify("on_model_state", event.model, ModelState.STOPPED)
            for ticket in loading:
                ticket.load_seconds = event.seconds
                if not ticket.granted.done():
                    ticket.granted.set_exception(event.error)
                    ticket.granted.exception()
            return
        self._process = event.process
        self._notify("on_model_state", event.model, ModelState.READY)
        log.info("model ready", extra={"model": event.model, "load_seconds": round(event.seconds, 3)})
        for ticket in loading:
            ticket.load_seconds = event.seconds
            self._grant(ticket)
        # Tickets whose clients left during the load are already DONE; nothing to grant.
        self._schedule_ttl()

    def _on_exited(self, process: ModelProcess) -> None:
        if process is self._process:
            log.warning(
                "model process exited",
                extra={"model": process.config.id, "returncode": process.returncode},
            )
            self._process = None
            self._queue.set_loaded_model(None)
            self._notify("on_model_state", process.config.id, ModelState.STOPPED)

    def _on_unload(self, event: _Unload) -> None:
        proc = self._process
        targets = event.models
        if proc is None or (targets is not None and proc.config.id not in targets):
            if not event.done.done():
                event.done.set_result(None)
            return
        self._process = None
        self._queue.set_loaded_model(None)

        async def stop() -> None:
            self._notify("on_model_state", proc.config.id, ModelState.STOPPING)
            try:
                await proc.stop()
            finally:
                self._notify("on_model_state", proc.config.id, ModelState.STOPPED)
                if not event.done.done():
                    event.done.set_result(None)

        task = asyncio.get_running_loop().create_task(stop(), name=f"unload-{proc.config.id}")
        self._unloading.add(task)
        task.add_done_callback(self._unloading.discard)

    # -- ttl ----------------------------------------------------------------------------

    def _schedule_ttl(self) -> None:
        proc = self._process
        if proc is None or self._running or self._swapping:
            return
        ttl = proc.config.ttl
        if ttl <= 0:
            return
        if self._ttl_handle is not None:
            self._ttl_handle.cancel()
        self._ttl_handle = asyncio.get_running_loop().call_later(
            ttl, self._inbox.put_nowait, _Tick()
        )

    def _on_tick(self) -> None:
        self._ttl_handle = None
        proc = self._process
        if proc is None or self._running or self._swapping:
            return
        idle = self._clock() - self._last_used.get(proc.config.id, 0.0)
        if idle + 1e-3 >= proc.config.ttl:
            log.info("ttl unload", extra={"model": proc.config.id, "idle_seconds": round(idle, 1)})
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._on_unload(_Unload((proc.config.id,), done))
        else:
            self._schedule_ttl()

    # -- logging ------------------------------------------------------------------------

    @staticmethod
    def _fields(ticket: Ticket) -> dict[str, object]:
        d = ticket.decision
        fields: dict[str, object] = {
            "request_id": ticket.request_id,
            "model": ticket.model.id,
            "priority": ticket.priority,
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
