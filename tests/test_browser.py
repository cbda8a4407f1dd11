"""The dashboard in a real browser: Debian's chromium driven by Playwright, the real server.

Open the dashboard, send requests with different priorities through the proxy, watch the
queue and the decisions change live (no reload), open a request's page; log into the admin,
set swapAffinityBonus to 0 and see the next dispatch follow it. Screenshots are saved in
test-artifacts/ (gitignored). The browser is /usr/bin/chromium (`make test` installs
Debian's package when it is missing); Playwright never downloads one.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.browser import ADMIN_PASSWORD, ARTIFACTS, ensure_admin, launch, log_in, needs_chromium
from tests.server import chat, fake_model, free_port_block, serve

pytestmark = [
    pytest.mark.timeout(90),
    needs_chromium,
]
sync_api = pytest.importorskip("playwright.sync_api")


def _send(url: str, model: str, priority: str, delay: float) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        json=chat(model, fake_delay=delay),
        headers={"X-LlamaSwap-Priority": priority},
        timeout=30,
    )


def _rows(page, tbody: str) -> list[str]:
    return page.eval_on_selector_all(f"{tbody} tr", "rows => rows.map(r => r.innerText)")


def _wait_record(url: str, request_id: str, timeout: float = 10) -> None:
    """The activity log is written in the background: wait until the request is in it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/api/requests/{request_id}", timeout=5).status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"request {request_id} never recorded")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("browser")
    port = free_port_block(2)
    models = {
        "alpha": fake_model(port, load_seconds=0.2),
        "beta": fake_model(port + 1, load_seconds=0.2),
    }
    with serve(tmp, models, migrate=True) as srv:
        ensure_admin(srv, ADMIN_PASSWORD)
        yield srv


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        yield browser
        browser.close()


