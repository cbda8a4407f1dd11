"""Replay of the recorded history (issue 13): a recorded run round-trips through the
activity log and ``simulate --from-history`` with no error, and a replay of other
settings shows what they would have done."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from activity.history import history_rows
from activity.models import RequestRecord
from scheduler.core.policy import SchedulerSettings
from scheduler.core.priority import BANDS
from scheduler.core.replay import from_history, replay_error
from scheduler.core.simulate import (
    GENERATED_LOAD_SECONDS,
    SimResult,
    generate_trace,
    simulate,
)

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)


def record_run(result: SimResult, trace, loads) -> None:
    """Store a simulated run as the server would have: one row per request."""
    service = {r.request_id: r.service for r in trace}
    priority = {r.request_id: r.priority for r in trace}
    rows = []
    for d in result.dispatches:
        load = loads[d.model] if d.swap else None
        start = T0 + timedelta(seconds=d.start)
        ready = start + timedelta(seconds=load or 0.0)
        rows.append(
            RequestRecord(
                request_id=d.request_id,
                model=d.model,
                path="/v1/chat/completions",
                priority=priority[d.request_id],
                band=d.band.value,
                policy="serial",
                arrived_at=T0 + timedelta(seconds=d.arrival),
                dispatched_at=start,
                ready_at=ready,
                finished_at=ready + timedelta(seconds=service[d.request_id]),
                outcome="completed",
                duration_ms=(d.finish - d.arrival) * 1000,
                queue_wait_ms=d.wait * 1000,
                load_ms=None if load is None else load * 1000,
                run_ms=service[d.request_id] * 1000,
                needs_swap=d.swap,
                reordered_by=sorted(t.value for t in d.reordered_by),
                aging_divisor=60.0,
                swap_affinity_bonus=10,
            )
        )
    RequestRecord.objects.bulk_create(rows)


@pytest.fixture
def recorded():
    trace = generate_trace(300, seed=3, shape="bursty")
    result = simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS)
    record_run(result, trace, GENERATED_LOAD_SECONDS)
    # One that never reached the GPU (its client left while it waited): replayed, it
    # leaves the queue at the same time (busy GPU: before its turn).
    RequestRecord.objects.create(
        request_id="gone",
        model="qwen3",
        path="/v1/chat/completions",
        priority=-100,
        band="batch",
        policy="serial",
        arrived_at=T0 + timedelta(seconds=trace[0].arrival + 5),
        finished_at=T0 + timedelta(seconds=trace[0].arrival + 9),
        outcome="cancelled_waiting",
        duration_ms=4000,
    )
    return trace, result


def test_the_recorded_run_round_trips_with_no_replay_error(recorded):
    trace, result = recorded
    rows, origin = history_rows()
    assert origin == T0 + timedelta(seconds=trace[0].arrival)  # the first arrival
    history = from_history(rows, SchedulerSettings())
    assert history.skipped == 0 and len(history.trace) == len(trace) + 1
    assert [r.gone for r in history.trace if r.request_id == "gone"] == [pytest.approx(9)]
    assert history.loads == GENERATED_LOAD_SECONDS
    replay = simulate(history.trace, SchedulerSettings(), history.loads)
    error = replay_error(history.recorded, replay)
    assert "gone" not in {d.request_id for d in replay.dispatches}
    assert error.requests == len(trace)
    assert error.abs_max < 0.01 and error.same_order == 1.0
    for band in BANDS:
        assert history.recorded.bands[band].wait_p95 == pytest.approx(
            result.bands[band].wait_p95, abs=0.01
        )
    assert history.recorded.swaps == result.swaps
    assert history.recorded.reordered == result.reordered


def test_simulate_from_history_reports_the_replay_error_and_compares(recorded):
    out = StringIO()
    call_command(
        "simulate", "--from-history", "--compare", "agingCap=100", "use=fifo", "--json", stdout=out
    )
    data = json.loads(out.getvalue())
    assert data["requests"] == 301 and data["skipped_never_dispatched"] == 0
    assert data["replay_error"]["abs_error_max_seconds"] < 0.01
    labels = [r["label"] for r in data["results"]]
    assert labels == ["recorded", "replay: defaults", "agingCap=100", "use=fifo"]
    text = StringIO()
    call_command("simulate", "--from-history", "--estimate", stdout=text)
    printed = text.getvalue()
    assert "replay error of the settings in effect (defaults)" in printed
    assert "estimated wait, replay: defaults" in printed


def test_from_history_windows_by_arrival(recorded):
    trace, _ = recorded
    middle = T0 + timedelta(seconds=trace[150].arrival)
    rows, _ = history_rows(since=middle)
    assert len(rows) == sum(1 for r in trace if r.arrival >= trace[150].arrival)
    with pytest.raises(CommandError, match="no recorded requests"):
        call_command("simulate", "--from-history", "--until", "2026-11-01")
