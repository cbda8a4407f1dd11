"""Admission: who may run next on a lane, as strategies that return effects.

One source of truth for every admission decision, driven by two owners of the same state:
the dispatcher (real processes and clocks, :mod:`scheduler.dispatcher`) and the machine
(a virtual clock, :mod:`scheduler.core.machine`, under the simulator, the what-if page,
the advisor and ``simulate --from-history``). Both keep, per lane, the shape
:class:`LaneState` reads; both call the same functions here and carry out what they
return:

* :class:`SerialStrategy` / :class:`FifoStrategy` (``routing.scheduler.use``): on
  arrival, whether the request is refused at once (fifo's ``concurrencyLimit``); after
  every batch of events, which waiting requests of a lane get their turn
  (:class:`Dispatch`) and which model is started for them, evicting what the router
  (groups, matrix) says cannot stay beside it (:class:`Start`).
* the bounds: ``maxQueueDepth`` on arrival (:func:`refuse_arrival`), ``maxWait``
  (:func:`expire`, :func:`expiry_deadline`).
* ``ttl``: idle models to unload (:func:`ttl_deadlines`, :func:`ttl_due`).
* failed starts: :class:`Cooldowns` (``startFailureCooldown``).

Pure: no Django, asyncio, network or clock reads; ``now`` is always an argument.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from scheduler.core.lanes import LaneQueues, fill_slots
from scheduler.core.policy import Decision, Policy, QueuedRequest
from scheduler.core.priority import Band

Evict = Callable[[str, Collection[str]], tuple[str, ...]]
"""The router's rule (:mod:`scheduler.core.swapper`): which resident models a model's
start stops."""


def one_at_a_time(target: str, resident: Collection[str]) -> tuple[str, ...]:
    """llama-swap's ``(default)`` group: a start stops every other model of its lane."""
    return tuple(m for m in resident if m != target)


@dataclass(frozen=True, slots=True)
class ModelRules:
    """What the config says about admitting one model's requests."""

    slots: int = 1
    """Requests of the model its lane may run at once (serial)."""
    concurrency_limit: int = 1
    """fifo: requests a ready model serves at once; beyond it the next is refused."""
    ttl: float = 0.0
    """Seconds idle before the model is unloaded (0: never)."""


DEFAULT_RULES = ModelRules()


@dataclass(frozen=True)
class Rules:
    """The config's admission rules: per model, the router, the bounds."""

    models: Mapping[str, ModelRules] = field(default_factory=lambda: MappingProxyType({}))
    evict: Evict = one_at_a_time
    max_queue_depth: int | None = None
    max_wait: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Band value -> most seconds a request of that band may wait."""
    default: ModelRules = DEFAULT_RULES
    """For a model the mapping does not name."""
    fifo_limits: bool = True
    """``use: fifo`` admits as llama-swap does (:class:`FifoStrategy`, by
    ``concurrencyLimit``), as the server does. False (the simulator given no config):
    fifo is only the queue's order on a GPU that runs one request at a time."""

    def strategy(self, use: Policy) -> Strategy:
        if use is Policy.FIFO and not self.fifo_limits:
            return STRATEGIES[Policy.SERIAL]
        return STRATEGIES[use]

    def of(self, model: str) -> ModelRules:
        return self.models.get(model, self.default)


class LaneState(Protocol):
    """One lane as its owner keeps it (the dispatcher's ``DispatchLane``, the machine's
    :class:`~scheduler.core.machine.SimLane`). Read only here."""

    @property
    def name(self) -> str: ...
    @property
    def running(self) -> Mapping[str, Collection[object]]:
        """Models with turns granted or loading, and those turns."""
        ...

    @property
    def swapping(self) -> str | None:
        """The model being started (one load per lane at a time)."""
        ...

    @property
    def stale(self) -> Collection[str]:
        """Loaded models that take no new request (their definition changed)."""
        ...

    def ready(self, model: str) -> bool: ...
    def loaded(self) -> list[str]:
        """Models started (ready or not) on the lane, not the one loading."""
        ...

    def resident(self) -> list[str]:
        """Models loaded or loading."""
        ...

    def busy(self) -> int: ...