def test_dashboard_live_request_page_and_admin_edit(server, browser):
    ARTIFACTS.mkdir(exist_ok=True)
    url = server.url
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    pool = ThreadPoolExecutor(8)
    try:
        page.goto(url + "/")
        page.wait_for_selector("body[data-connection=live]", timeout=5000)
        page.evaluate("window.__noReload = true")

        # One request holds the GPU; three more queue behind it with different priorities.
        blocker = pool.submit(_send, url, "alpha", "normal", 2.0)
        page.wait_for_function(
            "document.querySelector('#running-rows').innerText.includes('alpha')", timeout=5000
        )
        waiting = [
            pool.submit(_send, url, "beta", "batch", 0.2),
            pool.submit(_send, url, "alpha", "normal", 0.2),
            pool.submit(_send, url, "beta", "interactive", 0.2),
        ]
        page.wait_for_function(
            "document.querySelectorAll('#waiting-rows tr:not(.empty)').length === 3", timeout=5000
        )
        rows = _rows(page, "#waiting-rows")
        assert ["interactive" in rows[0], "normal" in rows[1], "batch" in rows[2]] == [
            True,
            True,
            True,
        ], rows
        affinity = rows[1].split("\t")[
            6
        ]  # columns: #, request, model, lane, band, priority, affinity
        assert affinity == "10", rows[1]  # alpha is loaded: the normal alpha request has the bonus
        page.screenshot(path=str(ARTIFACTS / "dashboard-queue.png"), full_page=True)

        for future in [blocker, *waiting]:
            assert future.result(timeout=20).status_code == 200
        page.wait_for_function(
            "document.querySelectorAll('#decision-rows tr:not(.empty)').length >= 4"
            " && document.querySelector('#waiting-rows tr.empty') !== null",
            timeout=5000,
        )
        decisions = _rows(page, "#decision-rows")
        # newest first: batch went last, interactive right after the blocker
        assert (
            "batch" in decisions[0] and "normal" in decisions[1] and "interactive" in decisions[2]
        ), decisions
        assert page.evaluate("window.__noReload") is True, "the page reloaded"
        page.screenshot(path=str(ARTIFACTS / "dashboard-decisions.png"), full_page=True)

        # The batch request's page: it waited behind three jobs.
        batch_id = waiting[0].result().headers["X-LlamaSwap-Request-Id"]
        _wait_record(url, batch_id)
        page.click(f"#decision-rows a[href='/requests/{batch_id}/']")
        page.wait_for_selector("text=Jobs that went first", timeout=5000)
        body = page.inner_text("main")
        assert "waited in the queue" in body and "3 jobs ran before it" in body, body
        assert "already running when it arrived" in body and "priority" in body
        page.screenshot(path=str(ARTIFACTS / "request-page.png"), full_page=True)

        # Admin: log in and set swapAffinityBonus to 0.
        log_in(page, url + "/admin/control/schedulersettingsrecord/", ADMIN_PASSWORD)
        page.wait_for_selector("#id_swap_affinity_bonus", timeout=5000)
        page.fill("#id_swap_affinity_bonus", "0")
        page.click("input[name=_save]")
        page.wait_for_selector("text=Applied to the running scheduler", timeout=5000)
        page.screenshot(path=str(ARTIFACTS / "admin-saved.png"), full_page=True)

        # The dashboard shows the new value and where it came from ...
        page.goto(url + "/")
        page.wait_for_selector("body[data-connection=live]", timeout=5000)
        assert page.inner_text('#settings dd[data-setting="swapAffinityBonus"]') == "0"
        assert page.inner_text("#settings .s-source").startswith(
            "admin edit: swapAffinityBonus by admin"
        )

        # ... and the next dispatch follows it: with alpha loaded, beta at priority 5 now
        # beats alpha at 0 (with the old bonus of 10, alpha would have won with 10).
        blocker = pool.submit(_send, url, "alpha", "normal", 1.5)
        page.wait_for_function(
            "document.querySelector('#running-rows').innerText.includes('alpha')", timeout=5000
        )
        beta5 = pool.submit(_send, url, "beta", "5", 0.1)
        page.wait_for_function(
            "document.querySelectorAll('#waiting-rows tr:not(.empty)').length === 1", timeout=5000
        )
        alpha0 = pool.submit(_send, url, "alpha", "0", 0.1)
        page.wait_for_function(
            "document.querySelectorAll('#waiting-rows tr:not(.empty)').length === 2", timeout=5000
        )
        rows = _rows(page, "#waiting-rows")
        assert "beta" in rows[0] and "alpha" in rows[1], rows
        page.screenshot(path=str(ARTIFACTS / "dashboard-after-admin.png"), full_page=True)
        for future in (blocker, beta5, alpha0):
            assert future.result(timeout=20).status_code == 200
        page.wait_for_function(
            "document.querySelector('#waiting-rows tr.empty') !== null", timeout=5000
        )
        page.wait_for_function(
            "document.querySelector('#decision-rows tr').innerText.includes('alpha')", timeout=5000
        )
        decisions = _rows(page, "#decision-rows")
        assert "alpha" in decisions[0] and "beta" in decisions[1] and "\t5\t" in decisions[1], (
            decisions[:3]
        )
        page.screenshot(path=str(ARTIFACTS / "dashboard-final.png"), full_page=True)
        assert errors == []
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        page.close()


