"""The activity log: the recorder's rows, its buffering and retries, retention, the API.

An in-process dispatcher over fake model processes, on a fake clock, with a real database
(pytest-django; SQLite by default, PostgreSQL when DATABASE_URL says so: .ci/run runs
this module both ways, `-m django_db`).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import sync_to_async
from django.core.management import call_command
from django.db import OperationalError
from django.test import Client
from prometheus_client import REGISTRY

from activity.models import RequestRecord
from activity.recorder import Recorder
from activity.rows import prune, write_records
from scheduler.dispatcher import Dispatcher, Outcome
from scheduler.testing import FakeProcessFactory
from tests.helpers import WALL0, FakeClock, granted, make_config, until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(20)]

@pytest.fixture
async def world():
    """``await world(*models, **settings)`` -> (dispatcher, recorder, clock); all stopped after."""
    built = []

    async def build(*models, recorder_options=None, **kwargs):
        clock = FakeClock()
        config = make_config(*models, **kwargs)
        recorder = Recorder(config.scheduler, clock=clock, **(recorder_options or {}))
        dispatcher = Dispatcher(
            config,
            process_factory=FakeProcessFactory(),
            clock=clock,
            wall_clock=clock.wall,
            observers=[recorder],
        )
        await dispatcher.start()
        built.append((dispatcher, recorder))
        return dispatcher, recorder, clock

    yield build
    for dispatcher, recorder in built:
        await dispatcher.stop(grace=0)
        await recorder.stop(timeout=2)


def rows() -> list[RequestRecord]:
    return list(RequestRecord.objects.order_by("id"))


arows = sync_to_async(rows, thread_sensitive=True)


def dropped_total() -> float:
    return REGISTRY.get_sample_value("llamaswap_activity_records_dropped_total") or 0.0


# -- what a row says ---------------------------------------------------------------------


async def test_serial_rows_carry_the_decision_and_the_spec_keys(world):
    dispatcher, recorder, clock = await world("a", agingDivisor=60, swapAffinityBonus=10)
    a = dispatcher.config.models["a"]
    first = dispatcher.submit(a, 0, "first", "/v1/chat/completions")
    await granted(first)
    clock.advance(1)
    batch = dispatcher.submit(a, -100, "batch", "/v1/chat/completions")
    clock.advance(2)
    urgent = dispatcher.submit(a, 100, "urgent", "/v1/chat/completions")
    await until(lambda: len(dispatcher.queue) == 2)
    clock.advance(3)
    dispatcher.finish(first, Outcome.COMPLETED, 200)
    await granted(urgent)
    urgent.extra["usage"] = {
        "prompt_tokens": 12,
        "completion_tokens": 30,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    urgent.extra["timings"] = {"prompt_per_second": 900.5, "predicted_per_second": 42.25}
    clock.advance(0.5)
    dispatcher.finish(urgent, Outcome.COMPLETED, 200)
    await granted(batch)
    dispatcher.finish(batch, Outcome.FAILED, 502, "upstream broke off")
    await until(lambda: recorder.pending == 3)
    await recorder.flush()

    by_id = {r.request_id: r for r in await arows()}
    assert set(by_id) == {"first", "batch", "urgent"}
    r = by_id["urgent"]
    # The spec's keys, exact names and JSON types: waited 3 s, loaded model (+10), aged 3/60.
    assert r.metadata() == {
        "serial_priority": 100,
        "serial_band": "interactive",
        "serial_score": pytest.approx(100 + 10 + 3 / 60),
        "serial_queue_wait_ms": pytest.approx(3000.0),
    }
    meta = r.metadata()
    assert type(meta["serial_priority"]) is int and type(meta["serial_band"]) is str
    assert type(meta["serial_score"]) is float and type(meta["serial_queue_wait_ms"]) is float
    assert r.outcome == "completed" and r.status == 200
    assert r.arrived_at == datetime.fromtimestamp(WALL0 + 1003, tz=UTC)
    assert r.dispatched_at == datetime.fromtimestamp(WALL0 + 1006, tz=UTC)
    assert r.duration_ms == pytest.approx(3500.0)
    assert r.affinity == 10.0 and r.aging == pytest.approx(3 / 60)
    assert r.runner_up_id == "batch" and r.needs_swap is False and r.load_ms is None
    assert r.reordered_by == []
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (12, 30, 4)
    assert (r.prompt_per_second, r.tokens_per_second) == (900.5, 42.25)
    assert (r.aging_divisor, r.swap_affinity_bonus) == (60.0, 10)

    first_row = by_id["first"]
    assert first_row.needs_swap is True and first_row.load_ms is not None
    failed = by_id["batch"]
    assert (failed.outcome, failed.status, failed.error) == ("failed", 502, "upstream broke off")
    assert failed.metadata()["serial_band"] == "batch"
    assert failed.metadata()["serial_queue_wait_ms"] == pytest.approx(5500.0)  # 1001 -> 1006.5


async def test_cancelled_while_waiting_is_recorded_undispatched(world):
    dispatcher, recorder, clock = await world("a")
    a = dispatcher.config.models["a"]
    running = dispatcher.submit(a, 0, "running", "/v1/chat/completions")
    await granted(running)
    gone = dispatcher.submit(a, -100, "gone", "/v1/chat/completions")
    await until(lambda: len(dispatcher.queue) == 1)
    clock.advance(4)
    dispatcher.cancel(gone)
    await until(lambda: recorder.pending == 1)
    await recorder.flush()

    [row] = await arows()
    assert row.request_id == "gone"
    assert row.outcome == "cancelled_waiting"
    assert row.dispatched_at is None and row.score is None and row.status is None
    assert row.duration_ms == pytest.approx(4000.0)
    # Never dispatched: who it was, but no score it never had.
    assert row.metadata() == {"serial_priority": -100, "serial_band": "batch"}


async def test_rows_name_the_api_key_and_what_its_ceiling_cut(world):
    dispatcher, recorder, clock = await world("a")
    a = dispatcher.config.models["a"]
    ticket = dispatcher.submit(a, 0, "keyed", "/v1/chat/completions")
    ticket.api_key, ticket.requested_priority = "batch-farm", 100
    await granted(ticket)
    dispatcher.finish(ticket, Outcome.COMPLETED, 200)
    await until(lambda: recorder.pending == 1)
    await recorder.flush()
    [row] = await arows()
    assert (row.api_key, row.priority, row.requested_priority) == ("batch-farm", 0, 100)


async def test_fifo_rows_carry_fifo_priority(world):
    dispatcher, recorder, _ = await world("a", "b", use="fifo", fifo={"a": 10})
    a = dispatcher.config.models["a"]
    ticket = dispatcher.submit(a, -100, "f1", "/v1/completions")
    await granted(ticket)
    dispatcher.finish(ticket, Outcome.COMPLETED, 200)
    await until(lambda: recorder.pending == 1)
    await recorder.flush()
    [row] = await arows()
    assert row.policy == "fifo"
    assert row.metadata() == {"fifo_priority": -90}  # model priority 10 + batch header
    assert type(row.metadata()["fifo_priority"]) is int


async def test_reorder_terms_are_recorded(world):
    dispatcher, recorder, clock = await world("a", "b", agingDivisor=60, swapAffinityBonus=10)
    a, b = dispatcher.config.models["a"], dispatcher.config.models["b"]
    blocker = dispatcher.submit(a, 0, "blocker", "/v1/chat/completions")
    await granted(blocker)
    other = dispatcher.submit(b, 0, "other-model", "/v1/chat/completions")
    clock.advance(1)
    same = dispatcher.submit(a, 0, "same-model", "/v1/chat/completions")
    await until(lambda: len(dispatcher.queue) == 2)
    dispatcher.finish(blocker, Outcome.COMPLETED, 200)
    await granted(same)  # arrived later, but needs no swap
    dispatcher.finish(same, Outcome.COMPLETED, 200)
    await granted(other)
    dispatcher.finish(other, Outcome.COMPLETED, 200)
    await until(lambda: recorder.pending == 3)
    await recorder.flush()
    by_id = {r.request_id: r for r in await arows()}
    assert by_id["same-model"].reordered_by == ["swap_affinity"]
    assert by_id["same-model"].runner_up_id == "other-model"
    assert by_id["other-model"].needs_swap is True


# -- buffering, retries, drops -------------------------------------------------------------


async def test_database_outage_buffers_then_saves_everything(world):
    outage = {"on": True, "attempts": 0}

    def flaky(items):
        outage["attempts"] += 1
        if outage["on"]:
            raise OperationalError("database is locked")
        return write_records(items)

    dispatcher, recorder, _ = await world("a", recorder_options={"writer": flaky, "interval": 0.02})
    await recorder.start()
    a = dispatcher.config.models["a"]
    for i in range(5):
        ticket = dispatcher.submit(a, 0, f"r{i}", "/v1/chat/completions")
        await granted(ticket)
        dispatcher.finish(ticket, Outcome.COMPLETED, 200)
    await until(lambda: outage["attempts"] >= 2)
    assert recorder.pending == 5 and await arows() == []
    outage["on"] = False
    await until(lambda: recorder.pending == 0, timeout=5)
    assert [r.request_id for r in await arows()] == [f"r{i}" for i in range(5)]
    assert recorder.dropped == 0


async def test_full_buffer_drops_and_counts(world, caplog):
    def down(items):
        raise OperationalError("could not connect to server")

    dispatcher, recorder, _ = await world("a", recorder_options={"writer": down, "capacity": 3})
    a = dispatcher.config.models["a"]
    before = dropped_total()
    with caplog.at_level(logging.WARNING, logger="llamaswap.recorder"):
        for i in range(5):
            ticket = dispatcher.submit(a, 0, f"r{i}", "/v1/chat/completions")
            await granted(ticket)
            dispatcher.finish(ticket, Outcome.COMPLETED, 200)
        await until(lambda: recorder.dropped == 2)
    assert recorder.pending == 3
    assert dropped_total() - before == 2
    assert any("dropped 1 records" in m or "dropped 2 records" in m for m in caplog.messages)


async def test_a_record_that_cannot_be_built_costs_only_itself(world):
    dispatcher, recorder, _ = await world("a")
    a = dispatcher.config.models["a"]
    for i in range(3):
        ticket = dispatcher.submit(a, 0, f"r{i}", "/v1/chat/completions")
        await granted(ticket)
        if i == 1:
            ticket.arrival_wall = "not a number"  # type: ignore[assignment]
        dispatcher.finish(ticket, Outcome.COMPLETED, 200)
    await until(lambda: recorder.pending == 3)
    before = dropped_total()
    await recorder.flush()
    assert [r.request_id for r in await arows()] == ["r0", "r2"]
    assert recorder.dropped == 1 and dropped_total() - before == 1


async def test_a_retried_batch_is_not_saved_twice(world):
    dispatcher, recorder, _ = await world("a")
    a = dispatcher.config.models["a"]
    ticket = dispatcher.submit(a, 0, "once", "/v1/chat/completions")
    await granted(ticket)
    dispatcher.finish(ticket, Outcome.COMPLETED, 200)
    await until(lambda: recorder.pending == 1)
    items = list(recorder._buffer)
    save = sync_to_async(write_records, thread_sensitive=True)
    assert await save(items) == 0
    assert await save(items) == 0  # e.g. the commit landed but its answer was lost
    assert len(await arows()) == 1


async def test_stop_saves_what_is_buffered(world):
    dispatcher, recorder, _ = await world("a", recorder_options={"interval": 60})
    await recorder.start()
    a = dispatcher.config.models["a"]
    ticket = dispatcher.submit(a, 0, "last", "/v1/chat/completions")
    await granted(ticket)
    dispatcher.finish(ticket, Outcome.COMPLETED, 200)
    await until(lambda: recorder.pending == 1)
    await recorder.stop()
    assert [r.request_id for r in await arows()] == ["last"]


# -- retention -----------------------------------------------------------------------------


def make_row(request_id: str, arrived: datetime, **fields) -> RequestRecord:
    values = {
        "model": "m",
        "path": "/v1/chat/completions",
        "priority": 0,
        "band": "normal",
        "policy": "serial",
        "finished_at": arrived + timedelta(seconds=1),
        "outcome": "completed",
        "status": 200,
        "duration_ms": 1000.0,
    }
    values.update(fields)
    return RequestRecord.objects.create(request_id=request_id, arrived_at=arrived, **values)


def test_prune_keeps_days_and_rows():
    now = datetime(2026, 6, 1, tzinfo=UTC)
    for i in range(3):
        make_row(f"old{i}", now - timedelta(days=40, minutes=i))
    for i in range(5):
        make_row(f"new{i}", now - timedelta(hours=1, minutes=-i))
    assert prune(30, 0, now=now, chunk=2) == 3
    assert prune(30, 3, now=now, chunk=2) == 2
    assert sorted(RequestRecord.objects.values_list("request_id", flat=True)) == [
        "new2",
        "new3",
        "new4",
    ]
    assert prune(0, 0, now=now) == 0


def test_prune_activity_command(capsys):
    now = datetime.now(UTC)
    make_row("ancient", now - timedelta(days=400))
    make_row("recent", now)
    call_command("prune_activity", days=30, rows=0)
    assert list(RequestRecord.objects.values_list("request_id", flat=True)) == ["recent"]
    assert "pruned 1 activity rows" in capsys.readouterr().out


# -- the API -------------------------------------------------------------------------------


@pytest.fixture
def history():
    """Three requests: 'slow' waited while 'first' and 'jumper' went ahead of it."""
    t0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    s = timedelta(seconds=1)
    make_row("first", t0, dispatched_at=t0, finished_at=t0 + 10 * s, score=0.0, queue_wait_ms=0.0)
    make_row(
        "slow",
        t0 + 2 * s,
        priority=-100,
        band="batch",
        dispatched_at=t0 + 20 * s,
        finished_at=t0 + 25 * s,
        score=-89.7,
        affinity=10.0,
        aging=0.3,
        queue_wait_ms=18000.0,
        runner_up_id="",
        reordered_by=[],
        aging_divisor=60.0,
        swap_affinity_bonus=10,
    )
    make_row(
        "jumper",
        t0 + 5 * s,
        model="other",
        priority=100,
        band="interactive",
        dispatched_at=t0 + 10 * s,
        finished_at=t0 + 20 * s,
        score=110.08,
        affinity=10.0,
        aging=0.08,
        queue_wait_ms=5000.0,
        reordered_by=["swap_affinity"],
    )
    make_row("gone", t0 + 6 * s, outcome="cancelled_waiting", status=None, finished_at=t0 + 12 * s)
    return t0


def test_activity_lists_newest_first_with_paging(history):
    body = Client().get("/api/metrics/activity", {"limit": 2}).json()
    assert [r["request_id"] for r in body["data"]] == ["gone", "jumper"]
    assert (body["page"], body["limit"], body["total"], body["pages"], body["has_more"]) == (
        1,
        2,
        4,
        2,
        True,
    )
    page2 = Client().get("/api/metrics/activity", {"limit": 2, "page": 2}).json()
    assert [r["request_id"] for r in page2["data"]] == ["slow", "first"]
    assert page2["has_more"] is False
    slow = page2["data"][0]
    assert slow["metadata"] == {
        "serial_priority": -100,
        "serial_band": "batch",
        "serial_score": -89.7,
        "serial_queue_wait_ms": 18000.0,
    }


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"model": "other"}, ["jumper"]),
        ({"band": "batch"}, ["slow"]),
        ({"request_id": "first"}, ["first"]),
        ({"start": "2026-05-01T12:00:03Z"}, ["gone", "jumper"]),  # ISO, inclusive
        ({"end": "2026-05-01T12:00:02+00:00"}, ["slow", "first"]),
        (
            {"start": str(datetime(2026, 5, 1, 12, 0, 5, tzinfo=UTC).timestamp())},
            ["gone", "jumper"],
        ),
        ({"end": "2026-04-30"}, []),  # a date: the whole day
    ],
)
def test_activity_filters(history, params, expected):
    body = Client().get("/api/metrics/activity", params).json()
    assert [r["request_id"] for r in body["data"]] == expected


@pytest.mark.parametrize(
    "params",
    [
        {"limit": "0"},
        {"limit": "1001"},
        {"limit": "x"},
        {"page": "0"},
        {"band": "vip"},
        {"start": "soon"},
    ],
)
def test_activity_rejects_bad_parameters(params):
    r = Client().get("/api/metrics/activity", params)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_parameter"


def test_request_detail_explains_the_wait(history):
    body = Client().get("/api/requests/slow").json()
    assert body["request_id"] == "slow"
    assert body["decision"]["score"] == -89.7
    assert body["decision"]["settings"] == {"agingDivisor": 60.0, "swapAffinityBonus": 10}
    assert [r["request_id"] for r in body["running_at_arrival"]] == ["first"]
    went = body["dispatched_while_waiting"]
    assert [(r["request_id"], r["score"], r["reordered_by"]) for r in went] == [
        ("jumper", 110.08, ["swap_affinity"])
    ]
    assert body["dispatched_while_waiting_total"] == 1


def test_request_detail_of_a_cancelled_request(history):
    body = Client().get("/api/requests/gone").json()
    assert body["outcome"] == "cancelled_waiting" and body["decision"] is None
    # It waited from 12:00:06 until its client left at 12:00:12.
    assert [r["request_id"] for r in body["running_at_arrival"]] == ["first"]
    assert [r["request_id"] for r in body["dispatched_while_waiting"]] == ["jumper"]


def test_unknown_request_is_a_json_404():
    r = Client().get("/api/requests/nope")
    assert r.status_code == 404
    assert r["Content-Type"] == "application/json"
    assert r.json()["error"]["code"] == "request_not_found"
