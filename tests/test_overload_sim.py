"""The simulator's overload tools (issue 13): trace shapes, the targets check, forced
swaps, and the estimated wait with its measured error."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import call_command

from scheduler.core.estimate import ArrivalRates, RunningMeans, ServiceTimes, estimate_waits
from scheduler.core.policy import QueuedRequest, SchedulerSettings
from scheduler.core.priority import Band
from scheduler.core.queue import WaitingQueue
from scheduler.core.simulate import (
    GENERATED_LOAD_SECONDS,
    RECOMMENDED,
    TRACE_SHAPES,
    TraceRequest,
    generate_trace,
    parse_overrides,
    simulate,
)


@pytest.mark.parametrize("shape", TRACE_SHAPES)
def test_trace_shapes_are_deterministic_and_sorted(shape):
    a, b = generate_trace(300, 7, shape), generate_trace(300, 7, shape)
    assert a == b and len(a) == 300
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    assert generate_trace(300, 8, shape) != a


def test_the_steady_trace_keeps_the_gpu_70_percent_busy_with_service_alone():
    trace = generate_trace(2000, 0, "steady")
    span = trace[-1].arrival - trace[0].arrival
    assert sum(r.service for r in trace) / span == pytest.approx(0.7, abs=0.05)


def test_unknown_shape():
    with pytest.raises(ValueError, match="unknown trace shape"):
        generate_trace(10, 0, "spiky")


def test_recommended_is_an_alias():
    assert parse_overrides(["recommended"]) == parse_overrides([RECOMMENDED])


def test_forced_swaps_are_those_with_nothing_waiting_for_the_loaded_model():
    trace = [
        TraceRequest("a1", 0, "A", 0, 10),
        TraceRequest("b1", 1, "B", 100, 10),  # picked over a2: a chosen swap
        TraceRequest("a2", 2, "A", 0, 10),  # then back to A: nothing for B waits, forced
    ]
    result = simulate(trace, SchedulerSettings(), {"A": 0, "B": 0})
    assert [d.request_id for d in result.dispatches] == ["a1", "b1", "a2"]
    assert result.swaps == 3 and result.forced_swaps == 2  # the first load and a2's


def test_targets_command_reports_every_shape():
    out = StringIO()
    call_command("simulate", "--targets", "--requests", "300", "--json", stdout=out)
    data = json.loads(out.getvalue())
    assert [d["shape"] for d in data] == list(TRACE_SHAPES)
    for check in data:
        assert set(check["ratios"]) == {"interactive_p95", "batch_max", "swaps"}
        assert check["candidate"]["settings"]["agingCap"] == 100
    text = StringIO()
    call_command("simulate", "--targets", "--requests", "300", stdout=text)
    assert "| overload | interactive wait p95 |" in text.getvalue()


def test_generate_writes_the_shape(tmp_path):
    out = StringIO()
    path = tmp_path / "t.jsonl"
    call_command(
        "simulate", "--generate", str(path), "--shape", "bursty", "--requests", "50", stdout=out
    )
    assert "(bursty, seed 0)" in out.getvalue()
    assert len(path.read_text().splitlines()) == 50


# -- estimated wait ------------------------------------------------------------------------


def test_estimate_adds_the_running_job_services_and_loads_in_order():
    queue = WaitingQueue(SchedulerSettings(), loaded_model="A")
    for rid, model in (("x", "A"), ("y", "B"), ("z", "B")):
        queue.add(QueuedRequest(rid, model, 0, 0))
    times = ServiceTimes(service={"A": 10, "B": 20}, load={"B": 30})
    waits = estimate_waits(queue.peek(0), queue.loaded_models, 5, times)
    # x after the running job's 5 s; y after x (10); z after y's load and run (30 + 20).
    assert waits == [5, 15, 65]


def test_estimate_stretches_by_the_load_of_the_bands_above():
    times = ServiceTimes(service={"A": 10}, load_above={Band.BATCH: 0.5})
    batch = QueuedRequest("b", "A", -100, 0)
    assert estimate_waits([batch], ["A"], 10, times) == [20.0]


def test_running_means_and_rates_feed_the_estimate():
    means = RunningMeans()
    means.add_service("A", 10, Band.INTERACTIVE)
    means.add_service("A", 300, Band.BATCH)
    means.add_load("A", 15)
    rates = ArrivalRates(window=100)
    for t in range(10):
        rates.add(Band.INTERACTIVE, t)
    times = means.times(rates=rates, now=50)
    assert times.service_of("A", Band.BATCH) == 300 and times.service_of("A") == 155
    assert times.load_of("A") == 15
    assert times.load_above[Band.NORMAL] == pytest.approx(10 / 100 * 10)
    assert rates.rate(Band.INTERACTIVE, 1000) == 0  # the window moved on


def test_estimate_error_is_measured_per_band():
    trace = generate_trace(300, 0, "steady")
    result = simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS, estimate=True)
    assert result.estimate_errors is not None
    inter = result.estimate_errors[Band.INTERACTIVE]
    assert inter.samples > 0 and inter.within_factor_2 > 0.8
    assert "estimate_error" in result.as_dict()


def test_wait_estimator_is_what_a_queue_owner_keeps():
    from scheduler.core.estimate import WaitEstimator

    est = WaitEstimator(default_load=20)
    queue = WaitingQueue(SchedulerSettings(), loaded_model="A")
    for rid, model, priority in (("i", "A", 100), ("b", "B", -100)):
        request = QueuedRequest(rid, model, priority, 0)
        queue.add(request)
        est.arrived(request)
    est.finished("A", Band.INTERACTIVE, 4)
    est.finished("B", Band.BATCH, 100, load_seconds=40)
    left = est.running_left("A", Band.INTERACTIVE, started=0, now=1)
    assert left == 3
    waits = est.estimates(queue.peek(1), queue.loaded_models, left, now=1)
    # i after the running job; b after i (4 s), stretched by the interactive load above it
    # (one arrival in the last hour x 4 s).
    assert waits[0] == 3
    assert waits[1] == pytest.approx(7 / (1 - 4 / 3600))
