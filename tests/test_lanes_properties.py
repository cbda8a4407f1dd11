"""Lanes and slots: the fast per-lane queues against a naive reference that scans.

The reference keeps one list of waiting requests per lane and scores every one of them
exactly (fractions) at each pick: the obvious reading of "one serial queue per GPU, a
request at a time, picked by score", with slots read as "while the lane runs fewer than
N requests of its model and the best waiting request of the lane is for that model, it
goes too". After any sequence of arrivals, cancellations, clock advances, settings
changes, dispatches and finishes on any lane, :class:`LaneQueues` with
:func:`fill_slots` must admit the same requests in the same order, and show each lane's
queue in the same order.
"""

from __future__ import annotations

from fractions import Fraction

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.core.lanes import DEFAULT_LANE, LaneQueues, fill_slots
from scheduler.core.policy import QueuedRequest, SchedulerSettings

LANE_OF = {"a": "gpu0", "b": "gpu0", "c": "gpu1", "d": "gpu1", "e": DEFAULT_LANE}
MODELS = sorted(LANE_OF)
LANES = ["gpu0", "gpu1", DEFAULT_LANE]
SLOTS = {"a": 3, "b": 1, "c": 2, "d": 4, "e": 1}
DIVISORS = [0, 0.125, 0.5, 1, 2, 60]
BONUSES = [0, 1, 10, 99]
PRIORITIES = st.one_of(st.sampled_from([-100, -1, 0, 1, 100]), st.integers(-300, 300))


class NaiveLanes:
    """Every pick scans every waiting request of the lane."""

    def __init__(self) -> None:
        self.waiting: dict[str, list[QueuedRequest]] = {lane: [] for lane in LANES}
        self.loaded: dict[str, set[str]] = {lane: set() for lane in LANES}
        self.settings = SchedulerSettings()

    def score(self, lane: str, r: QueuedRequest, now: float) -> Fraction:
        s = Fraction(r.priority)
        if r.model in self.loaded[lane]:
            s += self.settings.swap_affinity_bonus
        if self.settings.aging_divisor:
            s += (Fraction(now) - Fraction(r.arrival)) / Fraction(self.settings.aging_divisor)
        return s

    def best(self, lane: str, now: float) -> QueuedRequest | None:
        best = None
        for r in self.waiting[lane]:  # arrival order: a strict > keeps the earlier on ties
            if best is None or self.score(lane, r, now) > self.score(lane, best, now):
                best = r
        return best

    def order(self, lane: str, now: float) -> list[str]:
        ranked = sorted(
            enumerate(self.waiting[lane]), key=lambda ir: (-self.score(lane, ir[1], now), ir[0])
        )
        return [r.request_id for _, r in ranked]

    def take(self, lane: str, now: float) -> QueuedRequest:
        r = self.best(lane, now)
        assert r is not None
        self.waiting[lane].remove(r)
        return r


class LanesMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.fast = LaneQueues(SchedulerSettings(), LANE_OF, LANES)
        self.naive = NaiveLanes()
        self.running: dict[str, tuple[str | None, int]] = {lane: (None, 0) for lane in LANES}
        self.now = 0.0
        self.counter = 0

    def _load(self, lane: str, model: str) -> None:
        """A swap: the default router keeps one model per lane."""
        self.naive.loaded[lane] = {model}
        self.fast.lane(lane).set_loaded_models([model])

    @rule(model=st.sampled_from(MODELS), priority=PRIORITIES)
    def arrive(self, model: str, priority: int) -> None:
        self.counter += 1
        request = QueuedRequest(f"r{self.counter}", model, priority, self.now)
        assert self.fast.add(request) == LANE_OF[model]
        self.naive.waiting[LANE_OF[model]].append(request)

    @precondition(lambda self: any(self.naive.waiting.values()))
    @rule(index=st.integers(0, 10_000))
    def cancel(self, index: int) -> None:
        everyone = [r for lane in LANES for r in self.naive.waiting[lane]]
        victim = everyone[index % len(everyone)]
        self.naive.waiting[LANE_OF[victim.model]].remove(victim)
        assert self.fast.cancel(victim.request_id) == victim

    @rule(seconds=st.one_of(st.integers(0, 5_000), st.sampled_from([0.125, 0.5, 1.0])))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @rule(divisor=st.sampled_from(DIVISORS), bonus=st.sampled_from(BONUSES))
    def change_settings(self, divisor: float, bonus: int) -> None:
        new = SchedulerSettings.create(aging_divisor=divisor, swap_affinity_bonus=bonus)
        self.fast.set_settings(new)
        self.naive.settings = new

    @rule(lane=st.sampled_from(LANES))
    def dispatch(self, lane: str) -> None:
        """What the dispatcher does for one lane after a batch of events."""
        model, busy = self.running[lane]
        admitted: list[str] = []
        expected: list[str] = []
        if busy == 0:
            # The reference: the best request of the lane, swapping its model in.
            first = self.naive.best(lane, self.now)
            decision = self.fast.pick(self.now, lane)
            if first is None:
                assert decision is None
                return
            self.naive.take(lane, self.now)
            assert decision is not None
            assert decision.request_id == first.request_id
            assert decision.needs_swap == (first.model not in self.naive.loaded[lane])
            if decision.needs_swap:
                self._load(lane, first.model)
            model, busy = first.model, 1
        assert model is not None
        slots = SLOTS[model]
        admitted = [d.request_id for d in fill_slots(self.fast, lane, self.now, model, busy, slots)]
        while busy < slots:
            nxt = self.naive.best(lane, self.now)
            if nxt is None or nxt.model != model:
                break
            expected.append(self.naive.take(lane, self.now).request_id)
            busy += 1
        assert admitted == expected
        self.running[lane] = (model, busy)

    @precondition(lambda self: any(busy for _, busy in self.running.values()))
    @rule(lane=st.sampled_from(LANES))
    def finish(self, lane: str) -> None:
        model, busy = self.running[lane]
        if busy:
            self.running[lane] = (model if busy > 1 else None, busy - 1)

    @invariant()
    def slots_hold(self) -> None:
        for model, busy in self.running.values():
            assert model is None or busy <= SLOTS[model]

    @invariant()
    def same_queues(self) -> None:
        assert len(self.fast) == sum(len(w) for w in self.naive.waiting.values())
        for lane in LANES:
            order = [r.request.request_id for r in self.fast.lane(lane).peek(self.now)]
            assert order == self.naive.order(lane, self.now)
        for model in MODELS:
            lane = LANE_OF[model]
            assert self.fast.waiting_for(model) == sum(
                1 for r in self.naive.waiting[lane] if r.model == model
            )

    @invariant()
    def band_stats_sum_over_lanes(self) -> None:
        stats = self.fast.band_stats(self.now)
        everyone = [r for lane in LANES for r in self.naive.waiting[lane]]
        for band, s in stats.items():
            mine = [r for r in everyone if r.band is band]
            assert s.depth == len(mine)
            oldest = min((r.arrival for r in mine), default=None)
            assert s.oldest_wait == (self.now - oldest if oldest is not None else 0.0)
            head = self.fast.oldest(band)
            assert (head.arrival if head else None) == oldest


LanesMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLanesMatchNaiveReference = LanesMachine.TestCase


def test_a_request_waits_on_its_models_lane_only():
    q = LaneQueues(SchedulerSettings(), LANE_OF, LANES)
    q.add(QueuedRequest("x", "a", 0, 0.0))
    q.add(QueuedRequest("y", "c", 100, 0.0))
    assert q.pick(0.0, "gpu0").request_id == "x"  # y's priority does not matter on gpu0
    assert q.pick(0.0, "gpu0") is None
    assert q.pick(0.0, "gpu1").request_id == "y"


def test_slots_stop_admitting_when_the_best_waiting_request_needs_another_model():
    q = LaneQueues(SchedulerSettings(), LANE_OF, LANES)
    q.lane("gpu0").set_loaded_models(["a"])
    for rid, model, priority in [("a1", "a", 0), ("b1", "b", 100), ("a2", "a", 0)]:
        q.add(QueuedRequest(rid, model, priority, 0.0))
    # b1 outranks a2 even with a's affinity bonus (10): the lane drains instead.
    assert fill_slots(q, "gpu0", 0.0, "a", busy=1, slots=3) == []
    q.cancel("b1")
    admitted = fill_slots(q, "gpu0", 0.0, "a", busy=1, slots=3)
    assert [d.request_id for d in admitted] == ["a1", "a2"]
