"""The server-rendered pages: dashboard first paint, history filters, a request's story."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from activity.models import RequestRecord

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def _record(
    request_id,
    model="a",
    priority=0,
    band="normal",
    arrived=0.0,
    dispatched=None,
    finished=None,
    **extra,
):
    at = lambda s: None if s is None else T0 + timedelta(seconds=s)  # noqa: E731
    values = dict(
        request_id=request_id,
        model=model,
        path="/v1/chat/completions",
        priority=priority,
        band=band,
        policy="serial",
        arrived_at=at(arrived),
        dispatched_at=at(dispatched),
        finished_at=at(finished if finished is not None else (dispatched or arrived) + 1),
        outcome="completed",
        status=200,
        duration_ms=((finished or (dispatched or arrived) + 1) - arrived) * 1000,
        queue_wait_ms=None if dispatched is None else (dispatched - arrived) * 1000,
        aging_divisor=60,
        swap_affinity_bonus=10,
        needs_swap=False,
        affinity=0.0,
        aging=0.0 if dispatched is None else (dispatched - arrived) / 60,
    )
    values.update(extra)
    if values.get("score") is None and dispatched is not None:
        values["score"] = priority + values["affinity"] + values["aging"]
    return RequestRecord.objects.create(**values)


def test_dashboard_first_paint_is_rendered_on_the_server(client):
    response = client.get("/")
    html = response.content.decode()
    assert response.status_code == 200
    for band in ("interactive", "normal", "batch"):
        assert f'data-band="{band}"' in html
    assert 'id="waiting-rows"' in html and "nothing waiting" in html
    assert 'id="initial-snapshot"' in html
    assert "/static/dashboard/vendor/uplot/uPlot.iife.min.js" in html  # served locally
    assert "http://" not in html.split("<body>")[0].replace(
        'href="data:,"', ""
    )  # nothing from elsewhere
    assert client.get("/dashboard/").status_code == 200


def test_read_only_pages_can_require_a_login(client, settings):
    settings.DASHBOARD_REQUIRE_LOGIN = True
    for url in ("/", "/history/", "/requests/abc/"):
        response = client.get(url)
        assert response.status_code == 302 and response["Location"].startswith("/admin/login/"), url


def test_history_filters_and_pages(client):
    for i in range(60):
        _record(
            f"req{i:03d}", model="a" if i % 2 else "b", arrived=i, dispatched=i + 0.5, band="normal"
        )
    _record("batch-1", model="b", priority=-100, band="batch", arrived=100, dispatched=130)
    page1 = client.get("/history/").content.decode()
    assert "page 1 of 2 · 61 requests" in page1
    assert "batch-1" in page1  # newest first
    page2 = client.get("/history/?page=2").content.decode()
    assert "page 2 of 2" in page2 and "req000" in page2
    only_batch = client.get("/history/?band=batch").content.decode()
    assert "1 request" in only_batch and "batch-1" in only_batch
    only_a = client.get("/history/?model=a").content.decode()
    assert "30 requests" in only_a
    by_id = client.get("/history/?request_id=req05").content.decode()
    assert "10 requests" in by_id
    by_time = client.get(
        "/history/?since=2026-11-29T12:00:50&until=2026-11-29T12:00:59"
    ).content.decode()
    assert "10 requests" in by_time


def test_request_page_says_why_it_waited(client):
    _record(
        "running", model="b", priority=-100, band="batch", arrived=0, dispatched=0, finished=600
    )
    _record(
        "urgent",
        model="b",
        priority=100,
        band="interactive",
        arrived=100,
        dispatched=600,
        finished=900,
    )
    _record(
        "mine", model="a", priority=0, arrived=10, dispatched=900, finished=910, needs_swap=True
    )
    _record("later", model="a", priority=0, arrived=20, dispatched=910, finished=920)
    html = client.get("/requests/mine/").content.decode()
    assert "14m 50s" in html  # its wait
    assert "2 jobs ran before it" in html
    assert "already running when it arrived" in html
    assert ">priority</span> +100" in html  # the interactive job won on priority
    assert "later" not in html.split("Jobs that went first")[1]


def test_unknown_request_is_404(client):
    assert client.get("/requests/nope/").status_code == 404
