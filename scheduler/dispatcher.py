"""The dispatcher: the one asyncio task that owns the waiting queue and the model processes.

Events come in through an inbox (a request arrived, its client went away, it finished, a
model became ready or failed or exited, settings changed, an unload was asked for); the
task applies each to its state, asks the admission strategy (:mod:`scheduler.core.admission`,
the same one the simulator replays) what may run, and carries out the effects it returns
(grant a request, start a model evicting others, refuse). Nothing else touches the queue or
the processes, so there are no locks.

The class is split by concern: :mod:`scheduler.dispatch_state` (the state, its read-only
views, a turn's bookkeeping), :mod:`scheduler.loads` (the process side: swaps, exits,
resend, suspect, unload, ttl) and here the views' side, the lifecycle, the run loop,
arrivals, bounds and the decisions.

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
import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from scheduler.config import Config, ModelConfig
from scheduler.core.admission import (
    Dispatch,
    Refusal,
    Start,
    expire,
    expiry_deadline,
    refuse_arrival,
    ttl_deadlines,
)
from scheduler.core.estimate import WaitEstimator
from scheduler.core.lanes import LaneQueues
from scheduler.core.policy import Decision, QueuedRequest, SchedulerSettings
from scheduler.dispatch_state import (
    SUSPECT_WAIT,
    Arrived,
    Checked,
    DispatchLane,
    Drain,
    Exited,
    Expire,
    Finished,
    Gone,
    ProcessFactory,
    Reload,
    Resend,
    SettingsChanged,
    StopLoop,
    Suspect,
    SwapDone,
    Tick,
    Unhealthy,
    Unload,
)
from scheduler.loads import Loads
from scheduler.process import ModelStartError
from scheduler.rules import rules_of
from scheduler.tickets import (
    LaneView,
    Observer,
    Outcome,
    Overloaded,
    QueueFull,
    Refused,
    ReloadReport,
    ShuttingDown,
    Ticket,
    TicketState,
    WaitExpired,
    end_abandoned,
    issue,
)

__all__ = [
    "SUSPECT_WAIT",
    "Dispatcher",
    "LaneView",
    "Observer",
    "Outcome",
    "Overloaded",
    "ProcessFactory",
    "QueueFull",
    "Refused",
    "ReloadReport",
    "ShuttingDown",
    "Ticket",
    "TicketState",
    "WaitExpired",
]

log = logging.getLogger("llamaswap.dispatcher")


class Dispatcher(Loads):
    """Owns the queue and the processes. Create it, ``await start()``, ``await stop()``."""

    # -- the views' side ----------------------------------------------------------------

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
        one log line instead of the GPU (:func:`scheduler.tickets.issue`).
        """
        ticket = issue(
            model,
            priority,
            request_id,
            path,
            (self._clock(), self._wall()),
            owner,
            self._abandoned,
        )
        if self._closing:
            ticket.state = TicketState.DONE
            ticket.outcome = Outcome.REJECTED
            ticket.granted.set_exception(ShuttingDown("the server is shutting down"))
            ticket.granted.exception()  # mark retrieved
            return ticket
        self._inbox.put_nowait(Arrived(ticket))
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
        self._inbox.put_nowait(Finished(ticket))

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
        self._inbox.put_nowait(Gone(ticket))

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
        self._inbox.put_nowait(Resend(ticket))

    def suspect(self, ticket: Ticket) -> None:
        """The model this ticket was granted to broke off its answer (connection reset,
        stream cut): it may be dying. Before the next request goes to it, give its exit
        :data:`SUSPECT_WAIT` seconds to show; a request sent into a dying process's listen
        backlog is reset, and such a request may have reached it, so it is never resent."""
        self._inbox.put_nowait(Suspect(ticket.model.id, ticket.generation, ticket.lane))

    def unhealthy(self, ticket: Ticket) -> None:
        """The model this ticket was granted to stopped answering and failed its health
        check: stop it (the next request for it starts it afresh)."""
        self._inbox.put_nowait(Unhealthy(ticket.model.id, ticket.generation, ticket.lane))

    def _abandoned(self, ticket: Ticket) -> None:
        """The ticket's owner was collected with the ticket open (see :meth:`submit`)."""

        def end() -> None:
            if ticket.state is TicketState.WAITING:
                self.cancel(ticket)
            else:
                self.finish(ticket, Outcome.FAILED, 500, "turn abandoned by its request")

        end_abandoned(ticket, self._loop, end)

    def set_settings(self, settings: SchedulerSettings, source: str = "admin") -> None:
        """New settings from the next pick on (admin edit). Safe to call from any thread
        (the admin's sync views run in a worker thread)."""
        self._post_threadsafe(SettingsChanged(settings, source))

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
        self._inbox.put_nowait(Reload(config, source, done))
        return await done

    async def unload(self, models: Iterable[str] | None = None) -> None:
        """Stop the given models (all when None); returns when their processes are gone."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(Unload(tuple(models) if models is not None else None, done))
        await done

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
        self._inbox.put_nowait(Drain())
        if self._preload_task is not None:
            self._preload_task.cancel()
        idle = asyncio.ensure_future(self._idle.wait())
        hurry = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait((idle, hurry), timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        hurry.cancel()
        if self._task is not None:
            self._inbox.put_nowait(StopLoop())
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
            if isinstance(event, StopLoop):
                return
            alone = False
            if isinstance(event, Finished) and inbox.empty() and not self._queue:
                # Nothing waits, so no grant follows from this turn's end: let the loop
                # go round once first, so that the answer its view just handed to the
                # server goes out before this step (which would otherwise run ahead of
                # the write). Events posted meanwhile queue behind it, in order.
                await asyncio.sleep(0)
                alone = inbox.empty()
            self._handle(event)
            # Apply everything that arrived meanwhile before deciding, so a burst is
            # ordered by the policy rather than by who got into the inbox first.
            while not inbox.empty():
                event = inbox.get_nowait()
                if isinstance(event, StopLoop):
                    return
                self._handle(event)
            try:
                self._dispatch()
                if self._rules.max_wait:
                    self._arm_expiry()
                if self._retiring:
                    self._retire()
            except Exception:  # never let one bad decision kill the loop
                log.exception("dispatch failed")
            if alone:
                # Nothing was granted in this batch, so no view is to go first: tell the
                # observers now (the answer is out already).
                self._flush_announcements()

    def _handle(self, event: object) -> None:
        if self._announcements and not isinstance(event, Arrived):
            # An arrival is about another ticket: it may go first (arrivals stream in
            # during a job change under load).
            self._flush_announcements()
        try:
            if isinstance(event, Arrived):
                self._on_arrived(event.ticket)
            elif isinstance(event, Finished):
                self._on_finished(event.ticket)
            elif isinstance(event, Gone):
                self._on_gone(event.ticket)
            elif isinstance(event, SwapDone):
                self._on_swap_done(event)
            elif isinstance(event, Exited):
                self._on_exited(event.process)
            elif isinstance(event, SettingsChanged):
                self._queue.set_settings(event.settings)
                self.settings_source = event.source
                log.info(
                    "settings changed", extra={"source": event.source, **event.settings.as_dict()}
                )
                self._notify("on_settings", event.settings, event.source)
            elif isinstance(event, Unload):
                self._on_unload(event)
            elif isinstance(event, Tick):
                self._on_tick()
            elif isinstance(event, Resend):
                self._on_resend(event.ticket)
            elif isinstance(event, Expire):
                self._on_expire()
            elif isinstance(event, Suspect):
                self._on_suspect(event)
            elif isinstance(event, Checked):
                self._on_checked(event)
            elif isinstance(event, Unhealthy):
                self._on_unhealthy(event)
            elif isinstance(event, Drain):
                self._on_drain()
            elif isinstance(event, Reload):
                self._on_reload(event)
        except Exception:
            log.exception("dispatcher event failed", extra={"event": type(event).__name__})

    def _on_arrived(self, ticket: Ticket) -> None:
        model = ticket.model.id
        lane = self._lane(model)
        ticket.lane = lane.name
        queued = QueuedRequest(ticket.request_id, model, ticket.priority, ticket.arrival)
        preload = bool(ticket.extra.get("preload"))
        now = self._clock()
        cause = None if preload else self._cooldowns.cause(model, now)
        if cause is not None:  # startFailureCooldown: no new start per request
            self._notify("on_enqueue", ticket)
            self._fail_start(ticket, ModelStartError(model, cause))
            return
        refusal = refuse_arrival(
            self._strategy, lane, self._queue, self._rules, queued, self._service_mean, preload
        )
        if refusal is not None:
            self._notify("on_enqueue", ticket)
            self._refuse_with(ticket, refusal)
            if refusal.kind is Refusal.QUEUE_FULL:
                log.warning("queue full", extra=self._fields(ticket))
            return
        self._tickets[ticket.request_id] = ticket
        self._queue.add(queued)
        lane.estimator.arrived(queued)
        self._idle.clear()
        if not preload:
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

    # -- bounds -------------------------------------------------------------------------

    def _arm_expiry(self) -> None:
        """Keep one timer at the earliest maxWait deadline: the oldest of each band."""
        deadline = expiry_deadline(self._queue, self._rules)
        if deadline == self._expire_at:
            return
        if self._expire_handle is not None:
            self._expire_handle.cancel()
            self._expire_handle = None
        self._expire_at = deadline
        if deadline is not None:
            self._expire_handle = asyncio.get_running_loop().call_later(
                max(0.0, deadline - self._clock()), self._inbox.put_nowait, Expire()
            )

    def _on_expire(self) -> None:
        self._expire_handle = None
        self._expire_at = None
        now = self._clock()
        for refusal in expire(self._queue, self._rules, now, self._service_mean):
            ticket = self._tickets.pop(refusal.request_id)
            self._refuse_with(ticket, refusal)
            waited = round(now - ticket.arrival, 1)
            log.warning("wait expired", extra={**self._fields(ticket), "waited_s": waited})
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

    def _on_reload(self, event: Reload) -> None:
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
            self._lanes.setdefault(name, DispatchLane(name))
        for ticket in self._tickets.values():  # arrival order: dicts keep insertion order
            if ticket.model.id in new.models:
                ticket.model = new.models[ticket.model.id]
            ticket.lane = queue.add(
                QueuedRequest(ticket.request_id, ticket.model.id, ticket.priority, ticket.arrival)
            )
        self.config = new
        self._rules = rules_of(new, self._retired)
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
            extra={
                "added": list(added),
                "removed": list(removed),
                "changed": list(changed),
                "kept": len(kept),
            },
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

    # -- deciding -----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Grant whatever may run now, lane by lane, as the strategy says (serial or
        fifo, :mod:`scheduler.core.admission`). Called after every batch of events."""
        if not self._queue:
            return
        strategy = self._strategy
        for lane in self._lanes.values():
            if lane.checking is not None or not self._queue.lane(lane.name):
                continue
            for effect in strategy.dispatch(lane, self._queue, self._rules, self._clock()):
                if isinstance(effect, Dispatch):
                    self._start_turn(lane, effect.decision)
                elif isinstance(effect, Start):
                    self._begin_swap(lane, self._model(effect.model), effect.evict)

    def _start_turn(self, lane: DispatchLane, decision: Decision) -> None:
        """A turn begins: granted now if its model is ready, else when its load ends
        (the strategy's :class:`Start` follows when nothing is loading it yet)."""
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
        if not ticket.extra.get("preload"):
            self._announce("on_dispatch", ticket)

    def model_timers(self) -> dict[str, tuple[float | None, float | None, str | None]]:
        """For the models page (read-only): model id -> (seconds idle since its last request
        ended, while loaded and idle; seconds until its ttl unloads it; the start failure
        it cools down from, ``startFailureCooldown``). Models with none of these are absent."""
        now = self._clock()
        out: dict[str, tuple[float | None, float | None, str | None]] = {}
        ttl_at = {
            model: at
            for at, _, model in ttl_deadlines(self._lanes.values(), self._rules, self._last_used)
        }
        for lane in self._lanes.values():
            for model in lane.loaded():
                if not lane.running.get(model) and model in self._last_used:
                    left = ttl_at.get(model)
                    out[model] = (
                        now - self._last_used[model],
                        None if left is None else max(0.0, left - now),
                        None,
                    )
        for model in self.config.models:
            cause = self._cooldowns.cause(model, now)
            if cause is not None:
                idle, left, _ = out.get(model, (None, None, None))
                out[model] = (idle, left, cause)
        return out

    def queue_views(self) -> tuple[Mapping[str, Ticket], Mapping[str, WaitEstimator]]:
        """Read-only, for the queue page (dashboard/queue.py): the waiting tickets by
        request id, and each lane's wait estimator. O(1); views, never copies."""
        estimators = {name: lane.estimator for name, lane in self._lanes.items()}
        return MappingProxyType(self._tickets), MappingProxyType(estimators)
