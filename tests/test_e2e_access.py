"""Key scopes, a box that stays keyed, and the admin login's throttle, through the real
server (``manage.py serve`` with its database, the admin and the lean proxy handler).

* The access matrix: every endpoint x (no key, inference key, capped key, operator key,
  a metrics-only key, a staff session), one server for the whole table.
* The last key: revoking it leaves the box keyed (across a restart) until a staff member
  turns access control off in the admin, which is logged and in the change log.
* Failed admin logins lock the username and address pair (429), not the admin elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.server import ROOT, Server, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(90)

INFERENCE_KEY = "sk-e2e-inference"
CAPPED_KEY = "sk-e2e-capped"
OPERATOR_KEY = "sk-e2e-operator"
SCRAPER_KEY = "sk-e2e-scraper"
API_KEYS = [
    INFERENCE_KEY,  # llama-swap's plain form: inference only
    {"name": "capped", "key": CAPPED_KEY, "priority": {"ceiling": -10}},
    {
        "name": "ops",
        "key": OPERATOR_KEY,
        "scopes": ["inference", "models", "profiles", "operator", "metrics"],
    },
    {"name": "scraper", "key": SCRAPER_KEY, "scopes": ["metrics"]},
]
ADMIN = ("admin", "pw-admin-e2e-123")
BOB = ("bob", "pw-bob-e2e-123")
CSRF_FIELD = re.compile(r'name="csrfmiddlewaretoken" value="([^"]+)"')
KEY_SHOWN = re.compile(r'<code class="issued-key">(sk-llamaswap-[A-Za-z0-9_-]+)</code>')


def create_staff(server: Server) -> None:
    """A superuser and a second staff member in the server's database."""
    script = (
        "from django.contrib.auth.models import User\n"
        f"User.objects.create_superuser({ADMIN[0]!r}, '', {ADMIN[1]!r})\n"
        f"User.objects.create_user({BOB[0]!r}, password={BOB[1]!r}, is_staff=True)\n"
    )
    subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", script],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": server.database_url},
        check=True,
        timeout=60,
        capture_output=True,
    )


def csrf_token(client: httpx.Client, url: str) -> str:
    page = client.get(url)
    assert page.status_code == 200, page.text[:500]
    found = CSRF_FIELD.search(page.text)
    assert found, page.text[:500]
    return found.group(1)


def login(client: httpx.Client, base: str, user: str, password: str) -> httpx.Response:
    token = csrf_token(client, base + "/admin/login/")
    return client.post(
        base + "/admin/login/",
        data={"username": user, "password": password, "csrfmiddlewaretoken": token, "next": "/admin/"},
    )


@contextlib.contextmanager
def staff_client(base: str) -> Iterator[httpx.Client]:
    """A client logged in to the admin as a superuser (its session cookie kept)."""
    with httpx.Client(timeout=10) as client:
        answer = login(client, base, *ADMIN)
        assert answer.status_code == 302, answer.text[:500]
        yield client


# -- the access matrix ------------------------------------------------------------------------

CREDENTIALS = ("none", "inference", "capped", "operator", "scraper", "staff")
BEARER = {
    "inference": INFERENCE_KEY,
    "capped": CAPPED_KEY,
    "operator": OPERATOR_KEY,
    "scraper": SCRAPER_KEY,
}
NO_MODEL = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}

