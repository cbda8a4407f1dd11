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
    assert "http://" not in html.split("<body>")[0]  # nothing from elsewhere
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


# -- a request that is not in the log -----------------------------------------------------


def test_unknown_request_is_a_404_page_in_the_dashboard_layout(client):
    response = client.get("/requests/nope/")
    html = response.content.decode()
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")
    assert '<header class="top">' in html and "/static/dashboard/dashboard.css" in html
    assert '<a href="/history/" class="active">History</a>' in html
    assert "<h1>No such request</h1>" in html
    assert "There is no request" in html and "nope" in html and "in the activity log" in html
    assert 'href="/history/?request_id=nope"' in html  # search for ids starting with it


def test_a_running_request_is_shown_as_running_not_missing(client, monkeypatch):
    from dashboard import queue

    row = {
        "request_id": "busy-1",
        "state": "running",
        "model": "a",
        "lane": "default",
        "band": "normal",
        "priority": 0,
        "key": "",
        "waited": 0.0,
        "elapsed": 12.5,
        "in_flight": True,
    }

    async def status(dispatcher, request_id):
        return row if request_id == "busy-1" else None

    monkeypatch.setattr(queue, "status_on_loop", status)
    response = client.get("/requests/busy-1/")
    assert response.status_code == 200
    html = response.content.decode()
    assert "Running now on <strong>a</strong>" in html
    assert 'data-request-id="busy-1"' in html  # the page follows it live


# -- history filters that cannot be used ----------------------------------------------------


def test_bad_history_filters_are_a_400_that_says_which_value_and_what_works(client):
    _record("r1", dispatched=1)
    response = client.get("/history/?band=bogus&start=yesterday")
    html = response.content.decode()
    assert response.status_code == 400
    assert "These filters cannot be used" in html
    # which filter, which value, what is accepted
    assert "band: there is no band &#x27;bogus&#x27;; use interactive, normal, batch" in html
    assert "&#x27;start&#x27; is not a filter here: use since" in html
    assert "no recorded requests match" not in html  # no silently empty table
    assert 'name="since"' in html  # the form stays to fix it
    # an impossible date is the same page
    response = client.get("/history/?since=2026-02-30")
    assert (
        response.status_code == 400 and "These filters cannot be used" in response.content.decode()
    )
    assert (
        "since: there is no such date or time as &#x27;2026-02-30&#x27;"
        in response.content.decode()
    )
    response = client.get("/history/?until=yesterday&tz=Mars/Olympus")
    html = response.content.decode()
    assert response.status_code == 400
    assert "until: expected a date like 2026-11-29" in html and "yesterday" in html
    assert "tz: there is no time zone &#x27;Mars/Olympus&#x27;" in html
    assert client.get("/history/?x=1").status_code == 400


def test_history_reads_since_and_until_in_the_browsers_zone(client):
    for i in range(10):
        _record(f"t{i}", arrived=i * 60, dispatched=i * 60 + 1)  # 12:00 .. 12:09 UTC
    # 13:05 in Berlin (UTC+1 in November) is 12:05 UTC
    html = client.get("/history/?since=2026-11-29T13:05&tz=Europe/Berlin").content.decode()
    assert "5 requests" in html
    html = client.get("/history/?since=2026-11-29T12:05").content.decode()  # no zone: UTC
    assert "5 requests" in html
    html = client.get("/history/?until=2026-11-29T07:02&tz=America/New_York").content.decode()
    assert "3 requests" in html


# -- one time convention --------------------------------------------------------------------


def test_times_are_time_elements_in_utc_that_the_page_shows_in_local_time(client):
    _record("r1", arrived=0.25, dispatched=5)
    html = client.get("/history/").content.decode()
    assert (
        '<time datetime="2026-11-29T12:00:00.250Z" data-show="datetime">2026-11-29 12:00:00</time>'
        in html
    )
    assert "(UTC)" not in html  # the zone is named once, in the header
    assert '<span class="tz-caption" title="24-hour times in UTC">times in UTC</span>' in html
    assert '<script src="/static/dashboard/time.js"></script>' in html
    assert '<input type="hidden" name="tz" value="">' in html
    page = client.get("/requests/r1/").content.decode()
    assert '<time datetime="2026-11-29T12:00:05.000Z" data-show="time">12:00:05</time>' in page
    assert "UTC" not in page.split("<main>")[1]
    assert client.get("/static/dashboard/time.js").status_code == 200


def test_timetag_filter():
    from dashboard.templatetags.dash import timetag

    assert timetag(None) == "–"
    assert timetag(1764417600.5, "time") == (
        '<time datetime="2025-11-29T12:00:00.500Z" data-show="time">12:00:00</time>'
    )
    berlin = datetime(2026, 11, 29, 13, 0, tzinfo=__import__("zoneinfo").ZoneInfo("Europe/Berlin"))
    assert 'datetime="2026-11-29T12:00:00.000Z"' in timetag(berlin, "zoned")
    assert ">2026-11-29 12:00:00 UTC</time>" in timetag(berlin, "zoned")


