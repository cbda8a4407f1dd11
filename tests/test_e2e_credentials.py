"""The proxy's credentials stay the proxy's; other sites are refused. Through the real
server (``manage.py serve``) with fakellm models, which record every request they get:

* a local model never sees the key the client presented to this server (``Authorization``,
  ``x-api-key``) nor the dashboard's cookies, over inference and ``/upstream``;
* ``/upstream/<model>/...`` reaches only what ``upstream.allowPaths`` names: the model's
  operator endpoints (``/slots``) are refused with 403 unless the config allows them;
* a browser request from another site (``Origin``, ``Sec-Fetch-Site``) to an API path is
  refused with 403 before it takes a turn, unless ``security.cors.allowedOrigins`` names
  the site; same-origin pages and non-browser clients are served;
* a 401 carries no ``WWW-Authenticate: Basic`` challenge.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server import chat, fake_model, fake_requests, free_port_block, serve

pytestmark = pytest.mark.timeout(90)

KEY = "sk-e2e-credentials"
ALLOWED = "http://allowed.example:3000"
EVIL = "http://evil.example"
COOKIES = "theme=dark; sessionid=s3cr3t-session; csrftoken=s3cr3t-csrf; lang=en"
"""A browser's Cookie header on this origin: the dashboard's session and CSRF cookies
between two of a model's own web UI's."""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Keys on, every default (allowPaths, no allowed origins, no Basic challenge)."""
    port = free_port_block(1)
    with serve(
        tmp_path_factory.mktemp("keyed"), {"m": fake_model(port)}, {"apiKeys": [KEY]}
    ) as server:
        server.model_port = port
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("m"), headers=auth(), timeout=20)
        assert r.status_code == 200, r.text  # loaded: its records are readable from here on
        yield server


@pytest.fixture(scope="module")
def open_box(tmp_path_factory):
    """No keys; ``upstream.allowPaths`` and ``security.cors.allowedOrigins`` configured."""
    port = free_port_block(1)
    extra = {
        "upstream": {"allowPaths": ["^/slots$", "^/v1/"]},
        "security": {"cors": {"allowedOrigins": [ALLOWED]}},
    }
    with serve(tmp_path_factory.mktemp("open"), {"m": fake_model(port)}, extra) as server:
        server.model_port = port
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("m"), timeout=20)
        assert r.status_code == 200, r.text
        yield server


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def seen(server) -> list[dict]:
    """What the model received so far (read from the model itself, not through the proxy)."""
    return fake_requests(server.model_port)


def error(response: httpx.Response) -> dict:
    return response.json()["error"]


# -- credentials ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/upstream/m/v1/chat/completions"], ids=["inference", "upstream"]
)
def test_the_model_never_sees_the_key_or_the_dashboards_cookies(keyed, path):
    before = len(seen(keyed))
    headers = {**auth(), "x-api-key": "sk-also-presented", "Cookie": COOKIES, "X-Custom": "kept"}
    r = httpx.post(keyed.url + path, json=chat("m", "secret prompt"), headers=headers, timeout=20)
    assert r.status_code == 200, r.text
    records = seen(keyed)[before:]
    assert len(records) == 1
    got = records[0]["headers"]
    assert "authorization" not in got and "x-api-key" not in got, got
    assert got["cookie"] == "theme=dark; lang=en"  # the model's own cookies pass
    assert got["x-custom"] == "kept"


def test_without_keys_the_clients_authorization_is_the_models(open_box):
    # No key is checked here, so Authorization is not this server's (llama-swap passes it:
    # a llama-server started with --api-key reads it); the dashboard's cookies still stay.
    before = len(seen(open_box))
    headers = {"Authorization": "Bearer sk-for-the-model", "Cookie": "sessionid=x; csrftoken=y"}
    r = httpx.post(open_box.url + "/v1/chat/completions", json=chat("m"), headers=headers, timeout=20)
    assert r.status_code == 200, r.text
    [record] = seen(open_box)[before:]
    assert record["headers"]["authorization"] == "Bearer sk-for-the-model"
    assert "cookie" not in record["headers"]


# -- upstream.allowPaths -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/upstream/m/slots",  # llama-server's: every slot's prompt
        "/upstream/m/metrics",
        "/upstream/m/fake/requests",  # fakellm's window on every request it got
        "/upstream/m/v1/%2e%2e/slots",  # a dot segment a model server could resolve
        "/upstream/m/v1%2F..%2Fslots",
    ],
)
def test_a_models_operator_endpoints_are_refused_by_default(keyed, path):
    before = len(seen(keyed))
    r = httpx.get(keyed.url + path, headers=auth(), timeout=10)
    assert r.status_code == 403, r.text
    assert error(r)["code"] == "path_not_allowed"
    assert "upstream.allowPaths" in error(r)["message"]
    assert r.headers["x-llamaswap-request-id"]
    assert seen(keyed)[before:] == []  # the model never saw it