# -- effects ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A waiting request's turn begins: granted now if its model is ready, else once the
    load in progress (or the :class:`Start` that follows) completes."""

    lane: str
    decision: Decision
    starts_load: bool = False
    """This turn is the one a :class:`Start` right after it loads the model for."""


@dataclass(frozen=True, slots=True)
class Start:
    """Start ``model`` on ``lane`` once ``evict`` (stopped first) are gone."""

    lane: str
    model: str
    evict: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop a loaded model (``reason``: ``ttl``)."""

    lane: str
    model: str
    reason: str


@dataclass(frozen=True, slots=True)
class Abort:
    """Give up the load of ``model`` on ``lane`` (:func:`abandons`): its process is
    stopped and the lane is free once it is gone."""

    lane: str
    model: str


class Refusal(enum.Enum):
    """Why a request is answered without its turn."""

    OVERLOADED = "overloaded"
    """fifo: the model holds its ``concurrencyLimit`` requests, waiting or served (429)."""
    QUEUE_FULL = "queue_full"
    """``maxQueueDepth`` requests wait already (429)."""
    EXPIRED = "expired"
    """It waited its band's ``maxWait`` (503)."""
    START_FAILED = "start_failed"
    """Its model failed to start (503 with the cause): at once during the cool-down."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """Answer ``request_id`` without a turn."""

    request_id: str
    kind: Refusal
    message: str
    retry_after: int | None = None


Effect = Dispatch | Start | Stop | Refuse | Abort


# -- shared arithmetic ---------------------------------------------------------------------


def retry_after(ahead: int, service_mean: float | None) -> int:
    """Whole seconds until about ``ahead`` requests have been served, from the measured
    mean time per request (1 s before anything has been measured); at least 1."""
    mean = service_mean if service_mean is not None else 1.0
    return max(1, min(3600, math.ceil(ahead * mean)))


def next_mean(mean: float | None, took: float) -> float:
    """The moving average of seconds from dispatch to finish, after one more."""
    return took if mean is None else mean + 0.1 * (took - mean)


# -- the strategies ------------------------------------------------------------------------


class SerialStrategy:
    """The spec's scheduler, per lane: one request at a time, picked by score; with
    ``slots: N`` up to N of the running model's while the lane's best waiting request is
    for it (:func:`~scheduler.core.lanes.fill_slots`); otherwise the lane drains before
    it swaps, and a swap is part of the picked request's turn."""

    use = Policy.SERIAL
    refuses = False
    """Whether :meth:`refuse` can refuse (the machine skips asking otherwise)."""

    def refuse(
        self, lane: LaneState, queues: LaneQueues, rules: Rules, request: QueuedRequest
    ) -> Refuse | None:
        return None

    def dispatch(
        self, lane: LaneState, queues: LaneQueues, rules: Rules, now: float
    ) -> list[Effect]:
        effects: list[Effect] = []
        busy = lane.busy()
        if busy == 0:
            if lane.swapping is not None:
                return effects  # a load nobody waits for any more settles first
            decision = queues.pick(now, lane.name)
            if decision is None:
                return effects
            _turn(lane, rules, decision, effects)
            model, busy = decision.model, 1
        else:
            model = next(iter(lane.running))
        slots = rules.of(model).slots
        if slots > 1 and busy < slots and model not in lane.stale:
            for decision in fill_slots(queues, lane.name, now, model, busy, slots):
                effects.append(Dispatch(lane.name, decision))
        return effects

    def settled(self, lane: LaneState, rules: Rules) -> bool:
        """Whether :meth:`dispatch` returns nothing until something other than an
        arrival happens on the lane: a load runs with no turn, or the running model takes
        no more turns (one slot, its slots full, or stale)."""
        busy = lane.busy()
        if busy == 0:
            return lane.swapping is not None
        model = next(iter(lane.running))
        slots = rules.of(model).slots
        return slots <= 1 or busy >= slots or model in lane.stale


