"""Fuzz the real ASGI app with hypothesis: whatever a client sends, no 500, JSON errors.

Requests are built the way daphne hands them over: a request line of printable ASCII (the
path percent-escaped, then ``unquote``d into the scope), header names of token
characters, header values without NUL/CR/LF or daphne's forbidden controls, and a
Content-Length that is the body's (Twisted refuses anything else before the app: those
cases are tests/test_http_errors.py's real-server test). Within that: any method, path,
query, header and body.

Properties, per request:

* no 5xx at all. Every model is a fake process that always starts and a mock that always
  answers 200, so the 502/503/504 a failed model legitimately gets cannot happen here:
  any 5xx is the proxy's own bug.
* on API and proxy paths every 4xx is OpenAI-shaped JSON with a named (non-numeric)
  code, a request id, a body under 2 KB (echoed values are cut), and ``Allow`` on a 405.
* afterwards the dispatcher is idle: nothing waiting, nothing in flight.
"""

from __future__ import annotations

import asyncio
import json
import string
from urllib.parse import quote, unquote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_http_errors import (
    is_json_path,
    multipart,
    start_app,
    stop_app,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]

TOKEN = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
PRINTABLE = "".join(chr(c) for c in range(0x21, 0x7F))  # a request target: no spaces

KNOWN_PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/audio/transcriptions",
    "/v1/messages",
    "/completion",
    "/infill",
    "/rerank",
    "/v1/models",
    "/running",
    "/unload",
    "/api/models/unload",
    "/api/models/unload/m",
    "/health",
    "/logs",
    "/logs/stream",
    "/api/queue",
    "/metrics",
    "/api/metrics/activity",
    "/api/requests/abc",
    "/upstream/m/health",
    "/upstream/m",
    "/upstream/renamed/v1/chat/completions",
    "/",
    "/dashboard/",
    "/history/",
    "/requests/abc/",
]
POST_PATHS = ("/v1/chat", "/v1/completions", "/v1/embeddings", "/v1/audio", "/v1/messages", "/completion", "/infill", "/rerank", "/api/models/unload", "/upstream/renamed")
SEGMENTS = [
    "v1", "api", "upstream", "m", "renamed", "alias", "nope", "models", "unload", "chat",
    "completions", "metrics", "activity", "requests", "logs", "stream", "history", "..", ".",
    "", "%2e%2e", "%2F", "%00", "%01", "%7f", "%ff", "%c3%a9", "%e2%80%8f", "%ZZ", "%",
]


def escaped(text: str) -> str:
    """Unicode and control characters as a client sends them: UTF-8, percent-escaped."""
    return quote(text, safe="")