@pytest.mark.parametrize("path", ["/upstream/m/", "/upstream/m/props", "/upstream/m/v1/models"])
def test_the_web_ui_and_api_paths_pass_by_default(keyed, path):
    r = httpx.get(keyed.url + path, headers=auth(), timeout=10)
    assert r.status_code != 403, r.text
    assert seen(keyed)[-1]["path"] == path.removeprefix("/upstream/m")


def test_allow_paths_in_the_config_replace_the_default(open_box):
    slots = httpx.get(open_box.url + "/upstream/m/slots", timeout=10)
    assert slots.status_code == 200 and slots.json()[0]["id"] == 0, slots.text
    props = httpx.get(open_box.url + "/upstream/m/props", timeout=10)
    assert props.status_code == 403 and error(props)["code"] == "path_not_allowed"


# -- cross-site requests ---------------------------------------------------------------------


def text_plain(url: str, **headers: str) -> httpx.Response:
    """The "simple" request a page on another site can send without a preflight."""
    body = json.dumps(chat("m", "from another site"))
    return httpx.post(url, content=body, headers={"Content-Type": "text/plain", **headers}, timeout=20)


@pytest.mark.parametrize("keys", [False, True], ids=["no keys", "keys"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/upstream/m/v1/chat/completions"])
@pytest.mark.parametrize(
    "browser",
    [
        {"Origin": EVIL},
        {"Origin": EVIL, "Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "cross-site"},  # a form or an <img>: no Origin
        {"Origin": "null"},  # a sandboxed frame, a file:// page
    ],
    ids=["origin", "origin+fetch-site", "fetch-site", "null"],
)
def test_a_cross_site_request_is_refused_and_takes_no_turn(keyed, open_box, keys, path, browser):
    server = keyed if keys else open_box
    before = len(seen(server))
    r = text_plain(server.url + path, **browser, **(auth() if keys else {}))
    assert r.status_code == 403, r.text
    assert error(r)["code"] == "cross_origin_refused"
    assert "security.cors.allowedOrigins" in error(r)["message"]
    assert seen(server)[before:] == []  # refused before any turn: the model never saw it


@pytest.mark.parametrize("path", ["/v1/models", "/api/queue", "/metrics", "/logs", "/upstream/m/"])
def test_every_api_path_refuses_another_site(keyed, path):
    r = httpx.get(keyed.url + path, headers={**auth(), "Sec-Fetch-Site": "cross-site"}, timeout=10)
    assert r.status_code == 403 and error(r)["code"] == "cross_origin_refused", r.text
    assert httpx.get(keyed.url + "/health", headers={"Origin": EVIL}, timeout=10).status_code == 200


@pytest.mark.parametrize(
    "browser",
    [
        {},  # curl, an SDK
        {"Sec-Fetch-Site": "same-origin", "Origin": "self"},
        {"Origin": "self"},  # an older browser: no Sec-Fetch-Site
        {"Sec-Fetch-Site": "none"},  # typed in the address bar
    ],
    ids=["no browser", "same-origin", "origin only", "typed"],
)
def test_same_origin_and_non_browser_requests_are_served(keyed, browser):
    headers = {k: (keyed.url if v == "self" else v) for k, v in browser.items()}
    for path in ("/v1/chat/completions", "/upstream/m/v1/chat/completions"):
        r = text_plain(keyed.url + path, **headers, **auth())
        assert r.status_code == 200, r.text


def test_an_allowed_origin_is_served(open_box):
    for headers in ({"Origin": ALLOWED}, {"Origin": ALLOWED, "Sec-Fetch-Site": "cross-site"}):
        r = text_plain(open_box.url + "/v1/chat/completions", **headers)
        assert r.status_code == 200, r.text
    other = text_plain(open_box.url + "/v1/chat/completions", Origin="http://allowed.example:3001")
    assert other.status_code == 403


# -- 401 --------------------------------------------------------------------------------------


def test_a_401_has_no_basic_challenge(keyed):
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = httpx.get(keyed.url + "/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401 and error(r)["code"] == "invalid_api_key"
        assert "www-authenticate" not in r.headers
    # Basic auth itself still works (llama-swap's clients send it): only the challenge is gone.
    basic = httpx.get(keyed.url + "/v1/models", auth=("anyone", KEY), timeout=10)
    assert basic.status_code == 200