def test_times_written_into_text_become_time_elements():
    from dashboard.templatetags.dash import local_stamps

    html = local_stamps("admin edit: bonus by <b> at 2026-12-01 04:10:17 UTC (the rest)")
    assert html == (
        "admin edit: bonus by &lt;b&gt; at "
        '<time datetime="2026-12-01T04:10:17.000Z" data-show="zoned">2026-12-01 04:10:17 UTC</time>'
        " (the rest)"
    )


# -- "uncontested" ----------------------------------------------------------------------------


def test_a_request_picked_alone_is_uncontested(client):
    _record("alone", arrived=0, dispatched=0.1)  # no runner-up: nothing else waited
    _record("beat-one", arrived=10, dispatched=10.1, runner_up_id="other")
    _record("aged", arrived=20, dispatched=21, runner_up_id="x", reordered_by=["aging"])
    html = client.get("/history/").content.decode()
    rows = {
        rid: html.split(f">{rid}</a>")[1].split("</tr>")[0] for rid in ("alone", "beat-one", "aged")
    }
    assert ">uncontested</span>" in rows["alone"] and "priority · arrival" not in rows["alone"]
    assert "priority · arrival" in rows["beat-one"] and "uncontested" not in rows["beat-one"]
    assert '<span class="term">aging</span>' in rows["aged"]
    page = client.get("/requests/alone/").content.decode()
    assert "uncontested</span>: no other request was waiting when it was picked" in page


def test_pick_reason_of_live_decisions():
    from dashboard.templatetags.dash import pick_reason

    assert "uncontested" in pick_reason({"reordered_by": [], "runner_up_id": None})
    assert pick_reason({"reordered_by": [], "runner_up_id": "b"}) == "priority · arrival"
    assert pick_reason({"reordered_by": ["swap_affinity"], "runner_up_id": "b"}) == (
        '<span class="term">swap affinity</span>'
    )


# -- favicon ----------------------------------------------------------------------------------


def test_favicon_is_served_and_linked(client, settings):
    settings.DASHBOARD_REQUIRE_LOGIN = True  # the icon is open even then
    response = client.get("/favicon.ico")
    assert response.status_code == 200 and response["Content-Type"] == "image/x-icon"
    assert response.content[:4] == b"\x00\x00\x01\x00"  # an ICO (with a PNG inside)
    assert b"\x89PNG" in response.content
    assert client.head("/favicon.ico").status_code == 200
    assert client.post("/favicon.ico").status_code == 405
    svg = client.get("/static/dashboard/favicon.svg")
    assert svg.status_code == 200 and b"<svg" in b"".join(svg.streaming_content)
    settings.DASHBOARD_REQUIRE_LOGIN = False
    html = client.get("/history/").content.decode()
    assert '<link rel="icon" href="/static/dashboard/favicon.svg" type="image/svg+xml">' in html
    assert '<link rel="icon" href="/favicon.ico" sizes="32x32">' in html


async def test_favicon_goes_through_the_pages_handler():
    from llamaswap_site.asgi import application
    from tests.asgi import Call
    from web.paths import wants_json

    assert not wants_json("/favicon.ico")  # a page path, not a proxy one
    call = Call(application, "/favicon.ico", b"", method="GET")
    await call.done(timeout=10)
    assert call.status == 200 and call.headers[b"content-type"] == b"image/x-icon"
    assert call.body.startswith(b"\x00\x00\x01\x00")


# -- /v1/models --------------------------------------------------------------------------------


async def test_v1_models_gives_a_real_created_time():
    import json
    import time

    from scheduler.config import parse_config
    from tests.asgi import Call, in_process

    config = parse_config({"models": {"m": {"cmd": "fake", "proxy": "http://127.0.0.1:9"}}})
    async with in_process(config) as world:
        call = Call(world.app, "/v1/models", b"", method="GET")
        await call.done(timeout=10)
    (model,) = json.loads(call.body)["data"]
    assert model["id"] == "m" and isinstance(model["created"], int)
    # the server's start: after 2020, not in the future
    assert 1_577_836_800 < model["created"] <= time.time()


def test_history_filters_by_api_key_and_the_request_page_names_it(client):
    _record("capped-1", arrived=1, dispatched=2, priority=0, api_key="batch-farm", requested_priority=100)
    _record("plain-1", arrived=3, dispatched=4)
    by_key = client.get("/history/?api_key=batch-farm").content.decode()
    assert "1 request" in by_key and "capped-1" in by_key and "plain-1" not in by_key
    page = client.get("/requests/capped-1/").content.decode()
    assert "batch-farm" in page
    assert "asked for 100" in page  # the key's ceiling cut it to 0
    plain = client.get("/requests/plain-1/").content.decode()
    assert "API key" not in plain and "asked for" not in plain