segment = st.one_of(
    st.sampled_from(SEGMENTS),
    st.text(alphabet=PRINTABLE.replace("/", "").replace("?", "").replace("#", ""), max_size=20),
    st.text(max_size=12).map(escaped),  # any unicode, controls included
    st.binary(min_size=1, max_size=6).map(lambda b: "".join(f"%{x:02x}" for x in b)),  # invalid UTF-8
    st.integers(1000, 20_000).map(lambda n: "a" * n),  # very long
)
raw_path = st.one_of(
    st.sampled_from(KNOWN_PATHS),
    st.sampled_from(KNOWN_PATHS),
    st.sampled_from(KNOWN_PATHS),
    st.tuples(st.sampled_from(KNOWN_PATHS), st.lists(segment, max_size=3)).map(
        lambda t: t[0].rstrip("/") + "/" + "/".join(t[1])
    ),
    st.lists(segment, min_size=1, max_size=5).map(lambda parts: "/" + "/".join(parts)),
)
query_value = st.one_of(
    st.sampled_from(
        ["", "0", "-1", "1", "1000", "1001", "x", "1e999", "nan", "inf", "2026-02-30",
         "2026-11-29", "2026-11-29T21:40", "0001-01-01T00:00:00%2B05:00", "9999-12-31T23:59:59-23:59",
         "99999999999999999999", "interactive", "batch", "%00", "%ff"]
    ),
    st.text(max_size=30).map(escaped),
)
query = st.one_of(
    st.just(b""),
    st.lists(
        st.tuples(
            st.sampled_from(["limit", "page", "start", "end", "since", "until", "model", "band", "request_id", "no-history", "x"]),
            query_value,
        ),
        max_size=4,
    ).map(lambda pairs: "&".join(f"{k}={v}" for k, v in pairs).encode()),
    st.text(alphabet=PRINTABLE.replace("#", ""), max_size=60).map(str.encode),
    st.integers(990, 1100).map(lambda n: b"&".join([b"a=1"] * n)),  # around the 1,000-field cap
)
header_value = st.one_of(
    st.sampled_from(
        [b"", b"application/json", b"multipart/form-data", b"multipart/form-data; boundary=BOUNDARY",
         b"multipart/form-data; boundary=", b"multipart/form-data; boundary=\"", b"text/plain",
         b"application/x-www-form-urlencoded", b"application/json; charset=utf-32", b"application/json; charset=nope",
         b"interactive", b"batch", b"-100", b"9" * 40, b"1e9", b"\xff\xfe", b"  12  "]
    ),
    # daphne refuses NUL, CR, LF and VT, FF, FS, GS, RS, NEL in a value: the rest may come.
    st.binary(max_size=40).map(lambda b: bytes(x for x in b if x not in b"\x00\r\n\x0b\x0c\x1c\x1d\x1e\x85")),
    st.integers(1000, 8000).map(lambda n: b"v" * n),  # huge
)
header_name = st.one_of(
    st.sampled_from([b"content-type", b"x-llamaswap-priority", b"accept", b"cookie", b"origin", b"x-csrftoken", b"transfer-encoding"]),
    st.text(alphabet=TOKEN.replace("_", ""), min_size=1, max_size=20).map(lambda s: s.lower().encode()),
)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
model_name = st.one_of(st.sampled_from(["m", "renamed", "alias", "nope", ""]), st.text(max_size=30), json_value)
chat = st.builds(
    lambda model, extra: json.dumps({**extra, "model": model}).encode(),
    model_name,
    st.dictionaries(st.sampled_from(["messages", "stream", "temperature", "seed", "prompt"]), json_value, max_size=3),
)
depth = st.one_of(st.sampled_from([999, 1_000, 1_001, 5_000, 100_000]), st.integers(1, 3_000))
body = st.one_of(
    chat,
    chat,
    st.just(b""),
    st.binary(max_size=300),
    json_value.map(lambda v: json.dumps(v).encode()),
    depth.map(lambda n: b"[" * n),  # deep nesting
    depth.map(lambda n: b'{"model": "m", "x": ' + b"[" * n + b"]" * n + b"}"),
    # parsed, then dumped again by the rewrite (useModelName), a few frames deeper
    st.integers(850, 1_000).map(lambda n: b'{"model": "renamed", "x": ' + b"[" * n + b"]" * n + b"}"),
    st.builds(lambda fields: multipart(fields), st.dictionaries(st.sampled_from(["model", "file", "language"]), st.text(max_size=10), max_size=3)),
    st.integers(995, 1_010).map(multipart),  # around the 1,000-field cap
)
common_method = st.sampled_from(["GET", "POST", "GET", "POST", "HEAD"])
method = st.one_of(
    common_method,
    common_method,
    common_method,
    st.sampled_from(["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT"]),
    st.text(alphabet=TOKEN, min_size=1, max_size=12),
)


def with_length(draw, headers, payload):
    headers = [(k, v) for k, v in headers if k not in (b"content-length", b"transfer-encoding")]
    if payload and draw(st.booleans()):
        headers.append((b"content-length", str(len(payload)).encode()))  # else: as if chunked
    return headers


@st.composite
def any_request(draw):
    """Anything: method, path, query, headers, body."""
    path = draw(raw_path)
    natural = "POST" if path.startswith(POST_PATHS) else "GET"
    verb = draw(st.one_of(st.just(natural), st.just(natural), method))
    payload = draw(body)
    headers = with_length(draw, draw(st.lists(st.tuples(header_name, header_value), max_size=5)), payload)
    return verb, path, draw(query), headers, payload


