"""``simulate_fleet`` (scheduler/core/fleet_sim.py): a trace replayed on a fleet with the
same ``place`` a node runs, against the same fleet where each request runs where it
arrived."""

from __future__ import annotations

import pytest

from scheduler.core.fleet_sim import simulate_fleet
from scheduler.core.policy import SchedulerSettings
from scheduler.core.traces import TraceRequest


def crossed(n: int = 120, gap: float = 2.0, service: float = 1.0) -> list[TraceRequest]:
    """Two models, and a round robin in front of two nodes that hands each node qwen and
    llama in turn: a node that runs what it is handed swaps for every request."""
    models = ("qwen", "llama", "llama", "qwen")
    return [TraceRequest(f"r{i}", i * gap, models[i % 4], 0, service) for i in range(n)]


def test_placement_keeps_each_model_warm_on_one_node():
    trace = crossed()
    settings = SchedulerSettings()
    loads = {"qwen": 3.0, "llama": 3.0}
    where = simulate_fleet(trace, settings, 2, placement=False, load_seconds=loads)
    placed = simulate_fleet(trace, settings, 2, placement=True, load_seconds=loads)
    for run in (where, placed):
        assert run.result.requests == len(trace)  # each request ran once
        assert sum(run.per_node) == len(trace)
    assert where.placed == 0 and placed.placed > 0
    assert where.result.swaps == len(trace)  # every request a cold load
    assert placed.result.swaps == 2  # each model loaded once, on its own node

    def latency(run) -> float:  # arrival to the end of the answer (a load included)
        return sum(d.finish - d.arrival for d in run.result.dispatches) / len(trace)

    assert latency(placed) < latency(where) / 2


def test_one_node_is_the_single_box_simulation():
    trace = crossed(20)
    run = simulate_fleet(trace, SchedulerSettings(), 1, load_seconds={"qwen": 1, "llama": 1})
    assert run.placed == 0 and run.per_node == (20,)
    with pytest.raises(ValueError):
        simulate_fleet(trace, SchedulerSettings(), 0)