class FifoStrategy:
    """llama-swap's: requests for a ready model go at once up to its
    ``concurrencyLimit``; the first request for any other model starts a swap once every
    model that swap would stop is idle (a busy model is never stopped). A model's limit
    counts its requests waiting and served together, as llama-swap's admission does: one
    more is refused at once (a 429), so a burst while it loads is cut at the limit too."""

    use = Policy.FIFO
    refuses = True

    def refuse(
        self, lane: LaneState, queues: LaneQueues, rules: Rules, request: QueuedRequest
    ) -> Refuse | None:
        model = request.model
        limit = rules.of(model).concurrency_limit
        held = len(lane.running.get(model, ())) + queues.waiting_for(model)
        if held < limit:
            return None
        return Refuse(
            request.request_id,
            Refusal.OVERLOADED,
            f"model {model!r} has its concurrencyLimit ({limit}) requests waiting or served",
            1,
        )

    def dispatch(
        self, lane: LaneState, queues: LaneQueues, rules: Rules, now: float
    ) -> list[Effect]:
        effects: list[Effect] = []
        added: dict[str, int] = {}
        for model in lane.loaded():
            if not lane.ready(model):
                continue
            limit = rules.of(model).concurrency_limit
            count = len(lane.running.get(model, ()))
            while count < limit:
                decision = queues.pick(now, lane.name, model=model)
                if decision is None:
                    break
                effects.append(Dispatch(lane.name, decision))
                count += 1
            added[model] = count
        if lane.swapping is not None:
            return effects
        nxt = queues.lane(lane.name).next_model()
        if nxt is None or lane.ready(nxt) or lane.running.get(nxt):
            return effects  # (a model with running requests but not ready: changed, draining)
        resident = lane.resident()
        if any(added.get(m) or lane.running.get(m) for m in rules.evict(nxt, resident)):
            return effects
        decision = queues.pick(now, lane.name)
        if decision is not None:
            _turn(lane, rules, decision, effects)
        return effects

    def settled(self, lane: LaneState, rules: Rules) -> bool:
        """Whether :meth:`dispatch` returns nothing until something other than an
        arrival happens on the lane: a swap is under way and every ready model serves
        its ``concurrencyLimit``."""
        if lane.swapping is None:
            return False
        return all(
            len(lane.running.get(m, ())) >= rules.of(m).concurrency_limit
            for m in lane.loaded()
            if lane.ready(m)
        )


Strategy = SerialStrategy | FifoStrategy
STRATEGIES: Mapping[Policy, Strategy] = MappingProxyType(
    {Policy.SERIAL: SerialStrategy(), Policy.FIFO: FifoStrategy()}
)


def _turn(lane: LaneState, rules: Rules, decision: Decision, effects: list[Effect]) -> None:
    """A picked request's turn; its model started for it unless ready or loading."""
    model = decision.model
    if lane.ready(model) or lane.swapping == model:
        effects.append(Dispatch(lane.name, decision))
        return
    effects.append(Dispatch(lane.name, decision, starts_load=True))
    effects.append(start_for(lane, rules, model))


def start_for(lane: LaneState, rules: Rules, model: str) -> Start:
    """Start ``model`` on its lane, evicting what the router says cannot stay beside it,
    and its own process if it has one (dead at grant, see resend, or its definition
    changed: restarted)."""
    loaded = lane.loaded()
    evict = tuple(m for m in rules.evict(model, loaded) if m != model)
    if model in loaded:
        evict += (model,)
    return Start(lane.name, model, evict)


def abandons(lane: LaneState, queues: LaneQueues, model: str, waiters: int) -> bool:
    """Whether the load of ``model`` is given up (:class:`Abort`) when a turn waiting for
    it leaves and ``waiters`` turns still wait for it: only when none does and other work
    waits on its lane; otherwise it completes and leaves the model loaded for whoever is
    next."""
    if lane.swapping != model or waiters:
        return False
    queue = queues.lane(lane.name)
    return bool(queue) and not queue.waiting_for(model)


# -- arrival and the bounds ----------------------------------------------------------------


