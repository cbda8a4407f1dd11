"""The admission machine: the dispatcher's decisions as a pure state machine.

It keeps what the dispatcher keeps about each lane (the waiting queue, the turns by
model, the loaded models, the load in progress), takes the same events (a request
arrived, finished or left; a model became ready, failed to start or exited; a granted
turn resent because its model died under it; a load given up by its waiters gone; a
reload that changed models; the timer; new settings) and answers with the same effects,
decided by the same strategies and rules (:mod:`scheduler.core.admission`). The simulator (:mod:`scheduler.core.simulate`) drives
it on a virtual clock with recorded load and service times; the strategy tests drive it
by hand.

Effects: :class:`~scheduler.core.admission.Dispatch`, ``Start``, ``Stop``, ``Refuse``,
``Abort`` from the strategies and rules, and :class:`Grant` (a turn's model is ready: it
goes upstream now).

Pure: no Django, asyncio, network or clock reads; ``now`` is always an argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from scheduler.core.admission import (
    Abort,
    Cooldowns,
    Dispatch,
    Effect,
    Refusal,
    Refuse,
    Rules,
    Start,
    Stop,
    Strategy,
    abandons,
    expire,
    expiry_deadline,
    next_mean,
    refuse_arrival,
    start_for,
    ttl_deadlines,
    ttl_due,
)
from scheduler.core.lanes import LaneQueues
from scheduler.core.policy import QueuedRequest, SchedulerSettings


@dataclass(frozen=True, slots=True)
class Grant:
    """The turn's model is ready: the request goes upstream now."""

    request_id: str
    lane: str


MachineEffect = Effect | Grant


@dataclass(eq=False)
class SimLane:
    """One lane's state in the machine (the shape :class:`LaneState` reads)."""

    name: str
    running: dict[str, set[str]] = field(default_factory=dict)
    """Model -> request ids of its turns (granted or waiting for the load)."""
    models: dict[str, None] = field(default_factory=dict)
    """Loaded (ready) models, in the order they were started."""
    swapping: str | None = None
    stale: set[str] = field(default_factory=set)
    """Loaded models whose definition changed (:meth:`Machine.reload`): no new turns,
    stopped once their running ones end."""
    turns: int = 0
    """How many turns ``running`` holds (kept, not counted: the simulator asks often)."""

    def ready(self, model: str) -> bool:
        return model in self.models and self.swapping != model and model not in self.stale

    def loaded(self) -> list[str]:
        return list(self.models)

    def resident(self) -> list[str]:
        return [*self.models, *([self.swapping] if self.swapping else [])]

    def busy(self) -> int:
        return self.turns


@dataclass(slots=True)
class _Turn:
    lane: str
    model: str
    dispatched: float
    loading: bool


