"""The control room's pages in a real browser (issue 21: history, access, what-if, 390 px).

Debian's chromium driven by Playwright against the real server with fakellm model
processes, the box keyed by its config (so every page is read as a logged-in staff
member): the history's columns, filters and a new row appearing without a reload; the
dashboard saying the box is keyed and its counters count since the start; a staff
session reading ``/metrics``, ``/api/queue`` and ``/running``; the what-if page's
placeholders and its "too small to judge"; and every page at 390 px no wider than the
viewport, its live badge in view. Screenshots go to test-artifacts/ (and, refreshed by
this test, docs/screenshots/ for docs/dashboard.md).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.browser import ARTIFACTS, ensure_admin, launch, log_in, needs_chromium
from tests.server import ROOT, chat, fake_model, free_port_block, serve

ADMIN_PASSWORD = "browser-pages-pw"
KEY = "sk-pages-test-key-0001"
OPS_KEY = "sk-pages-test-ops-0002"
AUTH = {"Authorization": f"Bearer {KEY}"}
API_KEYS = [KEY, {"name": "ops", "key": OPS_KEY, "scopes": ["inference", "operator"]}]
SCREENSHOTS = ROOT / "docs" / "screenshots"

pytestmark = [
    pytest.mark.timeout(120),
    needs_chromium,
]
sync_api = pytest.importorskip("playwright.sync_api")


def _send(url: str, model: str, priority: str = "normal", delay: float = 0.05, timeout=30):
    return httpx.post(
        url + "/v1/chat/completions",
        json=chat(model, fake_delay=delay),
        headers={"X-LlamaSwap-Priority": priority, **AUTH},
        timeout=timeout,
    )


def _wait_record(url: str, request_id: str, timeout: float = 10) -> None:
    """The activity log is written in the background: wait until the request is in it."""
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {OPS_KEY}"}
    while time.monotonic() < deadline:
        answer = httpx.get(f"{url}/api/requests/{request_id}", headers=headers, timeout=5)
        if answer.status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError(f"request {request_id} never recorded")


def _wait_running(url: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {OPS_KEY}"}
    while time.monotonic() < deadline:
        if httpx.get(f"{url}/api/queue", headers=headers, timeout=5).json()["running"]:
            return
        time.sleep(0.05)
    raise AssertionError("nothing started running")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("pages")
    port = free_port_block(2)
    models = {
        "alpha": fake_model(port, load_seconds=0.1),
        "beta": fake_model(port + 1, load_seconds=0.1),
    }
    with serve(tmp, models, {"apiKeys": API_KEYS}, migrate=True) as srv:
        ensure_admin(srv, ADMIN_PASSWORD)
        yield srv


@pytest.fixture(scope="module")
def staff(server):
    """One browser, one staff session (the box is keyed: pages need the login)."""
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        page = context.new_page()
        log_in(page, server.url + "/admin/login/?next=/admin/", ADMIN_PASSWORD)
        page.wait_for_url("**/admin/", timeout=10000)
        page.close()
        yield context
        context.close()
        browser.close()


def _shot(page, name: str, docs: bool = False) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)
    if docs:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / name), full_page=False)


def test_history_columns_filters_and_a_new_row_live(server, staff):
    url = server.url
    pool = ThreadPoolExecutor(4)
    page = staff.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        first = _send(url, "alpha")
        assert first.status_code == 200
        _wait_record(url, first.headers["X-LlamaSwap-Request-Id"])
        page.goto(url + "/history/")
        page.wait_for_selector("body[data-history=live]", timeout=5000)
        page.evaluate("window.__noReload = true")
        header = page.inner_text("table.history thead")
        for column in ("endpoint", "lane", "tokens in", "tokens out", "tokens/s", "outcome"):
            assert column in header, header

        # A request the client gives up on while it waits, and one that completes:
        # both appear on the open page without a reload.
        blocker = pool.submit(_send, url, "beta", "normal", 1.5)
        _wait_running(url)
        gone = pool.submit(_send, url, "alpha", "batch", 0.05, 0.4)
        with pytest.raises(httpx.TimeoutException):
            gone.result(timeout=10)
        done = blocker.result(timeout=20)
        assert done.status_code == 200
        rid = done.headers["X-LlamaSwap-Request-Id"]
        page.wait_for_selector(f"tr[data-request-id='{rid}']", timeout=8000)
        page.wait_for_function(
            "document.querySelector('#history-rows').innerText.includes('cancelled while waiting')",
            timeout=8000,
        )
        assert page.evaluate("window.__noReload") is True, "the page reloaded"
        row = page.inner_text(f"tr[data-request-id='{rid}']").split("\t")
        # arrived, request, model, endpoint, lane, band, priority, score, wait, swap,
        # changed the pick, outcome, tokens in, tokens out, tokens/s, total
        assert row[2] == "beta" and row[3] == "/v1/chat/completions" and row[4] == "default"
        assert row[11] == "completed (200)", row
        assert int(row[12].split()[0]) > 0 and int(row[13]) > 0 and float(row[14]) > 0, row
        _shot(page, "history.png", docs=True)

        # Filters, on the server: outcome in words, model, lane.
        page.select_option("select[name=outcome]", "cancelled_waiting")
        with page.expect_navigation():
            page.click("form.filters button[type=submit]")
        page.wait_for_selector("body[data-history=live]", timeout=5000)
        rows = page.eval_on_selector_all("#history-rows tr", "rows => rows.map(r => r.innerText)")
        assert len(rows) == 1 and "cancelled while waiting" in rows[0] and "alpha" in rows[0]
        assert "outcome=cancelled_waiting" in page.url
        page.goto(url + "/history/?model=beta&lane=default&outcome=completed")
        rows = page.eval_on_selector_all("#history-rows tr", "rows => rows.map(r => r.innerText)")
        assert rows and all("beta" in r.split() and "completed" in r for r in rows), rows
        assert page.locator("select[name=lane]").input_value() == "default"
        page.goto(url + "/history/?outcome=bogus")
        assert "there is no outcome 'bogus'" in page.inner_text(".problems")
        assert errors == []
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        page.close()


def test_the_dashboard_says_keyed_and_staff_reads_the_key_paths(server, staff):
    url = server.url
    page = staff.new_page()
    try:
        page.goto(url + "/")
        page.wait_for_selector("body[data-connection=live]", timeout=5000)
        access = page.inner_text("#access")
        assert access.startswith("API keyed: every API call needs a key (2 keys in force)")
        line = page.inner_text(".since-start")
        assert "keys required since" in line and "config file apiKeys" in line, line
        assert "since the server started at" in page.inner_text("#since-start")
        assert page.inner_text("#bands dt:nth-of-type(2)") == "dispatched since start"
        _shot(page, "dashboard.png", docs=True)

        # Without a key these answer 401; the staff session reads them.
        assert httpx.get(url + "/api/queue", timeout=5).status_code == 401
        for path, check in (
            ("/metrics", lambda text: "llamaswap_" in text),
            ("/api/queue", lambda text: "depth" in json.loads(text)),
            ("/running", lambda text: "running" in json.loads(text)),
        ):
            response = page.goto(url + path)
            assert response is not None and response.status == 200, path
            assert check(page.inner_text("body")), path
    finally:
        page.close()


def test_whatif_placeholders_merged_candidates_and_too_small(server, staff):
    url = server.url
    assert _send(url, "alpha", "interactive").status_code == 200
    page = staff.new_page()
    try:
        page.goto(url + "/whatif/?c1=agingCap%3D100&c3=agingCap%3D100")
        for name in ("c1", "c2", "c3"):
            assert page.get_attribute(f"input[name={name}]", "placeholder") == (
                "empty: not replayed"
            )
        assert page.locator("input[name=c2]").input_value() == ""
        # The replay runs in the background; the page reloads itself until it is done.
        page.wait_for_selector("#too-small, div.problems", timeout=40000)
        assert page.locator("#too-small").count(), page.inner_text("main")
        assert "The history is too small to judge" in page.inner_text("#too-small")
        merged = page.inner_text(".note")
        assert "candidate 3 (agingCap=100) is the same as agingCap=100: shown once" in merged
        assert "lower is better" in page.inner_text("main")
        assert page.locator("text.x-tick").first.text_content() == "p0"
        verdicts = page.inner_text("#verdicts")
        assert "agingCap=100" in verdicts
        _shot(page, "whatif.png", docs=True)
    finally:
        page.close()


def _pages(url: str, request_id: str) -> list[str]:
    """Every page dashboard/urls.py lists that a browser GETs (no parameters), and one
    request's page."""
    from dashboard import urls

    paths = []
    for pattern in urls.urlpatterns:
        route = str(pattern.pattern)
        if "<" in route or route.endswith(".ico"):
            continue
        paths.append("/" + route)
    return [*paths, f"/requests/{request_id}/"]


