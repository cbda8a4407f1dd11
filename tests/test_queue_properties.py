"""The fast WaitingQueue against a naive reference that scores every request.

The reference computes each score exactly (fractions) and takes a stable max, the
obvious reading of the spec; the fast queue must make the same pick, with the same
attribution and runner-up, after any sequence of adds, cancels, loaded-model changes,
settings changes and clock advances, under both policies, and with the opt-in bounds
(``agingCap``: ``min(wait / divisor, cap)``; ``bandShare``: the band furthest behind
its share of the time since it last had nothing waiting goes first, GPU time counted
from one pick to the next) read as plainly as the docs state them.
"""

from __future__ import annotations

from fractions import Fraction

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.core.policy import Policy, QueuedRequest, SchedulerSettings, Term
from scheduler.core.priority import BANDS
from scheduler.core.queue import WaitingQueue

MODELS = ["a", "b", "c", "d"]
# Dyadic divisors and times keep every float exact, so near-ties compare the same way.
DIVISORS = [0, 0.125, 0.5, 1, 2, 45.5, 60, 90]
BONUSES = [0, 1, 10, 99]
CAPS = [None, None, 0.5, 1, 10, 50, 150]
SHARES = st.one_of(
    st.just({}),
    st.dictionaries(
        st.sampled_from(["interactive", "normal", "batch"]),
        st.sampled_from([0.125, 0.25, 0.5]),
        min_size=1,
        max_size=3,
    ).filter(lambda d: sum(d.values()) <= 1),
)
PRIORITIES = st.one_of(st.sampled_from([-100, -99, -98, 0, 1, 2, 100, 101]), st.integers(-300, 300))


class NaiveQueue:
    """Every pick scans every waiting request."""

    def __init__(self) -> None:
        self.waiting: list[QueuedRequest] = []  # arrival order
        self.settings = SchedulerSettings()
        self.loaded: str | None = None
        self.busy_since: dict = dict.fromkeys(BANDS)
        self.served: dict = dict.fromkeys(BANDS, Fraction(0))
        self.last_pick: tuple | None = None

    def add(self, r: QueuedRequest) -> None:
        if not any(w.band is r.band for w in self.waiting):
            self.busy_since[r.band] = Fraction(r.arrival)
            self.served[r.band] = Fraction(0)
        self.waiting.append(r)

    def remove(self, r: QueuedRequest) -> None:
        self.waiting.remove(r)
        if not any(w.band is r.band for w in self.waiting):
            self.busy_since[r.band] = None
            self.served[r.band] = Fraction(0)

    def served_now(self, band, now):
        served = self.served[band]
        if self.last_pick is not None and self.busy_since[band] is not None:
            at, last = self.last_pick
            if last is band:
                served += max(Fraction(0), Fraction(now) - max(at, self.busy_since[band]))
        return served

    def owed(self, now: float):
        if self.settings.use is not Policy.SERIAL:
            return None
        owed, most = None, Fraction(0)
        for band in BANDS:
            share = self.settings.band_share.get(band)
            if not share or not any(w.band is band for w in self.waiting):
                continue
            since = self.busy_since[band]
            deficit = Fraction(share) * max(Fraction(0), Fraction(now) - since)
            deficit -= self.served_now(band, now)
            if deficit > most:
                owed, most = band, deficit
        return owed

    def effective(self, r: QueuedRequest) -> int:
        if self.settings.use is Policy.FIFO:
            return r.priority + self.settings.fifo_priority.get(r.model, 0)
        return r.priority

    def score(
        self, r: QueuedRequest, now: float, aging: bool = True, affinity: bool = True, cap=True
    ):
        s = Fraction(self.effective(r))
        if self.settings.use is Policy.FIFO:
            return s
        if affinity and r.model == self.loaded:
            s += self.settings.swap_affinity_bonus
        if aging and self.settings.aging_divisor:
            aged = (Fraction(now) - Fraction(r.arrival)) / Fraction(self.settings.aging_divisor)
            if cap and self.settings.aging_cap is not None:
                aged = min(aged, Fraction(self.settings.aging_cap))
            s += aged
        return s

    def best(self, now: float, pool=None, **terms) -> QueuedRequest | None:
        best = None
        for r in self.waiting if pool is None else pool:
            if best is None or self.score(r, now, **terms) > self.score(best, now, **terms):
                best = r
        return best

    def pick(self, now: float, model: str | None = None):
        owed = self.owed(now) if model is None else None
        pool = [
            r
            for r in self.waiting
            if (model is None or r.model == model) and (owed is None or r.band is owed)
        ]
        winner = self.best(now, pool)
        if winner is None:
            return None
        terms = set()
        if model is None and self.settings.use is Policy.SERIAL:
            if self.best(now, pool, aging=False) is not winner:
                terms.add(Term.AGING)
            if self.best(now, pool, affinity=False) is not winner:
                terms.add(Term.SWAP_AFFINITY)
            if self.best(now, pool, cap=False) is not winner:
                terms.add(Term.AGING_CAP)
            if self.best(now) is not winner:
                terms.add(Term.BAND_SHARE)
        # The last pick's job ran until now: its band got that GPU time.
        if self.last_pick is not None:
            at, band = self.last_pick
            self.served[band] = self.served_now(band, now)
        self.last_pick = (Fraction(now), winner.band)
        self.remove(winner)
        runner = self.best(now)
        return winner, frozenset(terms), runner

    def order(self, now: float) -> list[str]:
        ranked = sorted(enumerate(self.waiting), key=lambda ir: (-self.score(ir[1], now), ir[0]))
        ids = [r.request_id for _, r in ranked]
        owed = self.owed(now)
        if owed is not None:
            first = self.best(now, [r for r in self.waiting if r.band is owed])
            ids.remove(first.request_id)
            ids.insert(0, first.request_id)
        return ids


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
        self.naive.add(request)

    @precondition(lambda self: self.naive.waiting)
    @rule(index=st.integers(0, 10_000))
    def cancel(self, index: int) -> None:
        victim = self.naive.waiting[index % len(self.naive.waiting)]
        self.naive.remove(victim)
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
        cap=st.sampled_from(CAPS),
        shares=SHARES,
    )
    def change_settings(
        self, use: str, divisor: float, bonus: int, fifo: dict, cap, shares: dict
    ) -> None:
        new = SchedulerSettings.create(
            use=use,
            aging_divisor=divisor,
            swap_affinity_bonus=bonus,
            fifo_priority=fifo,
            aging_cap=cap,
            band_share=shares,
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
        assert (
            Fraction(decision.score) == self.naive.score(winner, self.now)
            or abs(decision.score - float(self.naive.score(winner, self.now))) < 1e-6
        )
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
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestQueueMatchesNaiveReference = QueueMachine.TestCase
