"""Access control through the real ASGI app: API keys, logins, Host, cross-origin unloads.

The table is built from the URLconf: every pattern the resolver knows must have a rule in
:data:`RULES` (so a new path without one fails here), and every rule is requested with
every kind of credential, keys configured and not.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat

import pytest
from django.urls import URLPattern, URLResolver, get_resolver

from scheduler import runtime
from scheduler.config import parse_config
from scheduler.keys import ALL_SCOPES, ApiKey, KeyRing, digest
from tests.asgi import http_scope, in_process
from web.paths import INFERENCE_PATHS
from web.runtime import carrying

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

KEY = "sk-access-config-key"
ISSUED = "sk-access-issued-key"
WRONG = "sk-not-a-key"
HOST = b"127.0.0.1:8080"

# -- the rules: every URL pattern -> its class and a request that exercises it -------------

API_KEY = "api-key"  # keys configured: a valid key (the table's has every scope) or a staff session, else 401
KEY_OR_STAFF = "api-key-or-staff"  # the same (staff sessions reach every key path since scopes)
LOGIN = "login"  # keys configured (or DASHBOARD_REQUIRE_LOGIN): a Django login, else 302
ADMIN = "admin"  # Django's admin: always a staff login
EXEMPT = "exempt"  # open whatever is configured
LOGIN_PAGE = "login page"  # open; a staff member already logged in is sent on
STAFF_PAGE = "staff page"  # keys configured (or DASHBOARD_REQUIRE_LOGIN): a staff login, else 302
LOGIN_JSON = "login json"  # as LOGIN, but a JSON 403 instead of the redirect
STAFF_JSON = "staff json"  # as STAFF_PAGE, but a JSON 403 instead of the redirect
STAFF = "staff"  # a staff login whatever is configured (others: 302 to the login)

NO_MODEL = json.dumps({"model": "no-such-model", "messages": []}).encode()

RULES: dict[str, tuple[str, tuple[str, str, bytes]]] = {
    **{p: (API_KEY, ("POST", "/" + p, NO_MODEL)) for p in INFERENCE_PATHS},
    "^upstream/(?P<rest>.+)$": (API_KEY, ("GET", "/upstream/no-such/x", b"")),
    # llama-swap's ComfyUI passthrough: behind its API key, the redirect too (as there).
    "comfyui": (API_KEY, ("GET", "/comfyui", b"")),
    "^comfyui/(?P<path>.*)$": (API_KEY, ("GET", "/comfyui/no-such", b"")),
    "v1/models": (API_KEY, ("GET", "/v1/models", b"")),
    "running": (API_KEY, ("GET", "/running", b"")),
    "unload": (API_KEY, ("GET", "/unload", b"")),
    "api/models/unload": (API_KEY, ("POST", "/api/models/unload", b"")),
    "api/models/unload/<path:model_name>": (API_KEY, ("POST", "/api/models/unload/no-such", b"")),
    "health": (EXEMPT, ("GET", "/health", b"")),
    "wol-health": (EXEMPT, ("GET", "/wol-health", b"")),
    "api/queue": (API_KEY, ("GET", "/api/queue", b"")),
    "logs": (KEY_OR_STAFF, ("GET", "/logs", b"")),
    "logs/stream": (KEY_OR_STAFF, ("HEAD", "/logs/stream", b"")),
    "logs/stream/upstream": (KEY_OR_STAFF, ("HEAD", "/logs/stream/upstream", b"")),
    "logs/stream/proxy": (KEY_OR_STAFF, ("HEAD", "/logs/stream/proxy", b"")),
    "logs/stream/<path:model_name>": (KEY_OR_STAFF, ("HEAD", "/logs/stream/no-such", b"")),
    "api/models/load/<path:model_name>": (API_KEY, ("POST", "/api/models/load/no-such", b"")),
    "models/": (LOGIN, ("GET", "/models/", b"")),
    "models/feed/": (LOGIN_JSON, ("GET", "/models/feed/", b"")),
    # A GET: 405 for everyone (the page posts, with the CSRF token, as staff).
    "models/control/": (EXEMPT, ("GET", "/models/control/", b"")),
    "dashboard/logs/": (STAFF_PAGE, ("GET", "/dashboard/logs/", b"")),
    "dashboard/logs/feed": (STAFF_JSON, ("GET", "/dashboard/logs/feed", b"")),
    "playground/": (STAFF_PAGE, ("GET", "/playground/", b"")),
    "metrics": (API_KEY, ("GET", "/metrics", b"")),
    "api/metrics/activity": (API_KEY, ("GET", "/api/metrics/activity", b"")),
    "api/metrics/stats": (API_KEY, ("GET", "/api/metrics/stats", b"")),
    "api/captures/<str:capture_id>": (API_KEY, ("GET", "/api/captures/no-such", b"")),
    "api/version": (API_KEY, ("GET", "/api/version", b"")),
    "api/hardware": (API_KEY, ("GET", "/api/hardware", b"")),
    "api/performance": (API_KEY, ("GET", "/api/performance", b"")),
    "api/events": (API_KEY, ("HEAD", "/api/events", b"")),
    "api/inflight/<str:request_id>/cancel": (
        API_KEY,
        ("POST", "/api/inflight/no-such/cancel", b""),
    ),
    "api/requests/<str:request_id>": (API_KEY, ("GET", "/api/requests/no-such", b"")),
    "api/profiles": (KEY_OR_STAFF, ("GET", "/api/profiles", b"")),
    "api/profiles/active": (KEY_OR_STAFF, ("PUT", "/api/profiles/active", b'{"name": null}')),
    "dashboard/profile/": (STAFF, ("GET", "/dashboard/profile/", b"")),
    "": (LOGIN, ("GET", "/", b"")),
    "dashboard/": (LOGIN, ("GET", "/dashboard/", b"")),
    "history/": (LOGIN, ("GET", "/history/", b"")),
    "whatif/": (LOGIN, ("GET", "/whatif/", b"")),
    "requests/<str:request_id>/": (LOGIN, ("GET", "/requests/no-such/", b"")),
    "requests/<str:request_id>/status": (LOGIN_JSON, ("GET", "/requests/no-such/status", b"")),
    "queue/": (LOGIN, ("GET", "/queue/", b"")),
    "queue/data": (LOGIN_JSON, ("GET", "/queue/data", b"")),
    # A GET: 405 for everyone (the page posts, with the CSRF token, as staff).
    "queue/<str:request_id>/cancel": (EXEMPT, ("GET", "/queue/no-such/cancel", b"")),
    "favicon.ico": (EXEMPT, ("GET", "/favicon.ico", b"")),
    # llama-swap's web UI addresses: redirects to the dashboard's pages (which ask for the
    # login), open as in llama-swap.
    "upstream": (EXEMPT, ("GET", "/upstream", b"")),
    "^ui(?:/(?P<page>.*))?$": (EXEMPT, ("GET", "/ui/models", b"")),
    "admin/": (ADMIN, ("GET", "/admin/", b"")),
    # The control records' old admin addresses: a redirect for anyone (the admin behind
    # it asks for the staff login).
    "admin/^dashboard/(?P<model>issuedkey|accesscontrol|schedulersettingsrecord|settingschange)"
    "/(?P<rest>.*)$": (EXEMPT, ("GET", "/admin/dashboard/issuedkey/", b"")),
}
EXTRA = {
    # Not in the URLconf: WhiteNoise's static files, the admin's login page, an unknown
    # API path (its 404 is for key holders only).
    "static": (EXEMPT, ("GET", "/static/dashboard/favicon.ico", b"")),
    "admin login": (LOGIN_PAGE, ("GET", "/admin/login/", b"")),
    "unknown api path": (API_KEY, ("GET", "/v1/no-such-endpoint", b"")),
}


def url_patterns(patterns=None, prefix: str = ""):
    """Every pattern as the resolver spells it, prefixes joined; the admin as one entry
    (its own views require a staff login, whatever it adds)."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        here = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            if entry.app_name == "admin":
                yield here
            else:
                yield from url_patterns(entry.url_patterns, here)
        else:
            assert isinstance(entry, URLPattern)
            yield here