def test_every_page_fits_390_px_with_its_live_badge_in_view(server, staff):
    url = server.url
    done = _send(url, "alpha")
    rid = done.headers["X-LlamaSwap-Request-Id"]
    _wait_record(url, rid)
    page = staff.new_page()
    page.set_viewport_size({"width": 390, "height": 844})
    checked = []
    try:
        for path in _pages(url, rid):
            response = page.goto(url + path)
            assert response is not None
            if response.status == 405 or "text/html" not in response.headers.get(
                "content-type", ""
            ):
                continue  # a POST-only control or an endpoint, not a page
            assert response.status < 500, f"{path} answered {response.status}"
            page.wait_for_load_state("load")
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"{path} is {width} px wide at 390 px"
            badge = page.locator(".conn")
            if badge.count():
                box = badge.first.bounding_box()
                assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390, (
                    path,
                    box,
                )
            checked.append(f"{path} {response.status}")
            name = path.strip("/").replace("/", "-") or "dashboard"
            _shot(page, f"narrow-{name}.png")
        pages = {"/", "/history/", "/whatif/", f"/requests/{rid}/"}
        assert {f"{path} 200" for path in pages} <= set(checked), checked
        print("checked at 390 px:", ", ".join(checked))
        page.goto(url + "/")
        page.wait_for_selector("body[data-connection=live]", timeout=5000)
        _shot(page, "dashboard-390.png", docs=True)
    finally:
        page.close()
