"""CORS as llama-swap answers it (``web.cors``), and model ids with ``/`` in paths.

Through the real ASGI app in-process (tests/asgi.py): a browser's preflight gets
llama-swap's ``204`` instead of a ``405``; a browser client on an origin that
``security.cors.allowedOrigins`` lists can send and read; any other origin is told no at
the preflight, and its request is still refused (``403``, web.access). Ids such as
``org/model`` work on ``/upstream/{id}/...`` (also sent as ``%2F``) and
``/api/models/unload/{id}``; ``/upstream/{id}`` redirects as llama-swap does.
"""

from __future__ import annotations

import json

import httpx
import pytest

from scheduler.config import Security, parse_config
from scheduler.keys import ALL_SCOPES, ApiKey, KeyRing
from tests.asgi import Body, Call, in_process
from web.cors import DEFAULT_ALLOW_HEADERS, preflight_headers

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
PAGE = b"https://chat.example"
KEY = "sk-cors-key"


def _config(**top):
    models = {
        "m": {"cmd": "fake", "proxy": "http://127.0.0.1:9001"},
        "org/model": {"cmd": "fake", "proxy": "http://127.0.0.1:9002"},
        "org": {"cmd": "fake", "proxy": "http://127.0.0.1:9003"},
    }
    return parse_config({"models": models, **top})


class Upstream(httpx.AsyncBaseTransport):
    """A model server that sends its own ``Access-Control-Allow-Origin: *`` (llama-server
    does) and keeps the URL of every request."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.urls.append(f"{request.url.host}:{request.url.port}{request.url.raw_path.decode()}")
        headers = {"content-type": "application/json", "access-control-allow-origin": "*"}
        return httpx.Response(200, headers=headers, stream=Body(b'{"ok": true}'))


class RawCall(Call):
    """A :class:`Call` that also keeps the response's header list (repeats included)."""

    raw_headers: list[tuple[bytes, bytes]] = []

    async def _send(self, message):
        if message["type"] == "http.response.start":
            self.raw_headers = list(message["headers"])
        await super()._send(message)


async def _call(app, method, path, body=b"", headers=()) -> RawCall:
    call = RawCall(app, path, body, method, headers=list(headers))
    await call.done(timeout=10)
    return call


def _all_headers(call: RawCall, name: bytes) -> list[bytes]:
    return [v for k, v in call.raw_headers if k.lower() == name]


# -- the preflight (pure) ----------------------------------------------------------------------


def test_preflight_headers_are_llama_swaps_where_the_origin_may_send():
    headers = dict(preflight_headers(None, None, Security()))
    assert headers == {
        b"access-control-allow-origin": b"*",
        b"access-control-allow-methods": b"GET, POST, PUT, PATCH, DELETE, OPTIONS",
        b"access-control-allow-headers": DEFAULT_ALLOW_HEADERS,
        b"access-control-max-age": b"86400",
    }
    # Requested headers echoed when they are HTTP tokens (llama-swap drops the others).
    asked = b"content-type, x-bad header, Authorization,, x-llamaswap-priority"
    echoed = dict(preflight_headers(None, asked, Security()))[b"access-control-allow-headers"]
    assert echoed == b"content-type, Authorization, x-llamaswap-priority"
    # A foreign origin by default: no Allow-Origin, so the browser sends nothing.
    assert b"access-control-allow-origin" not in dict(preflight_headers(PAGE, None, Security()))
    listed = Security(allowed_origins=frozenset({"https://chat.example"}))
    assert dict(preflight_headers(PAGE, None, listed))[b"access-control-allow-origin"] == PAGE
    anyone = Security(any_origin=True)
    assert dict(preflight_headers(PAGE, None, anyone))[b"access-control-allow-origin"] == b"*"


# -- through the app ---------------------------------------------------------------------------


