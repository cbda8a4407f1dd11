"""The control pages in a real browser (Debian's chromium, Playwright) against the real
server and real fake-model processes: the models page (load, unload, unload all, a start
failure shown with its cause within a second), the logs page (a line appearing live,
filters) and the playground (a prompt queued behind a running request, then streamed).

One keyed server and one browser for the module; a staff session (the admin login)
drives the buttons and passes the key check on what the pages call (the playground's chat
request); scripts use a key with the ``models`` scope. Screenshots go to test-artifacts/; with ``LLAMASWAP_DOCS_SCREENSHOTS=1`` also to
docs/screenshots/ (what docs/dashboard.md shows).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.browser import ADMIN_PASSWORD, ARTIFACTS, ensure_admin, launch, log_in, needs_chromium
from tests.server import ROOT, chat, fake_model, free_port_block, serve

pytestmark = [
    pytest.mark.timeout(90),
    needs_chromium,
]
sync_api = pytest.importorskip("playwright.sync_api")

DOCS = ROOT / "docs" / "screenshots"
BROKEN = "/nonexistent/llama-server"
KEY = "sk-browser-models-all"
AUTH = {"Authorization": f"Bearer {KEY}"}
INFERENCE_ONLY = {"Authorization": "Bearer sk-browser-models-inference"}


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)
    if os.environ.get("LLAMASWAP_DOCS_SCREENSHOTS"):
        DOCS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(DOCS / name), full_page=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("browser-models")
    port = free_port_block(2)
    models = {
        "alpha": fake_model(port, load_seconds=0.3, sendLoadingState=True),
        "beta": fake_model(port + 1, load_seconds=0.3, ttl=300),
        "broken": {"cmd": f"{BROKEN} --port 9", "proxy": "http://127.0.0.1:9"},
        "broken2": {"cmd": f"{BROKEN} --port 9", "proxy": "http://127.0.0.1:9"},
    }
    extra = {
        "peers": {"cloud": {"proxy": "http://127.0.0.1:9", "models": ["gpt-x"]}},
        # A keyed box: the pages need a login, and the staff session must pass the key
        # check on what the pages call (the playground's chat request, the feeds).
        "apiKeys": [
            {"key": KEY, "scopes": ["inference", "models", "operator"]},
            INFERENCE_ONLY["Authorization"].removeprefix("Bearer "),
        ],
    }
    with serve(tmp, models, extra, migrate=True) as srv:
        ensure_admin(srv, ADMIN_PASSWORD)
        yield srv


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        log_in(page, server.url + "/admin/login/?next=/models/", ADMIN_PASSWORD)
        page.wait_for_selector("body[data-connection=live]", timeout=10000)
        yield page
        assert not errors, errors
        browser.close()


def _state(page, model: str) -> str:
    return page.get_attribute(f"#model-rows tr[data-model='{model}']", "data-state") or ""


def _wait_state(page, model: str, state: str, timeout: float = 10000) -> None:
    page.wait_for_function(
        f"document.querySelector(\"#model-rows tr[data-model='{model}']\")"
        f"?.dataset.state === '{state}'",
        timeout=timeout,
    )


def test_models_page_loads_unloads_and_shows_a_failed_start_with_its_cause(server, page):
    page.goto(server.url + "/models/")
    page.wait_for_selector("body[data-connection=live]", timeout=5000)
    rows = page.inner_text("#model-rows")
    assert "alpha" in rows and "beta" in rows and "broken" in rows
    assert "gpt-x" in page.inner_text("#peer-rows")  # the peer's model, listed
    assert _state(page, "alpha") == "stopped"

    page.click("#model-rows tr[data-model='alpha'] button[data-action=load]")
    _wait_state(page, "alpha", "ready")
    cells = page.eval_on_selector_all(
        "#model-rows tr[data-model='alpha'] td", "tds => tds.map(td => td.innerText.trim())"
    )
    assert cells[4] == "0 / 1", cells  # slots in use / slots
    assert cells[6] != "–" and cells[7].endswith(" s"), cells  # loaded at, load took
    assert (
        httpx.get(server.url + "/running", headers=AUTH, timeout=5).json()["running"][0]["model"]
        == "alpha"
    )

    page.click("#model-rows tr[data-model='beta'] button[data-action=load]")
    _wait_state(page, "beta", "ready")  # the default group: alpha made room
    _wait_state(page, "alpha", "stopped")
    page.wait_for_function(  # beta's ttl runs down while it is idle
        "document.querySelector(\"#model-rows tr[data-model='beta'] td:nth-child(10)\")"
        ".innerText.includes(' s') || document.querySelector(\"#model-rows tr[data-model='beta']"
        " td:nth-child(10)\").innerText.includes('min')",
        timeout=5000,
    )
    _shot(page, "models.png")

    page.click("#model-rows tr[data-model='beta'] button[data-action=unload]")
    _wait_state(page, "beta", "stopped")
    assert httpx.get(server.url + "/running", headers=AUTH, timeout=5).json()["running"] == []

    # A request for a model that cannot start: the page shows why within a second.
    r = httpx.post(
        server.url + "/v1/chat/completions", json=chat("broken"), headers=AUTH, timeout=20
    )
    assert r.status_code == 503
    t0 = time.monotonic()
    _wait_state(page, "broken", "failed", timeout=2500)
    assert time.monotonic() - t0 < 1.5
    cause = page.inner_text("#model-rows tr[data-model='broken'] .cause")
    assert BROKEN in cause, cause
    _shot(page, "models-failed.png")
    # The failed request's record keeps the cause (its page shows it).
    request_id = r.headers["X-LlamaSwap-Request-Id"]
    deadline = time.monotonic() + 10
    while (
        rec := httpx.get(f"{server.url}/api/requests/{request_id}", headers=AUTH)
    ).status_code != 200:
        assert time.monotonic() < deadline, "the failed request was never recorded"
        time.sleep(0.05)
    assert BROKEN in rec.json()["error"], rec.json()
    # Load tries again at once (during the cool-down) and says why it failed.
    page.click("#model-rows tr[data-model='broken'] button[data-action=load]")
    page.wait_for_function(
        f"document.getElementById('control-message').innerText.includes('{BROKEN}')",
        timeout=10000,
    )

    # Unload all, after loading one again.
    page.click("#model-rows tr[data-model='alpha'] button[data-action=load]")
    _wait_state(page, "alpha", "ready")
    page.click("#unload-all")
    _wait_state(page, "alpha", "stopped")
    page.wait_for_function(
        "document.getElementById('control-message').innerText.includes('unload all')",
        timeout=5000,
    )
    # Every act is audited (the admin's change log).
    page.goto(server.url + "/admin/control/settingschange/")
    audit = page.inner_text("#result_list")
    assert "model load" in audit and "model unload" in audit and "models page" in audit


def test_load_api_needs_the_models_scope_and_a_same_site_caller(server):
    load = server.url + "/api/models/load/"
    r = httpx.post(load + "broken", headers=AUTH, timeout=20)
    assert r.status_code == 503 and BROKEN in r.json()["error"]["message"]
    r = httpx.post(load + "alpha", headers=AUTH, timeout=20)
    assert r.status_code == 200 and r.json() == {"model": "alpha", "state": "ready"}
    r = httpx.post(load + "nope", headers=AUTH, timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.post(load + "alpha", timeout=5).status_code == 401
    r = httpx.post(load + "alpha", headers=INFERENCE_ONLY, timeout=5)
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    other_site = {**AUTH, "Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
    assert httpx.post(load + "alpha", headers=other_site, timeout=5).status_code == 403
    # The page's own control refuses anyone but staff (no session here).
    control = httpx.post(
        server.url + "/models/control/", data={"action": "unload_all"}, headers=AUTH
    )
    assert control.status_code == 403
    running = httpx.get(server.url + "/running", headers=AUTH, timeout=5).json()["running"]
    assert [m["model"] for m in running] == ["alpha"]  # the refused calls changed nothing


def test_logs_page_shows_a_line_live_and_filters_by_model_and_level(server, page):
    page.goto(server.url + "/dashboard/logs/")
    page.wait_for_selector("body[data-connection=live]", timeout=5000)
    page.wait_for_function("document.querySelectorAll('#log .l').length > 0", timeout=5000)
    first = page.evaluate(
        "Math.max(...[...document.querySelectorAll('#log .l')].map(l => +l.dataset.seq))"
    )
    # A failed start (a proxy line) and a model starting (its output): both appear
    # without a reload.
    r = httpx.post(
        server.url + "/v1/chat/completions", json=chat("broken2"), headers=AUTH, timeout=20
    )
    assert r.status_code == 503
    page.wait_for_function(
        "[...document.querySelectorAll('#log .l.src-proxy')].some(l => "
        f"+l.dataset.seq > {first} && l.innerText.includes('model failed to start') "
        "&& l.innerText.includes('[broken2]'))",
        timeout=3000,
    )
    assert httpx.post(
        server.url + "/v1/chat/completions", json=chat("beta"), headers=AUTH, timeout=20
    ).is_success
    page.wait_for_function(
        "[...document.querySelectorAll('#log .l.src-upstream')].some(l => "
        f"+l.dataset.seq > {first} && l.innerText.includes('[beta] fakellm'))",
        timeout=3000,
    )
    line = page.inner_text("#log .l.lv-warn >> nth=-1")
    assert BROKEN in line and line[:2].isdigit() and line[2] == ":"  # stamped hh:mm:ss.mmm
    _shot(page, "logs.png")
    page.select_option("#f-model", "broken2")
    page.select_option("#f-level", "warn")
    visible = page.eval_on_selector_all(  # what is on screen, not what the DOM holds
        "#log .l", "ls => ls.filter(l => l.getClientRects().length).map(l => l.innerText)"
    )
    assert visible and all("[broken2]" in v for v in visible), visible
    page.select_option("#f-model", "")
    page.select_option("#f-level", "")


def test_playground_queues_behind_a_running_request_then_streams(server, page):
    pool = ThreadPoolExecutor(1)
    try:
        httpx.post(server.url + "/api/models/load/alpha", headers=AUTH, timeout=20)
        blocker = pool.submit(
            httpx.post,
            server.url + "/v1/chat/completions",
            json=chat("alpha", fake_delay=1.5),
            headers=AUTH,
            timeout=30,
        )
        deadline = time.monotonic() + 10
        while not httpx.get(server.url + "/api/queue", headers=AUTH, timeout=5).json()["running"]:
            assert time.monotonic() < deadline, "the blocker never ran"
            time.sleep(0.02)
        page.goto(server.url + "/playground/")
        page.select_option("#p-model", "alpha")
        page.select_option("#p-band", "batch")
        page.fill("#p-prompt", "hello from the playground")
        page.click("#p-send")
        # It waits behind the running request: the proxy's progress says where it stands.
        page.wait_for_function("document.body.dataset.phase === 'queued'", timeout=5000)
        progress = page.inner_text("#p-progress")
        assert "#1 of 1 in line (batch)" in progress, progress
        _shot(page, "playground-queued.png")
        page.wait_for_function("document.body.dataset.phase === 'done'", timeout=15000)
        phases = page.evaluate("document.body.dataset.phases")
        assert phases == "waiting queued streaming done", phases
        assert page.inner_text("#p-answer").strip()
        assert blocker.result(timeout=20).status_code == 200
        assert "request" in page.inner_text("#p-meta")
        _shot(page, "playground.png")
        page.set_viewport_size({"width": 390, "height": 800})
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, width
        _shot(page, "playground-390.png")
        for path, name in (("/models/", "models-390.png"), ("/dashboard/logs/", "logs-390.png")):
            page.goto(server.url + path)
            page.wait_for_selector("body[data-connection=live]", timeout=5000)
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, (path, width)
            _shot(page, name)
        page.set_viewport_size({"width": 1280, "height": 800})
    finally:
        pool.shutdown(wait=False)