def refuse_arrival(
    strategy: Strategy,
    lane: LaneState,
    queues: LaneQueues,
    rules: Rules,
    request: QueuedRequest,
    service_mean: float | None,
    preload: bool = False,
) -> Refuse | None:
    """Whether a request is answered at once instead of queued: the strategy's limit,
    then ``maxQueueDepth`` (never for a preload)."""
    refusal = strategy.refuse(lane, queues, rules, request)
    if refusal is not None:
        return refusal
    depth = rules.max_queue_depth
    if depth is not None and len(queues) >= depth and not preload:
        return Refuse(
            request.request_id,
            Refusal.QUEUE_FULL,
            f"the queue is full: {len(queues)} requests are waiting (maxQueueDepth {depth})",
            retry_after(1, service_mean),
        )
    return None


def expiry_deadline(queues: LaneQueues, rules: Rules) -> float | None:
    """The earliest ``maxWait`` deadline: the oldest request of each bounded band."""
    deadline = None
    for band, limit in rules.max_wait.items():
        oldest = queues.oldest(Band(band))
        if oldest is not None:
            at = oldest.arrival + limit
            deadline = at if deadline is None or at < deadline else deadline
    return deadline


def expire(
    queues: LaneQueues, rules: Rules, now: float, service_mean: float | None
) -> list[Refuse]:
    """Take out of the queue every request that has waited its band's ``maxWait``."""
    out: list[Refuse] = []
    for band, limit in rules.max_wait.items():
        while True:
            oldest = queues.oldest(Band(band))
            if oldest is None or now - oldest.arrival < limit - 1e-6:
                break
            queues.cancel(oldest.request_id)
            waited = now - oldest.arrival
            out.append(
                Refuse(
                    oldest.request_id,
                    Refusal.EXPIRED,
                    f"waited {waited:.0f}s without being served (maxWait for {band}: {limit:g}s)",
                    retry_after(len(queues) + 1, service_mean),
                )
            )
    return out


def ttl_deadlines(
    lanes: Iterable[LaneState], rules: Rules, last_used: Mapping[str, float]
) -> Iterator[tuple[float, str, str]]:
    """(unload time, lane, model) of every idle loaded model with a ttl."""
    for lane in lanes:
        if lane.swapping is not None:
            continue
        for model in lane.loaded():
            ttl = rules.of(model).ttl
            if ttl > 0 and not lane.running.get(model):
                yield last_used.get(model, 0.0) + ttl, lane.name, model


def ttl_due(
    lanes: Iterable[LaneState], rules: Rules, last_used: Mapping[str, float], now: float
) -> list[Stop]:
    """The idle models whose ttl has run out (a millisecond early counts: timers)."""
    return [
        Stop(lane, model, "ttl")
        for at, lane, model in ttl_deadlines(lanes, rules, last_used)
        if at <= now + 1e-3
    ]


class Cooldowns:
    """Failed starts: for ``seconds`` after a model failed to start, its requests fail at
    once with the start's cause rather than each trying the start again (0: off). An
    explicit load (a preload) tries again at once and, if it works, ends the cool-down."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until: dict[str, tuple[float, str]] = {}

    def failed(self, model: str, cause: str, now: float, seconds: float) -> None:
        if seconds > 0:
            self._until[model] = (now + seconds, cause)

    def cause(self, model: str, now: float) -> str | None:
        """The start failure a request for ``model`` gets now, if it is cooling down."""
        entry = self._until.get(model)
        if entry is None:
            return None
        if now >= entry[0]:
            del self._until[model]
            return None
        return entry[1]

    def clear(self, model: str) -> None:
        self._until.pop(model, None)

    def __bool__(self) -> bool:
        """Whether any model is cooling down (or was, until asked)."""
        return bool(self._until)

    def refuse(self, request: QueuedRequest, now: float) -> Refuse | None:
        if not self._until:
            return None
        cause = self.cause(request.model, now)
        if cause is None:
            return None
        return Refuse(request.request_id, Refusal.START_FAILED, cause)