@pytest.mark.parametrize("keys", [False, True], ids=["no keys", "keys"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models", "/upstream/m/x", "/"])
async def test_options_is_answered_204_before_any_key(keys, path):
    ring = KeyRing({KEY: ApiKey("k", scopes=ALL_SCOPES)}) if keys else None
    async with in_process(_config(), keys=ring) as world:
        call = await _call(
            world.app,
            "OPTIONS",
            path,
            headers=[(b"access-control-request-method", b"POST")],
        )
        assert call.status == 204, call.body
        assert call.headers[b"access-control-allow-origin"] == b"*"
        assert call.headers[b"access-control-allow-methods"].startswith(b"GET, POST")
        assert world.factory.processes == {}  # nothing loaded, nothing forwarded


async def test_by_default_another_site_is_told_no_at_the_preflight_and_refused_after():
    async with in_process(_config(), transport=Upstream()) as world:
        asked = [(b"origin", PAGE), (b"access-control-request-method", b"POST")]
        preflight = await _call(world.app, "OPTIONS", "/v1/chat/completions", headers=asked)
        assert preflight.status == 204
        assert b"access-control-allow-origin" not in preflight.headers
        pna = [*asked, (b"access-control-request-private-network", b"true")]
        preflight = await _call(world.app, "OPTIONS", "/v1/chat/completions", headers=pna)
        assert b"access-control-allow-private-network" not in preflight.headers
        sent = [(b"origin", PAGE), (b"sec-fetch-site", b"cross-site")]
        call = await _call(world.app, "POST", "/v1/chat/completions", CHAT, headers=sent)
        assert call.status == 403
        assert json.loads(call.body)["error"]["code"] == "cross_origin_refused"
        assert b"access-control-allow-origin" not in call.headers


@pytest.mark.parametrize("origins", [["https://chat.example"], ["*"]])
async def test_a_browser_client_on_an_allowed_origin_works(origins):
    upstream = Upstream()
    config = _config(security={"cors": {"allowedOrigins": origins}})
    async with in_process(config, transport=upstream) as world:
        asked = [
            (b"origin", PAGE),
            (b"access-control-request-method", b"POST"),
            (b"access-control-request-headers", b"content-type, authorization"),
        ]
        preflight = await _call(world.app, "OPTIONS", "/v1/chat/completions", headers=asked)
        assert preflight.status == 204
        assert preflight.headers[b"access-control-allow-origin"] in (PAGE, b"*")
        assert preflight.headers[b"access-control-allow-headers"] == b"content-type, authorization"
        # Chrome's Private Network Access preflight (a public page reaching localhost).
        pna = [*asked, (b"access-control-request-private-network", b"true")]
        preflight = await _call(world.app, "OPTIONS", "/v1/chat/completions", headers=pna)
        assert preflight.headers[b"access-control-allow-private-network"] == b"true"
        sent = [(b"origin", PAGE), (b"sec-fetch-site", b"cross-site")]
        call = await _call(world.app, "POST", "/v1/chat/completions", CHAT, headers=sent)
        assert call.status == 200, call.body
        # One Allow-Origin (the model server's "*" replaced: two would fail the browser).
        assert _all_headers(call, b"access-control-allow-origin") == [PAGE]
        assert call.headers[b"vary"] == b"Origin"
        exposed = call.headers[b"access-control-expose-headers"].lower()
        assert b"x-llamaswap-request-id" in exposed and b"retry-after" in exposed
        listing = await _call(world.app, "GET", "/v1/models", headers=sent)
        assert listing.status == 200
        assert listing.headers[b"access-control-allow-origin"] == PAGE


async def test_a_request_without_origin_gets_no_cors_header():
    config = _config(security={"cors": {"allowedOrigins": ["*"]}})
    async with in_process(config, transport=Upstream()) as world:
        call = await _call(world.app, "POST", "/v1/chat/completions", CHAT)
        assert call.status == 200
        assert _all_headers(call, b"access-control-allow-origin") == [b"*"]  # the model's own


# -- security.cors's other keys -----------------------------------------------------------------


def test_cors_keys_shape_the_preflight():
    security = _config(
        security={
            "cors": {
                "allowedOrigins": ["https://chat.example"],
                "allowedMethods": ["GET", "POST"],
                "allowedHeaders": ["Content-Type", "X-Custom"],
                "maxAge": 600,
                "allowCredentials": True,
            }
        }
    ).security
    asked = b"content-type, x-other"
    headers = dict(preflight_headers(PAGE, asked, security))
    assert headers[b"access-control-allow-origin"] == PAGE
    assert headers[b"access-control-allow-methods"] == b"GET, POST"
    assert headers[b"access-control-allow-headers"] == b"Content-Type, X-Custom"  # not echoed
    assert headers[b"access-control-max-age"] == b"600"
    assert headers[b"access-control-allow-credentials"] == b"true"
    # A foreign origin is still told no, credentials or not.
    foreign = dict(preflight_headers(b"https://evil.example", asked, security))
    assert b"access-control-allow-origin" not in foreign
    assert b"access-control-allow-credentials" not in foreign
    star = _config(security={"cors": {"allowedHeaders": ["*"]}}).security
    assert dict(preflight_headers(None, asked, star))[b"access-control-allow-headers"] == b"*"


async def test_exposed_headers_and_credentials_reach_an_allowed_origins_responses():
    cors = {
        "allowedOrigins": ["https://chat.example"],
        "exposedHeaders": ["X-Model-Hint"],
        "allowCredentials": True,
    }
    async with in_process(_config(security={"cors": cors}), transport=Upstream()) as world:
        sent = [(b"origin", PAGE), (b"sec-fetch-site", b"cross-site")]
        call = await _call(world.app, "POST", "/v1/chat/completions", CHAT, headers=sent)
        assert call.status == 200, call.body
        exposed = call.headers[b"access-control-expose-headers"]
        assert exposed == b"X-LlamaSwap-Request-Id, Retry-After, X-Model-Hint"
        assert _all_headers(call, b"access-control-allow-credentials") == [b"true"]


@pytest.mark.parametrize(
    ("cors", "key", "says"),
    [
        ({"allowCredentials": "yes"}, "security.cors.allowCredentials", "true or false"),
        (
            {"allowCredentials": True, "allowedOrigins": ["*"]},
            "security.cors.allowCredentials",
            "list the origins",
        ),
        ({"allowedMethods": "GET"}, "security.cors.allowedMethods", "must be a list"),
        ({"allowedMethods": ["GET", "PO ST"]}, "security.cors.allowedMethods[1]", "HTTP token"),
        ({"allowedHeaders": ["X-A", "*"]}, "security.cors.allowedHeaders[1]", "the one entry"),
        ({"exposedHeaders": ["X:Y"]}, "security.cors.exposedHeaders[0]", "HTTP token"),
        ({"maxAge": -1}, "security.cors.maxAge", ">= 0"),
        ({"maxAge": "1h"}, "security.cors.maxAge", "integer"),
    ],
)
def test_a_bad_cors_value_is_a_config_error_naming_its_key(cors, key, says):
    from scheduler.config import ConfigError

    with pytest.raises(ConfigError) as error:
        _config(security={"cors": cors})
    assert error.value.key == key
    assert says in str(error.value)


# -- ids with "/" ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "target"),
    [
        ("/upstream/org/model/health", "127.0.0.1:9002/health"),
        ("/upstream/org%2Fmodel/v1/models?x=1", "127.0.0.1:9002/v1/models?x=1"),
        ("/upstream/org/model/", "127.0.0.1:9002/"),
        ("/upstream/org/health", "127.0.0.1:9003/health"),  # "org" is a model too
        ("/upstream/m/org/model", "127.0.0.1:9001/org/model"),
    ],
)
async def test_upstream_finds_the_longest_id(path, target):
    upstream = Upstream()
    config = _config(upstream={"allowPaths": [".*"]})
    async with in_process(config, transport=upstream) as world:
        call = await _call(world.app, "GET", path)
        assert call.status == 200, call.body
        assert upstream.urls == [target]


@pytest.mark.parametrize(
    ("method", "path", "status", "location"),
    [
        ("GET", "/upstream/org/model", 301, b"/upstream/org/model/"),
        ("HEAD", "/upstream/m", 301, b"/upstream/m/"),
        ("POST", "/upstream/m?a=1", 308, b"/upstream/m/?a=1"),
        ("PUT", "/upstream/org%2Fmodel", 308, b"/upstream/org/model/"),
    ],
)
async def test_upstream_without_the_trailing_slash_redirects(method, path, status, location):
    upstream = Upstream()
    async with in_process(_config(), transport=upstream) as world:
        call = await _call(world.app, method, path)
        assert call.status == status
        assert call.headers[b"location"] == location
        assert upstream.urls == [] and world.factory.processes == {}


async def test_upstream_unknown_id_is_404():
    async with in_process(_config()) as world:
        missing = await _call(world.app, "GET", "/upstream/nobody/x")
        assert missing.status == 404
        assert json.loads(missing.body)["error"]["code"] == "model_not_found"


async def test_unload_an_id_with_a_slash():
    async with in_process(_config(), transport=Upstream()) as world:
        call = await _call(world.app, "GET", "/upstream/org/model/health")
        assert call.status == 200 and "org/model" in world.factory.processes
        unloaded = await _call(world.app, "POST", "/api/models/unload/org/model")
        assert unloaded.status == 200 and unloaded.body == b"OK"
        assert world.dispatcher.running_models() == []
        missing = await _call(world.app, "POST", "/api/models/unload/org/nope")
        assert missing.status == 404