# (method, path, json body) -> the status for each of CREDENTIALS, in order. A 404 is the
# endpoint's own answer (let through); 401 no or unknown key; 403 a key without the scope;
# 302 a page's redirect to the login.
MATRIX: list[tuple[str, str, object, tuple[int, ...]]] = [
    # inference: every key with the default scope, and staff
    ("POST", "/v1/chat/completions", NO_MODEL, (401, 404, 404, 404, 403, 404)),
    ("POST", "/v1/embeddings", NO_MODEL, (401, 404, 404, 404, 403, 404)),
    ("GET", "/v1/models", None, (401, 200, 200, 200, 403, 200)),
    ("GET", "/running", None, (401, 200, 200, 200, 403, 200)),
    ("GET", "/upstream/no-such-model/health", None, (401, 404, 404, 404, 403, 404)),
    ("GET", "/api/profiles", None, (401, 200, 200, 200, 403, 200)),
    # models: the capped key may not stop another user's model (the finding)
    ("GET", "/unload", None, (401, 403, 403, 200, 403, 200)),
    ("POST", "/api/models/unload", None, (401, 403, 403, 200, 403, 200)),
    ("POST", "/api/models/unload/m", None, (401, 403, 403, 200, 403, 200)),
    # profiles: switching for everyone
    ("PUT", "/api/profiles/active", {"name": None}, (401, 403, 403, 200, 403, 200)),
    # operator: other users' requests and model output
    ("GET", "/api/queue", None, (401, 403, 403, 200, 403, 200)),
    ("GET", "/logs", None, (401, 403, 403, 200, 403, 200)),
    ("GET", "/logs/stream", None, (401, 403, 403, 200, 403, 200)),
    ("GET", "/api/metrics/activity", None, (401, 403, 403, 200, 403, 200)),
    ("GET", "/api/requests/no-such", None, (401, 403, 403, 404, 403, 404)),
    # metrics: a scraper reads counters, never prompts
    ("GET", "/metrics", None, (401, 403, 403, 200, 200, 200)),
    # open, and the pages (a key is no login)
    ("GET", "/health", None, (200, 200, 200, 200, 200, 200)),
    ("GET", "/dashboard/", None, (302, 302, 302, 302, 302, 200)),
    ("GET", "/history/", None, (302, 302, 302, 302, 302, 200)),
    ("GET", "/admin/", None, (302, 302, 302, 302, 302, 200)),
]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    port = free_port_block(1)
    models = {"m": fake_model(port)}
    with serve(
        tmp_path_factory.mktemp("scopes"), models, {"apiKeys": API_KEYS}, migrate=True
    ) as server:
        create_staff(server)
        with staff_client(server.url) as staff:
            yield server, staff


def _ask(server: Server, staff: httpx.Client, credential: str, method: str, path: str, body):
    headers = {}
    cookies = None
    if credential in BEARER:
        headers["authorization"] = f"Bearer {BEARER[credential]}"
    if credential == "staff":
        cookies = dict(staff.cookies)
    # A stream (/logs/stream) answers its status first: read that, then hang up.
    with (
        httpx.Client(timeout=10, cookies=cookies) as client,
        client.stream(method, server.url + path, json=body, headers=headers) as answer,
    ):
        if answer.status_code != 200 or not path.endswith("/stream"):
            answer.read()
        return answer


def test_every_endpoint_against_every_credential(keyed):
    server, staff = keyed
    failures = []
    for method, path, body, statuses in MATRIX:
        for credential, want in zip(CREDENTIALS, statuses, strict=True):
            answer = _ask(server, staff, credential, method, path, body)
            if answer.status_code != want:
                failures.append(f"{method} {path} [{credential}]: {answer.status_code}, want {want}")
                continue
            if want == 403:
                error = answer.json()["error"]
                if error["code"] != "insufficient_scope" or "lacks the scope" not in error["message"]:
                    failures.append(f"{method} {path} [{credential}]: {error}")
            if want == 401 and answer.json()["error"]["code"] != "invalid_api_key":
                failures.append(f"{method} {path} [{credential}]: {answer.text}")
    assert not failures, "\n".join(failures)


def test_the_refusal_names_the_missing_scope(keyed):
    server, _ = keyed
    answer = httpx.post(
        server.url + "/api/models/unload",
        headers={"authorization": f"Bearer {CAPPED_KEY}"},
        timeout=10,
    )
    assert answer.status_code == 403
    error = answer.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == "insufficient_scope"
    assert "'capped'" in error["message"] and "'models'" in error["message"]
    assert answer.headers["x-llamaswap-request-id"]


