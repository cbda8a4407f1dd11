"""The pure rules behind tests/test_e2e_credentials.py: the cross-site rule
(``web.access.cross_site``, fuzzed over Origin x Sec-Fetch-Site x policy), the
``upstream.allowPaths`` check and its default, the header filter a model's request goes
through, and the ``security`` / ``upstream.allowPaths`` config keys."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.upstream import forward_headers
from proxy.views import path_allowed
from scheduler.config import Config, ConfigError, Security, parse_config
from web.access import cross_site

HOST = "127.0.0.1:8080"
MODELS = {"m": {"cmd": "x", "proxy": "http://127.0.0.1:9001"}}
DEFAULT_ALLOW = Config(models={}).upstream_allow_paths
NONE = Security()
ALLOW = Security(allowed_origins=frozenset({"https://chat.example", "http://localhost:3000"}))
ANY = Security(any_origin=True)

# -- the cross-site rule ------------------------------------------------------------------

SELF = [
    "http://127.0.0.1:8080",
    "HTTP://127.0.0.1:8080",
    "http://127.0.0.1:8080/",
    "https://127.0.0.1:8080",  # the Host's host:port: behind TLS the server cannot tell
]
ALLOWED = ["https://chat.example", "https://CHAT.example:443", "http://localhost:3000"]
FOREIGN = [
    "http://evil.example",
    "http://127.0.0.1:9999",  # another port
    "http://chat.example",  # the allowed host over http
    "https://chat.example:8443",
    "http://localhost:3001",
    "null",  # a sandboxed frame, a file:// page
    "file://",
    "",
    "garbage",
]
SITES = ["same-origin", "none", "same-site", "cross-site", "Cross-Site ", "bogus", ""]


def reference(origin: str | None, site: str | None, security: Security) -> bool:
    """Is the request refused? Written from the README's table, case by case."""
    if security.any_origin:
        return False
    site = (site or "").strip().lower()
    if site in ("same-origin", "none"):  # the browser says it is this origin, or no page at all
        return False
    if origin in ALLOWED and security is ALLOW:
        return False
    if site in ("cross-site", "same-site"):
        return True
    if origin is None:  # no browser header at all (or one we cannot read): not a browser's
        return False
    return origin not in SELF


@settings(max_examples=400, deadline=None)
@given(
    origin=st.none() | st.sampled_from(SELF + ALLOWED + FOREIGN),
    site=st.none() | st.sampled_from(SITES),
    security=st.sampled_from([NONE, ALLOW, ANY]),
)
def test_the_rule_matches_the_reference(origin, site, security):
    reason = cross_site(origin, site, HOST, security)
    assert (reason is not None) == reference(origin, site, security), reason
    if reason is not None:
        assert "Origin" in reason or "Sec-Fetch-Site" in reason


@settings(max_examples=300, deadline=None)
@given(origin=st.text(max_size=60), site=st.text(max_size=20), host=st.text(max_size=40))
def test_any_header_values_get_an_answer_and_a_short_reason(origin, site, host):
    reason = cross_site(origin, site, host, ALLOW)
    assert reason is None or len(reason) < 600  # echoed values are cut


@pytest.mark.parametrize(
    ("origin", "site", "refused"),
    [
        (None, None, False),  # curl, an SDK
        ("http://evil.example", None, True),  # an older browser's cross-site fetch
        (None, "cross-site", True),  # a form post or an <img src>: no Origin
        ("http://evil.example", "same-origin", False),  # the browser's word wins (rewritten Host)
        ("http://localhost:3000", "same-site", False),  # allowed: another port of localhost
        ("http://localhost:3000", "cross-site", False),
        ("null", "cross-site", True),
    ],
)
def test_a_few_cases_spelled_out(origin, site, refused):
    assert (cross_site(origin, site, HOST, ALLOW) is not None) is refused


def test_non_api_paths_and_non_browsers_are_left_to_others():
    from tests.asgi import http_scope
    from web.access import cross_site_refusal

    evil = [(b"host", HOST.encode()), (b"origin", b"http://evil.example")]
    for path in ("/health", "/favicon.ico", "/dashboard/", "/admin/login/"):
        assert cross_site_refusal(http_scope("POST", path, headers=evil)) is None
    for path in ("/v1/chat/completions", "/upstream/m/", "/api/queue", "/logs/stream", "/metrics"):
        refusal = cross_site_refusal(http_scope("POST", path, headers=evil))
        assert refusal is not None and refusal.status_code == 403
        assert cross_site_refusal(http_scope("POST", path, headers=evil[:1])) is None


# -- upstream.allowPaths --------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/",  # the web UI, the Load button
        "/index.html",
        "/bundle.js",
        "/assets/index-3f2a.css",
        "/favicon.ico",
        "/robots.txt",
        "/v1/chat/completions",
        "/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/models",
        "/models",
        "/v1/audio/transcriptions",
        "/completion",
        "/infill",
        "/tokenize",
        "/detokenize",
        "/apply-template",
        "/props",
        "/health",
    ],
)
def test_the_default_lets_a_web_ui_and_api_clients_through(path):
    assert path_allowed(path, DEFAULT_ALLOW)


@pytest.mark.parametrize(
    "path",
    [
        "/slots",
        "/slots/0",
        "/metrics",
        "/lora-adapters",
        "/cors-proxy",
        "/tools",
        "/models/load",
        "/models/unload",
        "/fake/requests",
        "/v1/chat/completions/../../slots",  # a dot segment: not the path the model serves
        "/x.js/../slots",
        "/./slots.js",
        "/.env",  # a hidden file is no static asset
        "/slots?.js",  # %3F decoded
        "/slots\x00.js",
        "/v1/chat/completionsX",
        "//slots",
        "",
    ],
)
def test_the_default_keeps_operator_endpoints_out(path):
    assert not path_allowed(path, DEFAULT_ALLOW)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["v1", "..", ".", "x.js", "slots", "", "%2e", "chat"]), max_size=6))
