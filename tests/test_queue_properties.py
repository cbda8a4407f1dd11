"""The fast WaitingQueue against a naive reference that scores every request.

The reference computes each score exactly (fractions) and takes a stable max, the
obvious reading of the spec; the fast queue must make the same pick, with the same
attribution and runner-up, after any sequence of adds, cancels, loaded-model changes,
settings changes and clock advances, under both policies.
"""

from __future__ import annotations

from fractions import Fraction

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.core.policy import Policy, QueuedRequest, SchedulerSettings, Term
from scheduler.core.queue import WaitingQueue

MODELS = ["a", "b", "c", "d"]
# Dyadic divisors and times keep every float exact, so near-ties compare the same way.
DIVISORS = [0, 0.125, 0.5, 1, 2, 45.5, 60, 90]
BONUSES = [0, 1, 10, 99]
PRIORITIES = st.one_of(
    st.sampled_from([-100, -99, -98, 0, 1, 2, 100, 101]), st.integers(-300, 300)
)


class NaiveQueue:
    """Every pick scans every waiting request."""

    def __init__(self) -> None:
        self.waiting: list[QueuedRequest] = []  # arrival order
        self.settings = SchedulerSettings()
        self.loaded: str | None = None

    def effective(self, r: QueuedRequest) -> int:
        if self.settings.use is Policy.FIFO:
            return r.priority + self.settings.fifo_priority.get(r.model, 0)
        return r.priority

    def score(self, r: QueuedRequest, now: float, aging: bool = True, affinity: bool = True):
        s = Fraction(self.effective(r))
        if self.settings.use is Policy.FIFO:
            return s
        if affinity and r.model == self.loaded:
            s += self.settings.swap_affinity_bonus
        if aging and self.settings.aging_divisor:
            s += (Fraction(now) - Fraction(r.arrival)) / Fraction(self.settings.aging_divisor)
        return s

    def best(self, now: float, pool=None, **terms) -> QueuedRequest | None:
        best = None
        for r in self.waiting if pool is None else pool:
            if best is None or self.score(r, now, **terms) > self.score(best, now, **terms):
                best = r
        return best

    def pick(self, now: float, model: str | None = None):
        pool = [r for r in self.waiting if model is None or r.model == model]
        winner = self.best(now, pool)
        if winner is None:
            return None
        terms = set()
        if model is None and self.settings.use is Policy.SERIAL:
            if self.best(now, aging=False) is not winner:
                terms.add(Term.AGING)
            if self.best(now, affinity=False) is not winner:
                terms.add(Term.SWAP_AFFINITY)
        self.waiting.remove(winner)
        runner = self.best(now)
        return winner, frozenset(terms), runner

    def order(self, now: float) -> list[str]:
        ranked = sorted(
            enumerate(self.waiting), key=lambda ir: (-self.score(ir[1], now), ir[0])
        )
        return [r.request_id for _, r in ranked]


class QueueMachine(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.fast = WaitingQueue()
        self.naive = NaiveQueue()
        self.now = 0.0
        self.counter = 0

    @rule(model=st.sampled_from(MODELS), priority=PRIORITIES)
    def add(self, model: str, priority: int) -> None:
        self.counter += 1
        request = QueuedRequest(f"r{self.counter}", model, priority, self.now)
        self.fast.add(request)
        self.naive.waiting.append(request)

    @precondition(lambda self: self.naive.waiting)
    @rule(index=st.integers(0, 10_000))
    def cancel(self, index: int) -> None:
        victim = self.naive.waiting[index % len(self.naive.waiting)]
        self.naive.waiting.remove(victim)
        assert self.fast.cancel(victim.request_id) == victim

    @rule()
    def cancel_unknown(self) -> None:
        assert self.fast.cancel("nobody") is None

    @rule(seconds=st.one_of(st.integers(0, 20_000), st.sampled_from([0.125, 0.5, 1.0])))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @rule(model=st.one_of(st.none(), st.sampled_from(MODELS)))
    def load(self, model: str | None) -> None:
        self.fast.set_loaded_model(model)
        self.naive.loaded = model

    @rule(
        use=st.sampled_from(["serial", "fifo"]),
        divisor=st.sampled_from(DIVISORS),
        bonus=st.sampled_from(BONUSES),
        fifo=st.dictionaries(st.sampled_from(MODELS), st.integers(-150, 150), max_size=4),
    )
    def change_settings(self, use: str, divisor: float, bonus: int, fifo: dict) -> None:
        new = SchedulerSettings.create(
            use=use, aging_divisor=divisor, swap_affinity_bonus=bonus, fifo_priority=fifo
        )
        self.fast.set_settings(new)
        self.naive.settings = new

    @rule(model=st.one_of(st.none(), st.sampled_from(MODELS)))
    def pick(self, model: str | None) -> None:
        expected = self.naive.pick(self.now, model)
        decision = self.fast.pick(self.now, model)
        if expected is None:
            assert decision is None
            return
        winner, terms, runner = expected
        assert decision is not None
        assert decision.request_id == winner.request_id
        assert decision.reordered_by == terms
        assert decision.runner_up_id == (runner.request_id if runner else None)
        assert Fraction(decision.score) == self.naive.score(winner, self.now) or abs(
            decision.score - float(self.naive.score(winner, self.now))
        ) < 1e-6
        assert decision.needs_swap == (winner.model != self.naive.loaded)
        assert decision.waiting_after == len(self.naive.waiting)

    @invariant()
    def same_size_and_order(self) -> None:
        assert len(self.fast) == len(self.naive.waiting)
        assert [r.request.request_id for r in self.fast.peek(self.now)] == self.naive.order(
            self.now
        )

    @invariant()
    def band_depths_match(self) -> None:
        stats = self.fast.band_stats(self.now)
        for band, s in stats.items():
            mine = [r for r in self.naive.waiting if r.band is band]
            assert s.depth == len(mine)
            assert s.oldest_wait == (self.now - mine[0].arrival if mine else 0.0)


QueueMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestQueueMatchesNaiveReference = QueueMachine.TestCase