def test_every_url_pattern_has_an_access_rule():
    found = set(url_patterns())
    assert found - RULES.keys() == set(), "add a rule to RULES for each new path"
    assert RULES.keys() - found == set(), "stale rules"


# -- credentials ----------------------------------------------------------------------------


def _basic(password: str) -> bytes:
    return b"Basic " + base64.b64encode(f"anyone:{password}".encode())


@pytest.fixture
def sessions(transactional_db):
    """Session cookies: a staff member's, a plain user's, one with nobody logged in."""
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.contrib.sessions.backends.db import SessionStore
    from django.test import Client

    cookies = {}
    for name, staff in (("staff", True), ("user", False)):
        user = User.objects.create_user(name, password="pw-" + name * 3, is_staff=staff)
        client = Client()
        client.force_login(user)
        cookies[name] = client.cookies[settings.SESSION_COOKIE_NAME].value
    anonymous = SessionStore()
    anonymous["seen"] = True
    anonymous.create()
    cookies["anonymous"] = anonymous.session_key
    return {
        name: (b"cookie", f"{settings.SESSION_COOKIE_NAME}={value}".encode())
        for name, value in cookies.items()
    }


def credentials(sessions) -> dict[str, list[tuple[bytes, bytes]]]:
    return {
        "no key": [],
        "wrong key": [(b"authorization", b"Bearer " + WRONG.encode())],
        "bearer": [(b"authorization", b"Bearer " + KEY.encode())],
        "basic": [(b"authorization", _basic(KEY))],
        "x-api-key": [(b"x-api-key", KEY.encode())],
        "staff session": [sessions["staff"]],
        "user session": [sessions["user"]],
        "anonymous session": [sessions["anonymous"]],
    }


