"""The dispatcher's process side: starting, stopping and losing model processes.

:class:`Loads` carries out a strategy's ``Start`` (stop what it evicts, wait until those
are reaped, start the model in a swap task whose result comes back as an event) and
handles what the processes report: a start that failed (its waiters fail together, the
model cools down), an exit, a model unreachable at grant (``resend``), one that broke off
an answer (``suspect``) or stopped answering (``unhealthy``), unloads and ttl expiries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from scheduler.config import ModelConfig
from scheduler.core.admission import (
    abandons,
    start_for,
    ttl_due,
)
from scheduler.dispatch_state import (
    SUSPECT_WAIT,
    Checked,
    DispatcherBase,
    DispatchLane,
    Exited,
    Suspect,
    SwapDone,
    Unhealthy,
    Unload,
)
from scheduler.process import ModelProcessLike, ModelStartError, ModelState
from scheduler.tickets import (
    Outcome,
    ShuttingDown,
    Ticket,
    TicketState,
)

log = logging.getLogger("llamaswap.dispatcher")


class Loads(DispatcherBase):
    """The process side of :class:`scheduler.dispatcher.Dispatcher`."""

    def _begin_swap(
        self, lane: DispatchLane, model: ModelConfig, evict: Iterable[str] | None = None
    ) -> None:
        """Start ``model`` on its lane, first stopping ``evict`` (the strategy's: what the
        router says cannot stay loaded beside it; by default everything else), and its own
        process if it has one (dead at grant, see resend, or its definition changed)."""
        if evict is None:
            evict = self._rules.evict(model.id, list(lane.processes))
        for other in [*evict, model.id]:
            proc = lane.processes.pop(other, None)
            if proc is not None:
                self._stop_process(lane, proc)
        lane.stale.discard(model.id)
        lane.swapping = model.id
        lane.swap_aborted = False
        self._queue.lane(lane.name).set_loaded_models(lane.resident())
        lane.swap_task = asyncio.get_running_loop().create_task(
            self._swap(lane, model), name=f"swap-{model.id}"
        )

    async def _swap(self, lane: DispatchLane, model: ModelConfig) -> None:
        """Start ``model`` once every process of its lane being stopped has been reaped.
        Always ends with a ``SwapDone`` event (unless cancelled at shutdown)."""
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
            SwapDone(
                model.id, None if error else process, error, self._clock() - started, lane.name
            )
        )

    def _process_exited(self, process: ModelProcessLike) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed at shutdown
            self._inbox.put_nowait(Exited(process))

    def _on_swap_done(self, event: SwapDone) -> None:
        lane = self._lanes[event.lane]
        aborted = lane.swap_aborted
        lane.swapping = None
        lane.swap_task = None
        lane.swap_aborted = False
        loading = [t for t in lane.running.get(event.model, ()) if t.state is TicketState.LOADING]
        if event.error is None and aborted and event.process is not None:
            # Given up just as the start succeeded: it goes, like any unloaded process.
            self._stop_process(lane, event.process)
            event = SwapDone(
                event.model,
                None,
                ModelStartError(event.model, "unloaded while loading"),
                event.seconds,
                lane.name,
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
            cooldown = self._queue.settings.start_failure_cooldown
            self._cooldowns.failed(event.model, event.error.cause, self._clock(), cooldown)
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
        self._cooldowns.clear(event.model)
        lane.processes[event.model] = event.process
        lane.generation[event.model] = next(self._generations)
        self._loaded_changed(lane)
        self._notify("on_model_state", event.model, ModelState.READY)
        log.info(
            "model ready",
            extra={
                "model": event.model,
                "lane": lane.name,
                "load_seconds": round(event.seconds, 3),
            },
        )
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

    def _holder(self, process: ModelProcessLike) -> DispatchLane | None:
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
        self._begin_swap(lane, ticket.model, start_for(lane, self._rules, model).evict)

    def _on_suspect(self, event: Suspect) -> None:
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
            self._inbox.put_nowait(Checked(proc))

        task = asyncio.get_running_loop().create_task(check(), name=f"check-{event.model}")
        self._track(lane, task)  # tracked like a stop: shutdown waits for it

    def _on_checked(self, event: Checked) -> None:
        for lane in self._lanes.values():
            if lane.checking is event.process:
                lane.checking = None
        if not event.process.alive and self._holder(event.process) is not None:
            # Dead, its exit report not in yet: treat it as exited now.
            self._on_exited(event.process)

    def _on_unhealthy(self, event: Unhealthy) -> None:
        lane = self._lanes[event.lane]
        proc = lane.processes.get(event.model)
        if proc is None or lane.generation.get(event.model) != event.generation:
            return
        if lane.running.get(event.model):
            return  # others are still being served by it
        log.warning(
            "model stopped answering and failed its health check; stopping it",
            extra={"model": event.model},
        )
        del lane.processes[event.model]
        self._loaded_changed(lane)
        self._stop_process(lane, proc)

    def _on_unload(self, event: Unload) -> None:
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

    def _on_tick(self) -> None:
        self._ttl_handle = None
        self._ttl_at = None
        now = self._clock()
        expired = tuple(
            stop.model for stop in ttl_due(self._lanes.values(), self._rules, self._last_used, now)
        )
        for model in expired:
            idle = now - self._last_used.get(model, 0.0)
            log.info("ttl unload", extra={"model": model, "idle_seconds": round(idle, 1)})
        if expired:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._on_unload(Unload(expired, done))
        self._schedule_ttl()

    def _maybe_abandon_load(self, lane: DispatchLane, model: str) -> None:
        """A load whose waiters all left is given up when other work waits on its lane;
        otherwise it completes and leaves the model loaded for whoever is next."""
        if lane.swap_aborted:
            return
        waiters = sum(t.state is TicketState.LOADING for t in lane.running.get(model, ()))
        if not abandons(lane, self._queue, model, waiters):
            return
        log.info("load abandoned: its requests left and other work waits", extra={"model": model})
        self._abort_load(lane)

    def _abort_load(self, lane: DispatchLane) -> None:
        lane.swap_aborted = True
        if lane.loading is not None:
            self._stop_process(lane, lane.loading)
