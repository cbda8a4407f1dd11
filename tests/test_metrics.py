"""The scheduler's Prometheus metrics in process: counted by their deltas, on a fake clock.

The end-to-end scrape of /metrics is tests/test_e2e_metrics.py.
"""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from activity.metrics import MetricsObserver, QueueCollector, export
from scheduler.dispatcher import Outcome
from scheduler.testing import FakeProcessFactory
from tests.helpers import FakeClock, granted, make_config, until

pytestmark = pytest.mark.timeout(10)

BANDS = ("interactive", "normal", "batch")
TERMS = ("aging", "swap_affinity")


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def counters() -> dict[tuple[str, ...], float]:
    """Every dispatched and reorder series, for deltas."""
    out = {("dispatched", b): sample("llamaswap_scheduler_dispatched_total", band=b) for b in BANDS}
    for b in BANDS:
        for t in TERMS:
            out[("reorders", b, t)] = sample("llamaswap_scheduler_reorders_total", band=b, term=t)
    return out


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.fixture
async def world(dispatchers):
    """``await world(*models, **settings)`` -> (dispatcher, clock), metrics observed."""

    async def build(*models, **serial):
        clock = FakeClock()
        config = make_config(*models, **serial)
        observer = MetricsObserver(config, clock=clock)
        d = await dispatchers(
            config, process_factory=FakeProcessFactory(), clock=clock, observers=[observer]
        )
        return d, clock

    return build


async def test_reorders_are_counted_by_band_and_term(world):
    d, clock = await world("a", "b", agingDivisor=60, swapAffinityBonus=10)
    a, b = d.config.models["a"], d.config.models["b"]
    blocker = d.submit(a, 100, "blocker", "/v1/chat/completions")
    await granted(blocker)
    before = counters()

    # Affinity: 'b' arrived first, but 'a' is loaded and its bonus (10) outweighs 1 s of aging.
    other = d.submit(b, 0, "other", "/v1/chat/completions")
    clock.now += 1
    same = d.submit(a, 0, "same", "/v1/chat/completions")
    await until(lambda: len(d.queue) == 2)
    d.finish(blocker, Outcome.COMPLETED, 200)
    await granted(same)
    d.finish(same, Outcome.COMPLETED, 200)
    await granted(other)  # alone in the queue: no reorder
    # Aging: a batch job that waited 3 hours beats a fresh normal one, which even has the
    # affinity bonus ('b' is loaded now): -100 + 180 > 0 + 10.
    old_batch = d.submit(a, -100, "old-batch", "/v1/chat/completions")
    clock.now += 3 * 3600
    fresh = d.submit(b, 0, "fresh", "/v1/chat/completions")
    await until(lambda: len(d.queue) == 2)
    d.finish(other, Outcome.COMPLETED, 200)
    await granted(old_batch)
    assert not fresh.granted.done()
    assert old_batch.decision.reordered_by == frozenset({"aging"})

    assert delta(before, counters()) == {
        ("dispatched", "normal"): 2,
        ("dispatched", "batch"): 1,
        ("reorders", "normal", "swap_affinity"): 1,
        ("reorders", "batch", "aging"): 1,
    }


async def test_queue_gauges_are_read_at_scrape_time(world):
    d, clock = await world("a")
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: d))
    a = d.config.models["a"]
    blocker = d.submit(a, 0, "blocker", "/v1/chat/completions")
    await granted(blocker)
    d.submit(a, -100, "b1", "/v1/chat/completions")
    clock.now += 2
    d.submit(a, -98, "b2", "/v1/chat/completions")
    d.submit(a, 100, "i1", "/v1/chat/completions")
    await until(lambda: len(d.queue) == 3)
    clock.now += 5
    families = {f.name: f for f in text_string_to_metric_families(export(registry).decode())}
    depth = {s.labels["band"]: s.value for s in families["llamaswap_scheduler_queue_depth"].samples}
    oldest = {
        s.labels["band"]: s.value
        for s in families["llamaswap_scheduler_queue_oldest_wait_seconds"].samples
    }
    assert depth == {"interactive": 1, "normal": 0, "batch": 2}
    assert oldest == {"interactive": 5.0, "normal": 0.0, "batch": 7.0}
    assert families["llamaswap_scheduler_queue_depth"].type == "gauge"


def test_collector_without_a_server_reports_zeros():
    registry = CollectorRegistry()
    registry.register(QueueCollector(lambda: None))
    text = export(registry).decode()
    for band in BANDS:
        assert f'llamaswap_scheduler_queue_depth{{band="{band}"}} 0.0' in text
        assert f'llamaswap_scheduler_queue_oldest_wait_seconds{{band="{band}"}} 0.0' in text


async def test_durations_swaps_and_loads(world):
    d, clock = await world("a")
    a = d.config.models["a"]
    swaps = sample("llamaswap_model_swaps_total", model="a")
    loads = sample("llamaswap_model_load_duration_seconds_count", model="a")
    done = sample("llamaswap_request_duration_seconds_count", band="batch", outcome="completed")
    took = sample("llamaswap_request_duration_seconds_sum", band="batch", outcome="completed")
    gone = sample(
        "llamaswap_request_duration_seconds_count", band="normal", outcome="cancelled_waiting"
    )
    ticket = d.submit(a, -100, "job", "/v1/chat/completions")
    await granted(ticket)
    waiter = d.submit(a, 0, "leaver", "/v1/chat/completions")
    await until(lambda: len(d.queue) == 1)
    d.cancel(waiter)
    clock.now += 12.5  # a long stream: timed to the dispatcher's finish, not the headers
    d.finish(ticket, Outcome.COMPLETED, 200)
    await until(
        lambda: (
            sample("llamaswap_request_duration_seconds_count", band="batch", outcome="completed")
            > done
        )
    )
    assert sample("llamaswap_model_swaps_total", model="a") == swaps + 1
    assert sample("llamaswap_model_load_duration_seconds_count", model="a") == loads + 1
    assert sample(
        "llamaswap_request_duration_seconds_sum", band="batch", outcome="completed"
    ) == pytest.approx(took + 12.5)
    assert (
        sample(
            "llamaswap_request_duration_seconds_count", band="normal", outcome="cancelled_waiting"
        )
        == gone + 1
    )