KEYED = {"bearer", "basic", "x-api-key"}
LOGGED_IN = {"staff session", "user session"}


def expected(kind: str, credential: str, baseline: int, keys: bool) -> int:
    """The status a request gets: ``baseline`` when let through (what it answers with
    keys off and no credential), else the refusal."""
    if kind == EXEMPT:
        return baseline
    if kind == ADMIN:
        return 200 if credential == "staff session" else 302
    if kind == LOGIN_PAGE:
        return 302 if credential == "staff session" else 200
    if kind == STAFF:  # a GET: the form posts, so a staff member gets a 405
        return 405 if credential == "staff session" else 302
    if not keys:
        return baseline
    if kind in (API_KEY, KEY_OR_STAFF):  # scopes: tests/test_key_scopes.py
        return baseline if credential in KEYED | {"staff session"} else 401
    if kind == LOGIN:
        return baseline if credential in LOGGED_IN else 302
    if kind == LOGIN_JSON:
        return baseline if credential in LOGGED_IN else 403
    if kind in (STAFF_PAGE, STAFF_JSON):
        return baseline if credential == "staff session" else (302 if kind == STAFF_PAGE else 403)
    raise AssertionError(kind)


def _config():
    return parse_config({"models": {"m": {"cmd": "fake", "proxy": "http://127.0.0.1:9001"}}})


def _ring() -> KeyRing:
    return KeyRing({KEY: ApiKey("config-key", scopes=ALL_SCOPES)})


class Answer:
    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: dict[bytes, bytes] = {}
        self.body = b""

    def json(self):
        return json.loads(self.body)


async def _request(app, method, path, body=b"", headers=()) -> Answer:
    """One request through the app as daphne sends it, with Host 127.0.0.1:8080 unless
    ``headers`` names one; the client stays until the response is complete."""
    headers = list(headers)
    if not any(name == b"host" for name, _ in headers):
        headers.insert(0, (b"host", HOST))
    headers += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    path_part, _, query = path.partition("?")
    scope = http_scope(method, path_part, query.encode(), headers)
    answer = Answer()
    complete = asyncio.Event()
    pieces = [body]

    async def receive():
        if pieces:
            return {"type": "http.request", "body": pieces.pop(), "more_body": False}
        await complete.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.lower(): v for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")
            if not message.get("more_body", False):
                complete.set()

    async with asyncio.timeout(10):
        await app(scope, receive, send)
    return answer