# -- the last key: the box stays keyed --------------------------------------------------------


def _admin_post(client: httpx.Client, url: str, data: dict) -> httpx.Response:
    token = csrf_token(client, url)
    return client.post(url, data={**data, "csrfmiddlewaretoken": token})


def test_revoking_the_last_key_keeps_the_box_keyed_until_staff_turn_it_off(tmp_path):
    port = free_port_block(1)
    models = {"m": fake_model(port)}
    database = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    first = tmp_path / "first"
    first.mkdir()
    with serve(first, models, migrate=True, environ={"DATABASE_URL": database}) as server:
        assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 200  # open
        create_staff(server)
        with staff_client(server.url) as staff:
            add = server.url + "/admin/control/issuedkey/add/"
            page = staff.get(add).text
            assert "issuing this key turns access control on" in page
            added = _admin_post(
                staff,
                add,
                {"name": "farm", "priority_default": "", "priority_ceiling": "", "priority_offset": "0"},
            )
            assert added.status_code == 302, added.text[:1000]
            key = KEY_SHOWN.findall(staff.get(server.url + added.headers["location"]).text)[0]
            bearer = {"authorization": f"Bearer {key}"}
            assert httpx.get(server.url + "/v1/models", headers=bearer, timeout=5).status_code == 200
            assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 401

            changelist = server.url + "/admin/control/issuedkey/"
            token = csrf_token(staff, changelist)
            record = re.search(r'name="_selected_action" value="(\d+)"', staff.get(changelist).text)
            assert record
            revoked = staff.post(
                changelist,
                data={"action": "revoke", "_selected_action": record.group(1), "csrfmiddlewaretoken": token},
            )
            assert revoked.status_code == 302
            # The last key is gone, and the box is still keyed: for the old key, for none.
            assert httpx.get(server.url + "/v1/models", headers=bearer, timeout=5).status_code == 401
            assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 401
            # A staff session reaches everything.
            assert staff.get(server.url + "/v1/models").status_code == 200
            assert staff.get(server.url + "/metrics").status_code == 200
            session = dict(staff.cookies)

    # A restart keeps it: the state is in the database.
    second = tmp_path / "second"
    second.mkdir()
    with serve(second, models, environ={"DATABASE_URL": database}) as server:
        assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 401
        with httpx.Client(timeout=10, cookies=session) as staff:
            control = server.url + "/admin/control/accesscontrol/"
            page = staff.get(control, follow_redirects=True)
            assert page.status_code == 200 and "Keys in force" in page.text
            turned_off = _admin_post(staff, str(page.url), {})  # keys_required unchecked
            assert turned_off.status_code == 302, turned_off.text[:1000]
            assert httpx.get(server.url + "/v1/models", timeout=5).status_code == 200  # open
            audit = staff.get(server.url + "/admin/control/settingschange/?field=accessControl").text
            assert "accessControl" in audit and ADMIN[0] in audit
        assert "access control turned off" in server.log()


# -- the admin login's throttle -----------------------------------------------------------


def test_failed_admin_logins_lock_the_username_and_address(keyed):
    server, _ = keyed  # bob's lock leaves the admin's session and logins alone
    with httpx.Client(timeout=10) as client:
        statuses = [login(client, server.url, BOB[0], "wrong").status_code for _ in range(5)]
        assert statuses == [200, 200, 200, 200, 429], statuses
        # Locked: the right password is refused too, with a message, not a 500.
        locked = login(client, server.url, *BOB)
        assert locked.status_code == 429
        assert "Too many failed logins" in locked.text
    # Another username from the same address still logs in.
    with httpx.Client(timeout=10) as other:
        assert login(other, server.url, *ADMIN).status_code == 302
    assert "admin login locked after repeated failures" in server.log()
