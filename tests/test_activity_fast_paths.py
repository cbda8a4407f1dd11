"""The activity log's fast paths give what the slow, public ones give.

``activity.rows`` makes a row's database values without Django's adapters (times as
text straight from the float, JSON with a reused encoder) and ``activity.metrics``
updates the label children without ``inc``/``observe``: each is held here to the
library's own result, so a Django or prometheus_client upgrade that changes either
fails a test instead of changing the records or the metrics.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from django.db import connection
from prometheus_client import CollectorRegistry, Counter, Histogram

from activity.metrics import QUEUE_WAIT, REQUEST_DURATION, _adder, _observer
from activity.rows import (
    FIELDS,
    _dumps,
    _params,
    _prepare_connection,
    _statement,
    _utc_text,
    _values,
    snapshot,
    snapshot_fields,
)
from scheduler.core.policy import Decision, Policy, SchedulerSettings, Term
from scheduler.core.priority import Band
from scheduler.dispatcher import Outcome, Ticket
from tests.helpers import make_config


def test_utc_text_is_what_django_stores_for_the_datetime():
    rng = random.Random(7)
    moments = [rng.uniform(0, 4e9) for _ in range(20_000)]
    moments += [1_790_000_000 + k / 2e6 for k in range(-4, 4)]  # half microseconds
    moments += [1_790_000_000.9999995, 1_790_000_000.0, 86_400.0]
    for at in moments:
        assert _utc_text(at) == str(datetime.fromtimestamp(at, UTC).replace(tzinfo=None))


@pytest.mark.parametrize(
    "value",
    [[], ["aging", "swap_affinity"], {"a": 1.5, "b": [1, None, True], "c": "é\n"}, {"x": -0.0}],
)
def test_dumps_is_json_dumps(value):
    assert _dumps(value) == json.dumps(value)


def _tickets() -> list[Ticket]:
    def ticket(**changes) -> Ticket:
        made = Ticket(
            request_id="r1",
            model=make_config("m").models["m"],
            priority=5,
            path="/v1/chat/completions",
            arrival=10.0,
            arrival_wall=1_790_000_000.123457,
            granted=None,  # type: ignore[arg-type]
            outcome=Outcome.COMPLETED,
            status=200,
        )
        for name, value in changes.items():
            setattr(made, name, value)
        return made

    decision = Decision(
        request_id="r1",
        model="m",
        priority=5,
        band=Band.NORMAL,
        policy=Policy.SERIAL,
        score=1.5,
        affinity=1.0,
        aging=0.5,
        queue_wait=0.25,
        reordered_by=frozenset({Term.AGING}),
        runner_up_id="r0",
        runner_up_score=1.0,
        needs_swap=True,
        waiting_after=2,
    )
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 1}}
    timings = {"prompt_n": 3, "predicted_n": 5, "prompt_per_second": 9.5, "predicted_per_second": 2}
    return [
        ticket(),  # never dispatched
        ticket(decision=decision, dispatched_at=10.25, ready_at=10.5, extra={"usage": usage}),
        ticket(
            decision=replace(decision, policy=Policy.FIFO, reordered_by=frozenset(), fifo_priority=2**70),
            dispatched_at=10.000_000_5,
            ready_at=11.0,
            extra={"timings": timings, "peer": "p", "placement": "sent to b"},
        ),
        ticket(outcome=Outcome.FAILED, status=500, error="x" * 3000, load_seconds=2.5),
    ]


@pytest.mark.django_db
def test_a_row_holds_what_djangos_adapters_make_of_the_fields():
    """The fast row against the fields put through Django's own adapters."""
    from activity.models import RequestRecord

    _prepare_connection()
    _, columns = _statement()
    ops = connection.ops
    fields = [f for f in RequestRecord._meta.concrete_fields if not f.primary_key]
    assert {f.name for f in fields} - set(FIELDS) == {"node"}
    for ticket in _tickets():
        snap = snapshot(ticket, SchedulerSettings(), 12.0)
        record = snapshot_fields(snap)
        expected = []
        for field in fields:
            value = record[field.name] if field.name in record else field.get_default()
            if value is not None and field.get_internal_type() == "DateTimeField":
                value = ops.adapt_datetimefield_value(value)
            elif value is not None and field.get_internal_type() == "JSONField":
                value = ops.adapt_json_value(value, field.encoder)  # type: ignore[attr-defined]
            expected.append(value)
        assert _comparable(_params(_values(snap), columns)) == _comparable(tuple(expected))


def _comparable(row: tuple) -> tuple:
    """psycopg's ``Jsonb`` wrappers (PostgreSQL's JSON parameters) compare by identity:
    by their value here."""
    return tuple(("jsonb", v.obj) if type(v).__name__ == "Jsonb" else v for v in row)


def _samples(registry: CollectorRegistry, label: str) -> list[tuple[str, object, float]]:
    return [
        (sample.name, sample.labels.get("le"), sample.value)
        for family in registry.collect()
        for sample in family.samples
        if sample.labels.get("k") == label and not sample.name.endswith("_created")
    ]


@pytest.mark.parametrize("buckets", [REQUEST_DURATION._upper_bounds, QUEUE_WAIT._upper_bounds])
def test_observer_fills_the_buckets_observe_fills(buckets):
    registry = CollectorRegistry()
    histogram = Histogram("h", "h", ["k"], buckets=buckets, registry=registry)
    fast, public = histogram.labels("fast"), histogram.labels("public")
    observe = _observer(fast)
    assert observe != fast.observe  # the fast path, not the fallback
    rng = random.Random(3)
    amounts = [rng.expovariate(0.01) for _ in range(2_000)] + [0.0, -1.0, math.inf]
    amounts += [math.nextafter(b, d) for b in buckets if b != math.inf for d in (0, math.inf)]
    amounts += buckets
    for amount in amounts:
        observe(amount)
        public.observe(amount)
    observe(math.nan)
    public.observe(math.nan)
    fast_samples, public_samples = _samples(registry, "fast"), _samples(registry, "public")
    assert [s[:2] for s in fast_samples] == [s[:2] for s in public_samples]
    for (_, _, got), (_, _, want) in zip(fast_samples, public_samples, strict=True):
        assert got == want or (math.isnan(got) and math.isnan(want))


def test_adder_counts_as_inc_does():
    registry = CollectorRegistry()
    counter = Counter("c", "c", ["k"], registry=registry)
    add = _adder(counter.labels("fast"))
    assert add != counter.labels("fast").inc
    for _ in range(3):
        add(1)
        counter.labels("public").inc()
    assert registry.get_sample_value("c_total", {"k": "fast"}) == 3.0
    assert registry.get_sample_value("c_total", {"k": "public"}) == 3.0