async def test_access_table(sessions):
    rules = {**RULES, **EXTRA}
    creds = credentials(sessions)
    failures = []
    async with in_process(_config()) as world:
        baseline = {}
        for pattern, (_kind, (method, path, body)) in rules.items():
            baseline[pattern] = (await _request(world.app, method, path, body)).status
        for keys in (False, True):
            runtime.current().keys = _ring() if keys else KeyRing()
            for pattern, (kind, (method, path, body)) in rules.items():
                for credential, headers in creds.items():
                    call = await _request(world.app, method, path, body, headers)
                    want = expected(kind, credential, baseline[pattern], keys)
                    if call.status != want:
                        failures.append(
                            f"keys={keys} {method} {path} [{credential}]: {call.status}, want {want}"
                        )
                    if call.status == 401:
                        error = json.loads(call.body)["error"]
                        assert error["code"] == "invalid_api_key"
                        assert error["type"] == "invalid_request_error"
                        assert b"www-authenticate" not in call.headers  # no Basic challenge
                        assert call.headers[b"x-llamaswap-request-id"]
    assert not failures, "\n".join(failures)
    # The baseline is a real answer, not a refusal of its own.
    assert baseline["health"] == 200 and baseline["logs"] == 200 and baseline[""] == 200


async def test_missing_key_is_a_401_without_a_basic_challenge():
    # The challenge only with security.basicAuthChallenge (tests/test_cross_site.py).
    async with in_process(_config(), keys=_ring()) as world:
        call = await _request(world.app, "GET", "/v1/models")
        assert call.status == 401
        assert b"www-authenticate" not in call.headers
        assert call.headers[b"content-type"] == b"application/json"
        assert call.headers[b"x-llamaswap-request-id"]
        assert json.loads(call.body) == {
            "error": {
                "message": json.loads(call.body)["error"]["message"],
                "type": "invalid_request_error",
                "code": "invalid_api_key",
            }
        }
        assert "API key is required" in json.loads(call.body)["error"]["message"]
        wrong = await _request(
            world.app, "GET", "/v1/models", headers=[(b"x-api-key", WRONG.encode())]
        )
        assert (
            wrong.status == 401 and json.loads(wrong.body)["error"]["message"] == "invalid API key"
        )
        # The health check stays open.
        assert (await _request(world.app, "GET", "/health")).status == 200


async def test_an_admin_issued_key_works_until_revoked():
    ring = _ring()
    ring.set_admin_keys({digest(ISSUED): ApiKey("issued", source="admin")})
    headers = [(b"authorization", b"Bearer " + ISSUED.encode())]
    async with in_process(_config(), keys=ring) as world:
        assert (await _request(world.app, "GET", "/v1/models", headers=headers)).status == 200
        ring.set_admin_keys({})  # revoked
        assert (await _request(world.app, "GET", "/v1/models", headers=headers)).status == 401
        config_key = [(b"authorization", b"Bearer " + KEY.encode())]
        assert (await _request(world.app, "GET", "/v1/models", headers=config_key)).status == 200


async def test_the_key_found_is_put_in_the_scope():
    from web.access import API_KEY_SCOPE, access_refusal

    async with in_process(_config(), keys=_ring()) as world:
        keys = world.runtime.keys
        scope = http_scope(
            "GET", "/v1/models", headers=[(b"host", HOST), (b"x-api-key", KEY.encode())]
        )
        assert await access_refusal(scope, keys) is None
        assert scope[API_KEY_SCOPE] == ApiKey("config-key", scopes=ALL_SCOPES)
        refused = http_scope("GET", "/v1/models", headers=[(b"host", HOST)])
        assert (await access_refusal(refused, keys)).status_code == 401
        assert API_KEY_SCOPE not in refused


# -- nothing changes state from another site -------------------------------------------------


