"""The queue page's table and a waiting request's status (dashboard/queue.py) over a real
dispatcher with fake model processes: search, paging, places, estimates and their bounds."""

from __future__ import annotations

import pytest

from dashboard import queue
from scheduler.testing import FakeProcessFactory
from tests.helpers import granted, make_config, settle

pytestmark = pytest.mark.timeout(10)


@pytest.fixture(autouse=True)
def fresh_ranking(monkeypatch):
    monkeypatch.setattr(queue, "_ranking", None)


def submit(d, model, priority, rid, key=""):
    ticket = d.submit(d.config.models[model], priority, rid, "/v1/chat/completions")
    ticket.api_key = key
    return ticket


async def test_search_paging_places_and_the_running_job(dispatchers, monkeypatch):
    monkeypatch.setattr(queue, "PAGE_SIZE", 10)
    monkeypatch.setattr(queue, "RANK_LIMIT", 20)
    d = await dispatchers(make_config("a", "b"), process_factory=FakeProcessFactory())
    running = submit(d, "a", 0, "run-1")
    await granted(running)
    tickets = [submit(d, "a", 0, f"wait-{i:03d}") for i in range(30)]
    submit(d, "b", -100, "needle-xyz", key="nightly")
    await settle()

    first = queue.table(d, [], "all", 1)
    assert (first["running"], first["waiting"], first["matched"], first["pages"]) == (1, 31, 32, 4)
    rows = first["rows"]
    assert len(rows) == 10  # one page, never the whole queue
    assert rows[0]["request_id"] == "run-1" and rows[0]["state"] == "running"
    assert [r["position"] for r in rows[1:]] == list(range(1, 10))
    assert (
        rows[1]["estimate"]["low"] <= rows[1]["estimate"]["seconds"] <= rows[1]["estimate"]["high"]
    )

    last = queue.table(d, [], "all", 4)["rows"]
    assert len(last) == 2  # 32 rows: 10 + 10 + 10 + 2
    assert all(r["position"] is None and r["beyond"]["after"] == 20 for r in last)

    for words in (["needle"], ["nightly"], ["b", "batch"], ["XYZ".lower()]):
        found = queue.table(d, words, "all", 1)
        assert [r["request_id"] for r in found["rows"]] == ["needle-xyz"], words
    assert queue.table(d, ["wait-001", "batch"], "all", 1)["rows"] == []  # every word
    assert queue.table(d, ["run"], "waiting", 1)["rows"] == []
    assert [r["request_id"] for r in queue.table(d, ["run"], "running", 1)["rows"]] == ["run-1"]

    status = queue.status(d, "wait-000")
    assert status is not None
    assert (status["position"], status["depth"], status["running_job"]["request_id"]) == (
        1,
        31,
        "run-1",
    )
    assert queue.status(d, "run-1")["state"] == "running"
    assert queue.status(d, "nobody") is None
    for t in [running, *tickets]:
        d.cancel(t)


def test_bad_queries_are_named():
    assert queue.parse_query({"q": "a b", "state": "waiting", "page": "2"}) == (
        ["a", "b"],
        "waiting",
        2,
    )
    for params, word in (
        ({"q": "x" * 201}, "q:"),
        ({"q": " ".join("w" * 9)}, "q:"),
        ({"state": "done"}, "state:"),
        ({"page": "0"}, "page:"),
        ({"page": "two"}, "page:"),
    ):
        with pytest.raises(queue.BadQuery, match=word):
            queue.parse_query(params)


def test_log_lines_around_a_failure_are_the_models_and_bounded():
    entries = [
        (i, 1000.0 + i / 2, "m" if i % 2 else "other", f"line {i}\n".encode()) for i in range(240)
    ]
    lines = queue.lines_around(entries, "m", at=1100.0)
    assert len(lines) == queue.LOG_LINES  # the last ones
    assert lines[-1]["line"] == "line 209"  # up to LOG_AFTER seconds after it, its model's
    assert all(1040.0 <= line["at"] <= 1105.0 for line in lines)
    long = [(1, 1000.0, "m", b"x" * 5000)]
    assert len(queue.lines_around(long, "m", at=1000.0)[0]["line"]) == queue.LOG_LINE_CHARS


async def test_a_request_page_sees_its_request_that_arrived_after_the_last_ranking(dispatchers):
    d = await dispatchers(make_config("a"), process_factory=FakeProcessFactory())
    running = submit(d, "a", 0, "run-1")
    await granted(running)
    first = submit(d, "a", 0, "first")
    await settle()
    assert queue.status(d, "first")["position"] == 1  # ranked now, reused for a second
    late = submit(d, "a", 0, "late")
    await settle()
    status = queue.status(d, "late")
    assert (status["position"], status["depth"]) == (2, 2)
    for t in (running, first, late):
        d.cancel(t)


async def test_an_api_key_cancels_only_its_own_requests_unless_it_is_an_operator(dispatchers):
    """``POST /api/inflight/{id}/cancel`` with a key: its own request, or any with the
    operator scope (a staff session, which has no key here, may cancel any)."""
    import asyncio
    import json

    from django.test import RequestFactory

    from proxy.uiapi import cancel_inflight
    from scheduler.keys import ApiKey, Scope
    from web import cancel

    d = await dispatchers(make_config("a"), process_factory=FakeProcessFactory())
    ticket = submit(d, "a", 0, "mine-1", key="alice")
    hold = asyncio.Event()

    async def client():
        cancel.track(ticket)
        await hold.wait()

    task = asyncio.create_task(client())
    await settle()

    def post(key):
        request = RequestFactory().post("/api/inflight/mine-1/cancel")
        request.scope = {"llamaswap.api_key": key}
        return request

    refused = await cancel_inflight(post(ApiKey("bob")), "mine-1")
    assert refused.status_code == 403
    assert json.loads(refused.content)["error"]["code"] == "insufficient_scope"
    assert not task.done()
    operator = ApiKey("ops", scopes=frozenset({Scope.OPERATOR}))
    assert (await cancel_inflight(post(operator), "mine-1")).status_code == 200
    assert ticket.extra["cancelled_by"] == "API key ops"
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    d.cancel(ticket)


async def test_a_key_cancels_its_own_request(dispatchers):
    import asyncio

    from django.test import RequestFactory

    from proxy.uiapi import cancel_inflight
    from scheduler.keys import ApiKey
    from web import cancel

    d = await dispatchers(make_config("a"), process_factory=FakeProcessFactory())
    ticket = submit(d, "a", 0, "mine-2", key="alice")

    async def client():
        cancel.track(ticket)
        await asyncio.Event().wait()

    task = asyncio.create_task(client())
    await settle()
    request = RequestFactory().post("/api/inflight/mine-2/cancel")
    request.scope = {"llamaswap.api_key": ApiKey("alice")}
    assert (await cancel_inflight(request, "mine-2")).status_code == 200
    await asyncio.gather(task, return_exceptions=True)
    assert ticket.extra["cancelled_by"] == "API key alice"
    d.cancel(ticket)