def test_times_are_local_24_hour_with_the_zone_named_and_chart_labels_apart(server, browser):
    """A viewer in Berlin: the header says so, tables and chart axes show Berlin time,
    24-hour, and the time axis labels of the (narrow) charts do not run into each other."""
    import datetime as dt
    from zoneinfo import ZoneInfo

    ARTIFACTS.mkdir(exist_ok=True)
    url = server.url
    berlin = ZoneInfo("Europe/Berlin")
    hours = int(dt.datetime.now(berlin).utcoffset().total_seconds() // 3600)
    caption = f"times in Europe/Berlin (UTC+{hours})"
    context = browser.new_context(
        timezone_id="Europe/Berlin", viewport={"width": 1100, "height": 900}
    )
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        response = _send(url, "alpha", "normal", 0.1)
        assert response.status_code == 200
        request_id = response.headers["X-LlamaSwap-Request-Id"]
        page.goto(url + "/")
        page.wait_for_selector("body[data-connection=live]", timeout=5000)
        assert page.inner_text(".tz-caption") == caption
        source = page.inner_text("#settings .s-source")
        if " at " in source:  # an admin edit's time (after the first test), in Berlin time
            assert f"UTC+{hours}" in source and " UTC " not in source, source
        # Let the charts gather a few seconds of samples, then check the time axis.
        page.wait_for_function("window.llamaswapCharts[0].data[0].length >= 3", timeout=10000)
        axes = page.evaluate(
            """() => window.llamaswapCharts.map(u => {
                const ax = u.axes[0];
                const ctx = document.createElement('canvas').getContext('2d');
                ctx.font = ax.font[0];
                return {
                    values: ax._values,
                    pos: ax._splits.map(v => u.valToPos(v, 'x')),
                    widths: ax._values.map(t => ctx.measureText(String(t)).width),
                };
            })"""
        )
        for axis in axes:
            assert len(axis["values"]) >= 2, axis
            for label in axis["values"]:
                assert dt.datetime.strptime(
                    label, "%H:%M:%S" if label.count(":") == 2 else "%H:%M"
                ), axis
            for i in range(1, len(axis["pos"])):
                gap = axis["pos"][i] - axis["pos"][i - 1]
                assert gap > (axis["widths"][i] + axis["widths"][i - 1]) / 2 + 8, axis
        # the labels are Berlin time: the newest tick is within the last minute, local
        last = axes[0]["values"][-1]
        now = dt.datetime.now(berlin)
        tick = dt.datetime.combine(now.date(), dt.time.fromisoformat(last), berlin)
        assert (
            abs((now - tick).total_seconds()) < 120 or abs((now - tick).total_seconds()) > 86000
        ), (
            last,
            now,
        )
        # the decision rows: local 24-hour text, UTC in the datetime attribute
        page.wait_for_selector("#decision-rows time", timeout=5000)
        stamp = page.get_attribute("#decision-rows time", "datetime")
        text = page.inner_text("#decision-rows time")
        local = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).astimezone(berlin)
        assert text == local.strftime("%H:%M:%S"), (stamp, text)
        page.screenshot(path=str(ARTIFACTS / "dashboard-berlin.png"), full_page=True)

        # History: the same convention, and the filters are read in the viewer's zone.
        _wait_record(url, request_id)
        page.goto(url + "/history/")
        assert page.inner_text(".tz-caption") == caption
        assert page.input_value("input[name=tz]") == "Europe/Berlin"
        row = page.locator("tr", has=page.locator(f"a[href='/requests/{request_id}/']"))
        cell = row.locator("time")
        arrived = dt.datetime.fromisoformat(cell.get_attribute("datetime").replace("Z", "+00:00"))
        assert cell.inner_text() == arrived.astimezone(berlin).strftime("%Y-%m-%d %H:%M:%S")
        since = (arrived.astimezone(berlin) - dt.timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%S")
        page.fill("input[name=since]", since)
        page.fill("input[name=request_id]", request_id)
        page.click("form.filters button[type=submit]")
        page.wait_for_load_state()
        assert "tz=Europe%2FBerlin" in page.url
        assert "1 request" in page.inner_text(".pager")
        page.screenshot(path=str(ARTIFACTS / "history-berlin.png"), full_page=True)

        # A filter that cannot be used says so.
        page.goto(url + "/history/?band=bogus&start=yesterday")
        assert "there is no band 'bogus'" in page.inner_text(".problems")
        page.screenshot(path=str(ARTIFACTS / "history-bad-filter.png"), full_page=True)
        page.goto(url + "/requests/no-such-request/")
        assert "No such request" in page.inner_text("main")
        page.screenshot(path=str(ARTIFACTS / "request-missing.png"), full_page=True)

        # The admin: numbers as typed, fifo priorities as rows, times zoned.
        log_in(page, url + "/admin/control/schedulersettingsrecord/", ADMIN_PASSWORD)
        page.wait_for_selector("#id_aging_divisor", timeout=5000)
        assert page.input_value("#id_aging_divisor") == "60"
        page.fill("#id_fifo_priority", "alpha")
        page.fill("input[name=fifo_priority-priority-0]", "7")
        page.click("input[name=_continue]")
        page.wait_for_selector("table.value-sources", timeout=5000)
        assert page.input_value("#id_fifo_priority") == "alpha"
        sources = page.inner_text("table.value-sources")
        assert "alpha=7" in sources and f"UTC+{hours}" in sources, sources
        page.screenshot(path=str(ARTIFACTS / "admin-berlin.png"), full_page=True)
        assert errors == []
    finally:
        context.close()