@pytest.mark.parametrize("keys", [False, True], ids=["no keys", "keys"])
@pytest.mark.parametrize(
    ("method", "path", "headers"),
    [
        ("POST", "/api/models/unload", [(b"origin", b"http://evil.example")]),
        ("POST", "/api/models/unload/m", [(b"origin", b"http://evil.example")]),
        ("POST", "/api/models/unload", [(b"origin", b"null")]),
        ("POST", "/api/models/unload", [(b"origin", b"http://127.0.0.1:9999")]),
        ("POST", "/api/models/unload", [(b"sec-fetch-site", b"cross-site")]),
        ("POST", "/api/models/unload", [(b"sec-fetch-site", b"same-site")]),
        ("GET", "/unload", [(b"sec-fetch-site", b"cross-site")]),  # <img src=...>
        ("GET", "/unload", [(b"origin", b"https://evil.example")]),
    ],
)
async def test_cross_origin_unload_is_refused(keys, method, path, headers):
    key = [(b"authorization", b"Bearer " + KEY.encode())] if keys else []
    async with in_process(_config(), keys=_ring() if keys else None) as world:
        call = await _request(world.app, method, path, headers=[*headers, *key])
        assert call.status == 403, call.body
        assert json.loads(call.body)["error"]["code"] == "cross_origin_refused"
        assert call.headers[b"x-llamaswap-request-id"]


@pytest.mark.parametrize(
    "headers",
    [
        [],  # curl, an SDK
        [(b"origin", b"http://127.0.0.1:8080")],
        [(b"origin", b"http://127.0.0.1:8080"), (b"sec-fetch-site", b"same-origin")],
        [(b"sec-fetch-site", b"none")],  # typed in the address bar
    ],
)
async def test_same_origin_unload_is_served(headers):
    async with in_process(_config()) as world:
        call = await _request(world.app, "POST", "/api/models/unload", headers=headers)
        assert call.status == 200, call.body
        legacy = await _request(world.app, "GET", "/unload", headers=headers)
        assert legacy.status == 200 and legacy.body == b"OK"


# -- Host header (DNS rebinding) -------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/api/metrics/activity", "/logs"])
async def test_a_rebinding_host_is_refused_on_api_paths(path):
    async with in_process(_config()) as world:
        call = await _request(world.app, "GET", path, headers=[(b"host", b"evil.example")])
        assert call.status == 400
        error = json.loads(call.body)["error"]
        assert error["code"] == "invalid_host" and "evil.example" in error["message"]
        assert call.headers[b"x-llamaswap-request-id"]


@pytest.mark.parametrize(
    "path", ["/", "/history/", "/admin/login/", "/static/dashboard/favicon.ico"]
)
async def test_a_rebinding_host_is_refused_on_pages(path):
    async with in_process(_config()) as world:
        call = await _request(world.app, "GET", path, headers=[(b"host", b"evil.example:8080")])
        assert call.status == 400
        assert call.headers[b"content-type"].startswith(b"text/html")
        assert b"evil.example:8080" in call.body and b"ALLOWED_HOSTS" in call.body


@pytest.mark.parametrize(
    "host", [b"localhost:8080", b"127.0.0.1", b"[::1]:1234", b"LOCALHOST", b"localhost."]
)
async def test_loopback_names_are_allowed_with_any_port(host):
    async with in_process(_config()) as world:
        call = await _request(world.app, "GET", "/v1/models", headers=[(b"host", host)])
        assert call.status == 200, call.body
        page = await _request(world.app, "GET", "/", headers=[(b"host", host)])
        assert page.status == 200


async def test_two_host_headers_are_refused():
    async with in_process(_config()) as world:
        headers = [(b"host", HOST), (b"host", b"evil.example")]
        call = await _request(world.app, "GET", "/v1/models", headers=headers)
        assert call.status == 400 and call.json()["error"]["code"] == "invalid_host"


async def test_any_host_when_allowed_hosts_is_a_star(settings):
    settings.ALLOWED_HOSTS = ["*"]
    async with in_process(_config()) as world:
        call = await _request(world.app, "GET", "/v1/models", headers=[(b"host", b"evil.example")])
        assert call.status == 200