class Machine:
    """Admission on every lane, driven by events; each method returns the effects."""

    def __init__(
        self,
        settings: SchedulerSettings,
        rules: Rules | None = None,
        lane_of: Mapping[str, str] | None = None,
        lanes: Iterable[str] = (),
    ) -> None:
        self.rules = rules or Rules()
        self.queues = LaneQueues(settings, lane_of, lanes)
        self.lanes = {name: SimLane(name) for name in self.queues.names}
        self._pairs = [(lane, self.queues.lane(name)) for name, lane in self.lanes.items()]
        self._lane_list = list(self.lanes.values())
        self.cooldowns = Cooldowns()
        self.last_used: dict[str, float] = {}
        self.service_mean: float | None = None
        self._turns: dict[str, _Turn] = {}
        self._waiting: dict[str, QueuedRequest] = {}
        self._strategy = self.rules.strategy(settings.use)
        self.timed = bool(self.rules.max_wait) or any(
            r.ttl > 0 for r in (self.rules.default, *self.rules.models.values())
        )
        """Whether :meth:`tick` can ever have anything to do."""

    @property
    def settings(self) -> SchedulerSettings:
        return self.queues.settings

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def set_settings(self, settings: SchedulerSettings) -> None:
        self.queues.set_settings(settings)
        self._strategy = self.rules.strategy(settings.use)

    def lane_of(self, model: str) -> SimLane:
        return self.lanes[self.queues.lane_for(model)]

    # -- events ---------------------------------------------------------------------------

    def arrive(
        self, now: float, request: QueuedRequest, preload: bool = False
    ) -> list[MachineEffect]:
        """A request arrived: refused at once, or queued (the next :meth:`decide` may
        dispatch it)."""
        queues = self.queues
        lane = self.lanes[queues.lane_for(request.model)]
        refusal = None if preload or not self.cooldowns else self.cooldowns.refuse(request, now)
        if refusal is None and (self._strategy.refuses or self.rules.max_queue_depth is not None):
            refusal = refuse_arrival(
                self._strategy, lane, queues, self.rules, request, self.service_mean, preload
            )
        if refusal is not None:
            return [refusal]
        queues.add(request)
        self._waiting[request.request_id] = request
        return []

    def finish(self, now: float, request_id: str, completed: bool = True) -> list[MachineEffect]:
        """A turn ended (answered, failed, or its client left); a waiting request that
        ends leaves the queue, undispatched. The last turn waiting for a load that leaves
        gives the load up when other work waits (:class:`Abort`, then :meth:`aborted`);
        a changed model with no turn left is stopped (:meth:`reload`)."""
        turn = self._turns.pop(request_id, None)
        if turn is None:
            if self._waiting.pop(request_id, None) is not None:
                self.queues.cancel(request_id)
            return []
        lane = self.lanes[turn.lane]
        running = lane.running.get(turn.model)
        if running is not None and request_id in running:
            running.discard(request_id)
            lane.turns -= 1
            if not running:
                del lane.running[turn.model]
        self.last_used[turn.model] = now
        if completed:
            self.service_mean = next_mean(self.service_mean, now - turn.dispatched)
        if turn.loading and abandons(
            lane, self.queues, turn.model, len(lane.running.get(turn.model, ()))
        ):
            return [Abort(lane.name, turn.model)]
        return self._retire(lane) if lane.stale else []

    def aborted(self, now: float, lane_name: str, model: str) -> None:
        """The load given up by an :class:`Abort` is gone: the lane is free, the model not
        loaded."""
        lane = self.lanes[lane_name]
        if lane.swapping == model:
            lane.swapping = None
            self._loaded_changed(lane)

    def resend(self, now: float, request_id: str) -> list[MachineEffect]:
        """The granted turn never reached its model: the process died under it. The turn
        goes on, waiting for the model again: it joins the load in progress if that is its
        model's, else the model is started afresh (its dead process among the evicted)."""
        turn = self._turns.get(request_id)
        if turn is None or turn.loading:
            return []
        turn.loading = True
        lane = self.lanes[turn.lane]
        if lane.swapping == turn.model:
            return []
        start = start_for(lane, self.rules, turn.model)
        self._start(lane, start)
        return [start]

    def reload(self, now: float, changed: Iterable[str]) -> list[MachineEffect]:
        """The config changed these models' definitions: where loaded they take no new
        turn (their requests wait for a fresh start) and stop once their turns end."""
        changed = set(changed)
        out: list[MachineEffect] = []
        for lane in self.lanes.values():
            lane.stale |= changed & set(lane.models)
            if lane.stale:
                out += self._retire(lane)
        return out

    def _retire(self, lane: SimLane) -> list[MachineEffect]:
        out: list[MachineEffect] = []
        for model in sorted(lane.stale):
            if lane.running.get(model) or lane.swapping == model:
                continue
            lane.stale.discard(model)
            if model in lane.models:
                del lane.models[model]
                out.append(Stop(lane.name, model, "reload"))
        if out:
            self._loaded_changed(lane)
        return out

    def ready(self, now: float, lane_name: str, model: str) -> list[MachineEffect]:
        """The load in progress on ``lane_name`` completed: its turns are granted."""
        lane = self.lanes[lane_name]
        lane.swapping = None
        lane.models[model] = None
        self.cooldowns.clear(model)
        grants: list[MachineEffect] = []
        for request_id in sorted(lane.running.get(model, ())):
            turn = self._turns[request_id]
            if turn.loading:
                turn.loading = False
                grants.append(Grant(request_id, lane_name))
        return grants

    def failed(self, now: float, lane_name: str, model: str, cause: str) -> list[MachineEffect]:
        """The load in progress failed: its turns and every request waiting for the model
        fail now, together, and the model cools down (``startFailureCooldown``)."""
        lane = self.lanes[lane_name]
        lane.swapping = None
        self._loaded_changed(lane)
        self.cooldowns.failed(model, cause, now, self.settings.start_failure_cooldown)
        out: list[MachineEffect] = []
        failed = sorted(lane.running.pop(model, ()))
        lane.turns -= len(failed)
        for request_id in failed:
            del self._turns[request_id]
            out.append(Refuse(request_id, Refusal.START_FAILED, cause))
        for request in [r for r in self._waiting.values() if r.model == model]:
            del self._waiting[request.request_id]
            self.queues.cancel(request.request_id)
            out.append(Refuse(request.request_id, Refusal.START_FAILED, cause))
        return out

    def exited(self, lane_name: str, model: str) -> None:
        """A loaded model's process went away; its next request starts it again."""
        lane = self.lanes[lane_name]
        lane.models.pop(model, None)
        self._loaded_changed(lane)

    def _loaded_changed(self, lane: SimLane) -> None:
        self.queues.lane(lane.name).set_loaded_models(lane.resident())

    def tick(self, now: float) -> list[MachineEffect]:
        """The timer: requests past their ``maxWait`` are refused, idle models past their
        ``ttl`` stopped."""
        out: list[MachineEffect] = []
        if self.rules.max_wait:
            for refusal in expire(self.queues, self.rules, now, self.service_mean):
                del self._waiting[refusal.request_id]
                out.append(refusal)
        for stop in ttl_due(self.lanes.values(), self.rules, self.last_used, now):
            lane = self.lanes[stop.lane]
            lane.models.pop(stop.model, None)
            self._loaded_changed(lane)
            out.append(stop)
        return out

    def deadline(self) -> float | None:
        """When :meth:`tick` has something to do next (None: nothing armed)."""
        if not self.timed:
            return None
        at = expiry_deadline(self.queues, self.rules) if self.rules.max_wait else None
        for when, _, _ in ttl_deadlines(self.lanes.values(), self.rules, self.last_used):
            at = when if at is None or when < at else at
        return at

    def settled(self) -> bool:
        """Whether no lane can take a request that arrives before the next other event
        (the strategies' :meth:`~scheduler.core.admission.SerialStrategy.settled`): the
        simulator then queues the arrivals up to that event without deciding between."""
        settled, rules = self._strategy.settled, self.rules
        return all([settled(lane, rules) for lane in self._lane_list])  # lanes are few

    def decide(self, now: float) -> list[MachineEffect]:
        """After a batch of events: what each lane's strategy dispatches and starts."""
        out: list[MachineEffect] = []
        queues = self.queues
        if not queues:
            return out
        dispatch, rules = self._strategy.dispatch, self.rules
        for lane, queue in self._pairs:
            if not queue:
                continue
            effects = dispatch(lane, queues, rules, now)
            if effects:
                self._apply(lane, effects, now, out)
        return out

    def _apply(
        self, lane: SimLane, effects: list[Effect], now: float, out: list[MachineEffect]
    ) -> None:
        for effect in effects:
            out.append(effect)
            kind = type(effect)
            if kind is Dispatch:
                assert isinstance(effect, Dispatch)
                decision = effect.decision
                rid, model = decision.request_id, decision.model
                del self._waiting[rid]
                loading = not lane.ready(model)
                self._turns[rid] = _Turn(lane.name, model, now, loading)
                lane.running.setdefault(model, set()).add(rid)
                lane.turns += 1
                if not loading:
                    out.append(Grant(rid, lane.name))
            elif kind is Start:
                assert isinstance(effect, Start)
                self._start(lane, effect)
            elif isinstance(effect, Stop):  # pragma: no cover - strategies do not stop
                lane.models.pop(effect.model, None)

    def _start(self, lane: SimLane, start: Start) -> None:
        for other in start.evict:
            lane.models.pop(other, None)
            lane.stale.discard(other)
        lane.stale.discard(start.model)
        lane.swapping = start.model
        self._loaded_changed(lane)
