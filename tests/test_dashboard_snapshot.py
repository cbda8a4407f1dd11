"""The dashboard's pure parts: the snapshot builder and the "why did it wait" explainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from dashboard.explain import explain
from dashboard.snapshot import build_snapshot, decision_record, empty_snapshot, sample
from scheduler.core.policy import Decision, Policy, QueuedRequest, SchedulerSettings, Term
from scheduler.core.priority import Band
from scheduler.core.queue import BandStats, WaitingQueue

SETTINGS = SchedulerSettings.create(aging_divisor=60, swap_affinity_bonus=10)


def _queue(n: int) -> WaitingQueue:
    q = WaitingQueue(SETTINGS, loaded_model="a")
    for i in range(n):
        q.add(QueuedRequest(f"r{i}", "a" if i % 2 else "b", [100, 0, -100][i % 3], float(i)))
    return q


def _snapshot(queue: WaitingQueue, now: float, **overrides):
    args = dict(
        now=now,
        wall=1_000_000.0,
        bands=queue.band_stats(now),
        waiting=queue.peek(now, 50),
        depth=len(queue),
        running=(),
        model="a",
        model_state="ready",
        decisions=(),
        dispatched={},
        reorders={},
        settings=SETTINGS,
        settings_source="config file",
        settings_since=999_000.0,
    )
    args.update(overrides)
    return build_snapshot(**args)


def test_waiting_list_is_capped_but_depth_counts_everything():
    queue = _queue(10_000)
    snap = _snapshot(queue, now=20_000.0, waiting=queue.peek(20_000.0, 50))
    assert snap["depth"] == 10_000
    assert snap["waiting_shown"] == 50
    assert len(snap["waiting"]) == 50
    assert [b["depth"] for b in snap["bands"]] == [3334, 3333, 3333]


def test_waiting_rows_are_in_dispatch_order_with_their_score_parts():
    queue = WaitingQueue(SETTINGS, loaded_model="a")
    queue.add(QueuedRequest("batch", "b", -100, 0.0))
    queue.add(QueuedRequest("normal-b", "b", 0, 30.0))
    queue.add(QueuedRequest("normal-a", "a", 0, 60.0))
    snap = _snapshot(queue, now=120.0)
    rows = snap["waiting"]
    assert [r["request_id"] for r in rows] == [
        "normal-a",
        "normal-b",
        "batch",
    ]  # affinity breaks the near-tie
    first = rows[0]
    assert (first["priority"], first["affinity"], first["aging"], first["score"]) == (
        0,
        10.0,
        1.0,
        11.0,
    )
    assert first["rank"] == 1 and first["wait"] == 60.0 and first["band"] == "normal"
    assert rows[2]["aging"] == 2.0 and rows[2]["score"] == -98.0


def test_bands_always_listed_with_counters():
    snap = _snapshot(
        WaitingQueue(SETTINGS),
        now=0.0,
        dispatched={Band.NORMAL: 4},
        reorders={Band.BATCH: {Term.AGING: 2}},
    )
    assert [b["band"] for b in snap["bands"]] == ["interactive", "normal", "batch"]
    assert snap["bands"][1]["dispatched"] == 4
    assert snap["bands"][2]["reorders"] == {"aging": 2, "swap_affinity": 0, "aging_cap": 0, "band_share": 0}
    assert snap["waiting"] == [] and snap["depth"] == 0


@dataclass
class _Ticket:
    request_id: str
    priority: int
    arrival: float
    arrival_wall: float
    dispatched_at: float | None
    decision: Decision | None
    model: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(id="a"))
    state: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(value="running"))


def _decision(**changes) -> Decision:
    values = dict(
        request_id="r1",
        model="a",
        priority=-100,
        band=Band.BATCH,
        policy=Policy.SERIAL,
        score=-90.5,
        affinity=0.0,
        aging=9.5,
        queue_wait=570.0,
        reordered_by=frozenset({Term.AGING}),
        runner_up_id="r2",
        runner_up_score=-95.0,
        needs_swap=True,
    )
    values.update(changes)
    return Decision(**values)


def test_running_job_elapsed_and_decision_row():
    ticket = _Ticket(
        "r1", -100, arrival=10.0, arrival_wall=5000.0, dispatched_at=580.0, decision=_decision()
    )
    snap = _snapshot(
        WaitingQueue(SETTINGS), now=600.0, running=[ticket], decisions=[decision_record(ticket)]
    )
    assert snap["running"] == [
        {
            "request_id": "r1",
            "model": "a",
            "lane": "default",
            "band": "batch",
            "priority": -100,
            "state": "running",
            "elapsed": 20.0,
            "score": -90.5,
        }
    ]
    row = snap["decisions"][0]
    assert row["at"] == 5570.0  # arrival wall time + the time it waited
    assert row["reordered_by"] == ["aging"] and row["swap"] is True and row["wait"] == 570.0


def test_decisions_newest_first_and_settings_with_their_source():
    decisions = [{"request_id": "old"}, {"request_id": "new"}]
    snap = _snapshot(
        WaitingQueue(SETTINGS), now=0.0, decisions=decisions, settings_source="admin edit"
    )
    assert [d["request_id"] for d in snap["decisions"]] == ["new", "old"]
    assert snap["settings"] == {
        **SETTINGS.as_dict(),  # every setting of the table
        "shown": {
            "use": "serial",
            "agingDivisor": "60",
            "swapAffinityBonus": "10",
            "fifoPriority": "none",
            "agingCap": "no cap",
            "bandShare": "none",
            "startFailureCooldown": "5",
        },
        "source": "admin edit",
        "since": 999_000.0,
    }


def test_samples_are_chart_rows():
    stats = {
        Band.INTERACTIVE: BandStats(1, 2.0),
        Band.NORMAL: BandStats(0, 0.0),
        Band.BATCH: BandStats(7, 65.25),
    }
    assert sample(100.0, stats).row() == [100.0, 1, 0, 7, 2.0, 0.0, 65.2]


def test_empty_snapshot_says_offline():
    snap = empty_snapshot(1.0)
    assert snap["offline"] is True and snap["depth"] == 0 and len(snap["bands"]) == 3


# -- why did my request wait ------------------------------------------------------------

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def _row(request_id, model, priority, arrived, dispatched, finished, **decision):
    at = lambda s: None if s is None else T0 + timedelta(seconds=s)  # noqa: E731
    values = dict(
        score=None,
        affinity=0.0,
        aging=0.0,
        needs_swap=True,
        aging_divisor=60.0,
        swap_affinity_bonus=10,
    )
    values.update(decision)
    return SimpleNamespace(
        request_id=request_id,
        model=model,
        priority=priority,
        arrived_at=at(arrived),
        dispatched_at=at(dispatched),
        finished_at=at(finished),
        reordered_by=[],
        **values,
    )


@pytest.mark.parametrize(
    ("job", "term", "margin"),
    [
        # an interactive job beats a batch request on priority alone
        (_row("j", "b", 100, 30, 60, 90, score=100.5, aging=0.5), "priority", 200.0),
        # same band, same model loaded for both: it arrived first
        (
            _row("j", "a", -100, 0, 60, 90, score=-99.0, aging=1.0, needs_swap=True),
            "arrival order",
            None,
        ),
        # same priority, its model was loaded and ours was not: swap affinity
        (
            _row(
                "j", "b", -100, 30, 60, 90, score=-89.5, affinity=10.0, aging=0.5, needs_swap=False
            ),
            "swap affinity",
            10.0,
        ),
        # a batch job that waited two hours beats our fresh normal request: aging
        (_row("j", "b", -100, -7200, 60, 90, score=21.0, aging=121.0), "aging", 21.0),
    ],
)
def test_the_term_that_decided_each_job(job, term, margin):
    mine = _row("me", "a", -100 if term != "aging" else 0, 0, 120, 130, score=-98.0)
    if term == "aging":
        mine.arrived_at = T0 + timedelta(seconds=59)
    (ahead,) = explain(mine, [job])
    assert ahead.deciding_term == term
    assert ahead.margin == (pytest.approx(margin, abs=0.05) if margin is not None else None)


def test_a_job_running_when_it_arrived_went_first_because_nothing_preempts():
    mine = _row("me", "a", 100, 10, 40, 50, score=100.5)
    running = _row("j", "b", -100, 0, 5, 40, score=-100.0)
    (ahead,) = explain(mine, [running])
    assert ahead.already_running and ahead.deciding_term == "already running"
    assert ahead.ran_seconds == 35.0