async def test_a_rebinding_host_cannot_open_the_websocket():
    from channels.testing import WebsocketCommunicator

    async with in_process(_config()) as world:
        comm = WebsocketCommunicator(
            world.app,
            "/ws/dashboard/",
            headers=[(b"host", b"evil.example"), (b"origin", b"http://evil.example")],
        )
        connected, _ = await comm.connect(timeout=3)
        assert not connected


# -- logins: the dashboard's JSON API and websocket ------------------------------------------


async def test_dashboard_require_login_covers_the_json_api(settings, sessions):
    settings.DASHBOARD_REQUIRE_LOGIN = True
    async with in_process(_config()) as world:
        for path in ("/api/metrics/activity", "/api/requests/no-such", "/api/profiles"):
            anonymous = await _request(world.app, "GET", path)
            assert anonymous.status == 403, path
            assert json.loads(anonymous.body)["error"]["code"] == "login_required"
            logged_in = await _request(world.app, "GET", path, headers=[sessions["user"]])
            assert logged_in.status in (200, 404), path
            assert json.loads(logged_in.body).get("error", {}).get("code") != "login_required"


@pytest.mark.parametrize("keys", [False, True], ids=["DASHBOARD_REQUIRE_LOGIN", "keys"])
async def test_the_websocket_needs_a_login(settings, keys):
    from channels.testing import WebsocketCommunicator
    from django.contrib.auth.models import AnonymousUser

    from dashboard.consumers import CLOSE_LOGIN_REQUIRED, DashboardConsumer

    settings.DASHBOARD_REQUIRE_LOGIN = not keys
    async with in_process(_config(), keys=_ring() if keys else None) as world:
        consumer = DashboardConsumer.as_asgi()

        async def served(scope, receive, send):  # as the router hands the runtime over
            return await consumer({**scope, **carrying(world.runtime)}, receive, send)

        comm = WebsocketCommunicator(served, "/ws/dashboard/")
        comm.scope["user"] = AnonymousUser()
        connected, code = await comm.connect(timeout=3)
        assert not connected and code == CLOSE_LOGIN_REQUIRED


# -- start-up: ALLOWED_HOSTS from --listen, the SECRET_KEY ------------------------------------


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1", ["localhost", "127.0.0.1", "[::1]"]),
        ("localhost", ["localhost", "127.0.0.1", "[::1]"]),
        ("::1", ["localhost", "127.0.0.1", "[::1]"]),
        ("127.0.0.2", ["localhost", "127.0.0.1", "[::1]", "127.0.0.2"]),
        ("192.168.1.5", ["192.168.1.5"]),
        ("fd00::5", ["[fd00::5]"]),
        ("gpu-box.lan", ["gpu-box.lan"]),
        ("0.0.0.0", ["*"]),
        ("::", ["*"]),
    ],
)
def test_allowed_hosts_follow_the_listen_address(host, allowed):
    from llamaswap_site.management.commands.serve import allowed_hosts_for

    assert allowed_hosts_for(host) == allowed


def test_the_secret_key_is_generated_once_and_kept(tmp_path):
    from django.conf import settings

    from llamaswap_site.settings import secret_key_file, stored_secret_key

    assert settings.SECRET_KEY != "llamaswap-dev-only-change-me"
    sqlite = {
        "ENGINE": "django_prometheus.db.backends.sqlite3",
        "NAME": str(tmp_path / "db.sqlite3"),
    }
    path = secret_key_file(sqlite)
    assert path == tmp_path / "db.sqlite3-secret_key"
    first = stored_secret_key(path)
    assert len(first) >= 50
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stored_secret_key(path) == first  # read on later starts
    assert [p.name for p in tmp_path.iterdir()] == ["db.sqlite3-secret_key"]  # no temp left
    postgres = {"ENGINE": "django_prometheus.db.backends.postgresql", "NAME": "llamaswap"}
    assert secret_key_file(postgres).parts[-2:] == ("var", "secret_key")
    assert secret_key_file({"ENGINE": "x.sqlite3", "NAME": ":memory:"}).parts[-2:] == (
        "var",
        "secret_key",
    )