CONTENT_TYPES = [
    b"application/json", b"multipart/form-data", b"multipart/form-data; boundary=BOUNDARY",
    b"multipart/form-data; boundary=OTHER", b"multipart/form-data; boundary=", b"multipart/form-data; charset=nope; boundary=BOUNDARY",
    b"application/x-www-form-urlencoded", b"text/plain", b"application/json; charset=utf-16", b"",
]


@st.composite
def scheduled_request(draw):
    """A POST to an inference or /upstream path: the bodies and headers that reach the parser
    and the dispatcher."""
    path = draw(
        st.one_of(
            st.sampled_from(KNOWN_PATHS[:8] + ["/upstream/m/v1/chat/completions", "/upstream/renamed"]),
            st.lists(segment, min_size=1, max_size=3).map(lambda parts: "/upstream/m/" + "/".join(parts)),
            raw_path,
        )
    )
    payload = draw(body)
    headers = [(b"content-type", draw(st.one_of(st.sampled_from(CONTENT_TYPES), header_value)))]
    headers += draw(st.lists(st.tuples(st.just(b"x-llamaswap-priority"), header_value), max_size=1))
    headers += draw(st.lists(st.tuples(header_name, header_value), max_size=2))
    return draw(st.one_of(st.just("POST"), st.just("POST"), method)), path, draw(query), with_length(draw, headers, payload), payload


PARAMETERS = {
    "/history/": ["since", "until", "model", "band", "request_id", "page"],
    "/api/metrics/activity": ["start", "end", "model", "band", "request_id", "limit", "page"],
    "/api/queue": ["limit"],
    "/logs/stream": ["no-history"],
    "/api/requests/abc": ["x"],
    "/requests/abc/": ["x"],
    "/": ["x"],
}
nasty_value = st.sampled_from(
    ["", "0", "-1", "1", "1000", "1001", "10000000000", "x", "1e999", "-1e999", "nan", "inf", "2026-02-30",
     "2026-11-29", "2026-11-29T21:40", "2026-02-30T10:00", "2026-11-29T25:00", "0001-01-01T00:00:00%2B05:00",
     "9999-12-31T23:59:59-23:59", "9999-12-31", "0001-01-01", "99999999999999999999", "interactive", "batch",
     "%00", "a%00b", "%ff", "%C3%A9", "+", "%20"]
)


@st.composite
def query_request(draw):
    """A GET of a page or API endpoint with parameters: its own and junk."""
    path = draw(st.sampled_from(sorted(PARAMETERS)))
    pairs = draw(
        st.lists(
            st.tuples(st.sampled_from(PARAMETERS[path]), st.one_of(nasty_value, nasty_value, query_value)),
            min_size=1,
            max_size=4,
        )
    )
    raw = "&".join(f"{k}={v}" for k, v in pairs).encode()
    return draw(st.sampled_from(["GET", "GET", "HEAD"])), path, raw, [], b""


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def app(loop):
    built = loop.run_until_complete(start_app())
    yield built
    loop.run_until_complete(stop_app(built))


def check(app, loop, request) -> None:
    verb, path, query_string, headers, payload = request
    r = loop.run_until_complete(app.call(verb, path, query_string, headers, payload))
    where = f"{verb} {path[:200]}?{query_string[:200]!r} -> {r.status} {r.body[:300]!r}"
    assert r.status < 500, where
    if r.status >= 400 and is_json_path(unquote(path)):
        assert r.headers.get("content-type") == "application/json", where
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert isinstance(error["code"], str) and not error["code"].isdigit(), where
        assert len(r.headers.get("x-llamaswap-request-id", "")) == 32, where
        assert len(r.body) < 2048, where
    if r.status == 405:
        assert r.headers.get("allow"), where
    assert loop.run_until_complete(app.wait_idle()), f"dispatcher not idle after {where}"


FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(request=any_request())
def test_fuzz_any_request(app, loop, request):
    check(app, loop, request)


@FUZZ
@given(request=scheduled_request())
def test_fuzz_inference_bodies_and_headers(app, loop, request):
    check(app, loop, request)


@FUZZ
@given(request=query_request())
def test_fuzz_query_parameters_of_pages_and_api(app, loop, request):
    check(app, loop, request)