def test_no_allowed_path_has_a_dot_segment(segments):
    path = "/" + "/".join(segments)
    if path_allowed(path, DEFAULT_ALLOW):
        assert "." not in segments and ".." not in segments


def test_matching_is_linear_in_the_path():
    # RE2: a path any client sends never costs more than a pass over it.
    for path in ("/" + "." * 100_000, "/" + "a/" * 50_000 + "x", "/" + "a." * 50_000):
        started = time.perf_counter()
        path_allowed(path, DEFAULT_ALLOW)
        assert time.perf_counter() - started < 0.5


# -- what a model's request carries --------------------------------------------------------

HEADERS = [
    (b"host", b"127.0.0.1:8080"),
    (b"authorization", b"Bearer sk-proxy"),
    (b"x-api-key", b"sk-proxy"),
    (b"cookie", b"theme=dark; sessionid=abc; csrftoken=def"),
    (b"cookie", b"sessionid=abc"),
    (b"content-type", b"application/json"),
    (b"connection", b"keep-alive"),
]


def test_forward_headers_drops_the_proxys_credentials():
    assert forward_headers(HEADERS, credentials=False) == [
        (b"cookie", b"theme=dark"),
        (b"content-type", b"application/json"),
    ]
    # Without a key to check here, Authorization and x-api-key are not this server's.
    assert forward_headers(HEADERS) == [
        (b"authorization", b"Bearer sk-proxy"),
        (b"x-api-key", b"sk-proxy"),
        (b"cookie", b"theme=dark"),
        (b"content-type", b"application/json"),
    ]


@pytest.mark.parametrize(
    ("cookie", "sent"),
    [
        (b"a=1", b"a=1"),
        (b"sessionid=x", None),
        (b"a=1;sessionid=x;b=2", b"a=1;b=2"),
        (b"csrftoken=y; a=1", b"a=1"),
        (b"sessionidx=1; xsessionid=2", b"sessionidx=1; xsessionid=2"),  # other names
        (b"sessionid", None),  # no value: still the name
    ],
)
def test_only_the_dashboards_cookies_are_removed(cookie, sent):
    got = forward_headers([(b"cookie", cookie)])
    assert got == ([] if sent is None else [(b"cookie", sent)])


# -- the config ---------------------------------------------------------------------------


def test_security_defaults_allow_no_other_site_and_send_no_challenge():
    assert parse_config({"models": MODELS}).security == Security()


def test_allowed_origins_are_kept_as_browsers_send_them():
    config = parse_config(
        {
            "models": MODELS,
            "security": {
                "cors": {
                    "allowedOrigins": ["https://Chat.Example:443", "http://[::1]:3000"],
                    "maxAge": 60,
                },
                "basicAuthChallenge": True,
            },
        }
    )
    assert config.security == Security(
        frozenset({"https://chat.example", "http://[::1]:3000"}), False, True, max_age=60
    )
    assert not config.warnings
    star = parse_config({"models": MODELS, "security": {"cors": {"allowedOrigins": ["*"]}}})
    assert star.security.any_origin


@pytest.mark.parametrize(
    ("security", "key"),
    [
        ({"cors": {"allowedOrigins": ["https://chat.example/"]}}, "security.cors.allowedOrigins[0]"),
        ({"cors": {"allowedOrigins": ["*", "chat.example"]}}, "security.cors.allowedOrigins[1]"),
        ({"cors": {"allowedOrigins": ["ftp://x"]}}, "security.cors.allowedOrigins[0]"),
        ({"cors": {"allowedOrigins": "https://x"}}, "security.cors.allowedOrigins"),
        ({"cors": ["x"]}, "security.cors"),
        ({"basicAuthChallenge": "yes"}, "security.basicAuthChallenge"),
        ("on", "security"),
    ],
)
def test_a_bad_security_section_names_its_key(security, key):
    with pytest.raises(ConfigError) as raised:
        parse_config({"models": MODELS, "security": security})
    assert raised.value.key == key


def test_allow_paths_replace_the_default_and_bad_ones_name_their_key():
    config = parse_config({"models": MODELS, "upstream": {"allowPaths": ["^/slots$"]}})
    assert [p.pattern for p in config.upstream_allow_paths] == ["^/slots$"]
    assert not any("allowPaths" in w for w in config.warnings)
    empty = parse_config({"models": MODELS, "upstream": {"allowPaths": []}})
    assert [p.pattern for p in empty.upstream_allow_paths] == [p.pattern for p in DEFAULT_ALLOW]
    with pytest.raises(ConfigError) as raised:
        parse_config({"models": MODELS, "upstream": {"allowPaths": ["ok", "(?<=x)y"]}})
    assert raised.value.key == "upstream.allowPaths[1]"


async def test_the_basic_challenge_when_the_config_asks_for_it():
    import json

    from scheduler.keys import ApiKey, KeyRing
    from tests.asgi import in_process
    from tests.test_access import _request

    ring = KeyRing({"sk-k": ApiKey("k")})
    for challenge in (False, True):
        config = parse_config({"models": MODELS, "security": {"basicAuthChallenge": challenge}})
        async with in_process(config, keys=ring) as world:
            call = await _request(world.app, "GET", "/v1/models")
        assert call.status == 401 and json.loads(call.body)["error"]["code"] == "invalid_api_key"
        assert call.headers.get(b"www-authenticate") == (
            b'Basic realm="llamaswap"' if challenge else None
        )
