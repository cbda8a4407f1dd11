"""The first key issued in the admin, in a real browser (issue 21: keys and access).

Debian's chromium driven by Playwright against the real server, on a box that starts
open (no keys in its config): a staff member opens the key form, reads that issuing
this key turns access control on, issues it and sees it shown once; the dashboard then
says the box is keyed, a client without a key gets 401, and the same staff session
still reads every page the nav links to and every API the dashboard shows.
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.browser import ARTIFACTS, ensure_admin, launch, log_in, needs_chromium
from tests.server import fake_model, free_port_block, serve

ADMIN_PASSWORD = "browser-keys-pw"
NAV_PAGES = [
    "/",
    "/history/",
    "/queue/",
    "/models/",
    "/dashboard/logs/",
    "/playground/",
    "/whatif/",
]
DASHBOARD_APIS = ["/metrics", "/api/queue", "/running"]

pytestmark = [pytest.mark.timeout(120), needs_chromium]
sync_api = pytest.importorskip("playwright.sync_api")


def test_the_first_key_warns_locks_clients_out_and_staff_still_read_everything(tmp_path):
    port = free_port_block(1)
    with serve(tmp_path, {"m": fake_model(port)}, migrate=True) as server:
        url = server.url
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 200  # open
        ensure_admin(server, ADMIN_PASSWORD)
        with sync_api.sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            try:
                log_in(page, url + "/admin/login/?next=/admin/", ADMIN_PASSWORD)
                page.wait_for_url("**/admin/", timeout=10000)

                # Open: the dashboard says so.
                page.goto(url + "/")
                assert page.get_attribute("#access", "data-keyed") == "false"

                # The key form says what the first key does, before anything is issued.
                page.goto(url + "/admin/control/issuedkey/add/")
                form = page.inner_text("#content")
                assert (
                    "No API key is required yet: issuing this key turns access control on" in form
                )
                page.fill("#id_name", "farm")
                page.click("input[name=_save]")
                shown = page.wait_for_selector("code.issued-key", timeout=10000)
                key = shown.inner_text()
                assert re.fullmatch(r"sk-llamaswap-[A-Za-z0-9_-]+", key), key
                notice = page.inner_text("ul.messagelist")
                assert "copy it now" in notice and "will not be shown again" in notice
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "first-key-issued.png"), full_page=True)
                # Shown once: the change list has its prefix only.
                page.goto(url + "/admin/control/issuedkey/")
                assert key not in page.content()
                assert page.locator("code.issued-key").count() == 0

                # The dashboard says keyed; a client without a key is refused, with it let in.
                page.goto(url + "/")
                assert page.get_attribute("#access", "data-keyed") == "true"
                assert page.inner_text("#access").startswith("API keyed")
                assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
                bearer = {"Authorization": f"Bearer {key}"}
                assert httpx.get(url + "/v1/models", headers=bearer, timeout=5).status_code == 200

                # The same staff session reads every page in the nav, and the dashboard's APIs.
                nav = page.eval_on_selector_all(
                    "header nav a[href]", "links => links.map(a => a.getAttribute('href'))"
                )
                missing = [path for path in NAV_PAGES if path not in nav]
                assert not missing, f"nav lacks {missing}: {nav}"
                for path in NAV_PAGES:
                    answer = page.goto(url + path)
                    assert answer is not None and answer.status == 200, path
                    assert "/admin/login/" not in page.url, f"{path} asked for a login"
                for path in DASHBOARD_APIS:
                    answer = page.request.get(url + path)
                    assert answer.status == 200, (path, answer.status, answer.text()[:200])
                assert "running" in page.request.get(url + "/api/queue").json()
                # ... while those APIs still refuse a caller with neither key nor session.
                for path in DASHBOARD_APIS:
                    assert httpx.get(url + path, timeout=5).status_code == 401, path
                assert not errors, errors
            finally:
                browser.close()
