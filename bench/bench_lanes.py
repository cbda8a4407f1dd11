"""Picks across lanes: LaneQueues at 100k waiting on 4 lanes against a naive scan.

The same workload as ``bench_queue`` (20 models, mixed priorities, random arrival gaps,
default settings), the models spread over four lanes (five each, one loaded per lane).
Each step picks the next request of one lane (round robin, as the dispatcher does when
lanes free up one after another) and adds a fresh arrival of the same kind, so the size
stays constant. The naive reference keeps one list per lane and scans the lane's list
(``bench_queue.Naive``: score and both counterfactual maxima in one pass); it runs in
lockstep first and its picks are compared.
"""

from __future__ import annotations

import gc
import random
import time

from bench import fmt_us, machine, markdown_table, quantile_us
from bench.bench_queue import MODELS, SETTINGS, Naive, Samples, Workload, ratio
from scheduler.core.lanes import LaneQueues

SIZE = 100_000
LANES = ("gpu0", "gpu1", "gpu2", "gpu3")
LANE_OF = {model: LANES[i % len(LANES)] for i, model in enumerate(MODELS)}
LOADED = {lane: next(m for m in MODELS if LANE_OF[m] == lane) for lane in LANES}
FAST_REPS = 20_000
NAIVE_BUDGET_NS = 2_000_000_000
TARGET_PICK_US = 50.0
TARGET_RATIO = 100.0


def build() -> tuple[LaneQueues, dict[str, Naive], Workload]:
    work = Workload(random.Random(SIZE))
    queues = LaneQueues(SETTINGS, LANE_OF, LANES)
    naive = {lane: Naive(SETTINGS, LOADED[lane]) for lane in LANES}
    for lane in LANES:
        queues.lane(lane).set_loaded_models([LOADED[lane]])
    for _ in range(SIZE):
        r = work.request()
        queues.add(r)
        naive[LANE_OF[r.model]].add(r)
    return queues, naive, work


def bench() -> tuple[Samples, int, int]:
    queues, naive, work = build()
    pick = Samples()
    clock = time.perf_counter_ns
    agreed = lockstep = spent = 0
    for step in range(FAST_REPS):
        lane = LANES[step % len(LANES)]
        with_naive = spent < NAIVE_BUDGET_NS  # once over budget, the scan stops for good
        now = work.now
        t0 = clock()
        decision = queues.pick(now, lane)
        t1 = clock()
        pick.fast.append(t1 - t0)
        assert decision is not None
        if with_naive:
            t1 = clock()
            expected, _ = naive[lane].pick(now)
            t2 = clock()
            pick.naive.append(t2 - t1)
            spent += t2 - t1
            lockstep += 1
            agreed += expected.request_id == decision.request_id
        else:
            spent = NAIVE_BUDGET_NS
        fresh = work.request(decision.model, decision.priority)
        queues.add(fresh)
        if with_naive:
            naive[lane].add(fresh)
    return pick, lockstep, agreed


def main() -> str:
    print("== lanes: LaneQueues.pick on 4 lanes vs a naive per-lane scan ==")
    started = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        pick, lockstep, agreed = bench()
    finally:
        if gc_was_enabled:
            gc.enable()
    med = quantile_us(pick.fast, 0.5)
    naive_med = quantile_us(pick.naive, 0.5)
    verdict = (
        f"Target (pick at {SIZE:,} waiting on {len(LANES)} lanes under {TARGET_PICK_US:g} µs "
        f"median and ≥ {TARGET_RATIO:g}× the naive scan): {med:.1f} µs, {naive_med / med:,.0f}× — "
        f"{'met' if med < TARGET_PICK_US and naive_med / med >= TARGET_RATIO else 'NOT met'}."
    )
    print(f"  pick {fmt_us(med)} µs median; {verdict}")
    header = [
        "op",
        "waiting",
        "lanes",
        "fast median µs",
        "fast p99 µs",
        "naive median µs",
        "naive/fast",
        "samples fast / naive",
    ]
    rows = [
        [
            "pick",
            f"{SIZE:,}",
            str(len(LANES)),
            fmt_us(med),
            fmt_us(quantile_us(pick.fast, 0.99)),
            fmt_us(naive_med),
            ratio(naive_med, med),
            f"{len(pick.fast):,} / {len(pick.naive):,}",
        ]
    ]
    return "\n".join(
        [
            "`.venv/bin/python -m bench lanes`. "
            f"Machine: {machine()}. One run, {time.perf_counter() - started:.0f} s.",
            "",
            markdown_table(header, rows),
            "",
            "20 models over 4 lanes (one loaded per lane), 100,000 waiting in all, default "
            "settings; `LaneQueues.pick(now, lane)` round robin over the lanes, with "
            "attribution, vs a scan of that lane's list (score and both counterfactual "
            f"maxima in one pass). Picks agreed with the scan: {agreed:,}/{lockstep:,}.",
            "",
            verdict,
        ]
    )
