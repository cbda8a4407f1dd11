"""Every error is JSON and precise: a table of bad requests through the real ASGI app.

In process: ``llamaswap_site.asgi.build_application(rt)`` driven with raw ASGI messages (the way
daphne sends them), over a dispatcher with fake model processes and a mock model that
always answers 200. Then one real server (daphne) for what never reaches the app:
malformed HTTP, answered by ``llamaswap_site.http_server``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field

import httpx
import pytest
import yaml

from proxy.upstream import Upstreams
from scheduler import runtime
from scheduler.config import parse_config
from scheduler.dispatcher import Dispatcher
from scheduler.testing import FakeProcessFactory
from tests.asgi import http_scope
from tests.server import ROOT, descendants, free_port

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]

REQUEST_ID = "x-llamaswap-request-id"
UPSTREAM_BODY = b'{"id": "chatcmpl-1", "object": "chat.completion", "choices": []}'


# -- the app in process ------------------------------------------------------------------


def mock_model(request: httpx.Request) -> httpx.Response:
    """Every model answers 200 (so any 5xx the client sees is the proxy's own)."""
    # A stream, not content=: httpx marks a content= response consumed, and the relay
    # reads it with aiter_raw().
    return httpx.Response(
        200, headers={"content-type": "application/json"}, stream=httpx.ByteStream(UPSTREAM_BODY)
    )


def make_config():
    return parse_config(
        {
            "models": {
                "m": {"cmd": "fake", "proxy": "http://127.0.0.1:9001", "aliases": ["alias"]},
                "renamed": {
                    "cmd": "fake",
                    "proxy": "http://127.0.0.1:9002",
                    "useModelName": "upstream-name",
                    "filters": {"stripParams": "temperature", "setParams": {"seed": 1}},
                },
            }
        }
    )


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    streamed: bool = False

    def json(self):
        return json.loads(self.body)

    @property
    def error(self) -> dict:
        return self.json()["error"]


@dataclass
class App:
    """The ASGI app with a runtime of its own; :meth:`call` sends one request."""

    dispatcher: Dispatcher
    application: object = field(default=None)

    async def call(
        self,
        method: str,
        raw_path: str,
        query: bytes = b"",
        headers: list[tuple[bytes, bytes]] | None = None,
        body: bytes = b"",
        timeout: float = 10,
    ) -> Response:
        """``raw_path`` as on the request line (percent-escaped ASCII): the scope gets what
        daphne makes of it (``unquote``). A streaming answer is read to its first chunk,
        then the client hangs up (``http.disconnect``, as daphne sends it)."""
        scope = http_scope(method, raw_path, query, headers or [])
        messages = []
        hang_up = asyncio.Event()
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if pending:
                return pending.pop()
            await hang_up.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            messages.append(message)
            if message["type"] == "http.response.body":
                hang_up.set()  # the whole answer, or the first chunk of a stream

        async with asyncio.timeout(timeout):
            await self.application(scope, receive, send)
        start = next(m for m in messages if m["type"] == "http.response.start")
        chunks = [m for m in messages if m["type"] == "http.response.body"]
        return Response(
            status=start["status"],
            headers={k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start["headers"]},
            body=b"".join(m.get("body", b"") for m in chunks),
            streamed=bool(chunks) and chunks[-1].get("more_body", False),
        )

    def idle(self) -> bool:
        return not self.dispatcher.in_flight() and len(self.dispatcher.queue) == 0

    async def wait_idle(self, timeout: float = 2.0) -> bool:
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.002)
        return True


async def start_app() -> App:
    from llamaswap_site.asgi import build_application

    config = make_config()
    dispatcher = Dispatcher(config, process_factory=FakeProcessFactory())
    upstreams = Upstreams(size=1, transport=httpx.MockTransport(mock_model))
    rt = runtime.Runtime(config=config, dispatcher=dispatcher, upstreams=upstreams)
    runtime.install(rt)
    await dispatcher.start()
    return App(dispatcher=dispatcher, application=build_application(rt))


async def stop_app(app: App) -> None:
    try:
        await app.dispatcher.stop(grace=0)
        await runtime.current().upstreams.aclose()
    finally:
        runtime.install(None)


@pytest.fixture
async def app():
    built = await start_app()
    yield built
    await stop_app(built)


def is_json_path(path: str) -> bool:
    """Where errors must be JSON: the OpenAI API, our API, the proxy's own endpoints."""
    from web.paths import PROXY_EXACT

    return path.startswith(("/v1/", "/api/", "/upstream/", "/logs/")) or path.rstrip("/") in (
        PROXY_EXACT | {"/v1", "/api", "/upstream"}
    )


def assert_json_error(r: Response, status: int, code: str | None = None) -> dict:
    assert r.status == status, (r.status, r.body[:500])
    assert r.headers["content-type"] == "application/json", r.headers
    error = r.error
    assert set(error) >= {"message", "type", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["code"], str) and not error["code"].isdigit(), error
    if code is not None:
        assert error["code"] == code, error
    assert len(r.headers[REQUEST_ID]) == 32
    return error


# -- the table ---------------------------------------------------------------------------

JSON = [(b"content-type", b"application/json")]
HUGE = "x" * (1 << 20)


def multipart(fields: dict[str, str] | int, boundary: str = "BOUNDARY") -> bytes:
    pairs = fields.items() if isinstance(fields, dict) else ((f"f{i}", "v") for i in range(fields))
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in pairs
    ]
    return ("".join(parts) + f"--{boundary}--\r\n").encode()


MULTIPART = [(b"content-type", b"multipart/form-data; boundary=BOUNDARY")]
READ_ONLY = ["/v1/models", "/running", "/health", "/logs", "/logs/stream", "/api/queue", "/metrics"]


@dataclass
class Case:
    method: str
    path: str
    status: int
    code: str | None
    allow: str | None = None
    query: bytes = b""
    headers: list = field(default_factory=list)
    body: bytes = b""
    param: str | None = None
    says: str | None = None
    """Text the message must contain."""


CASES = {
    # bodies that used to be a 500 or an HTML 400
    "deep JSON": Case("POST", "/v1/chat/completions", 400, "invalid_json", headers=JSON, body=b"[" * 100_000, says="nested too deeply"),
    "deep JSON object": Case("POST", "/v1/chat/completions", 400, "invalid_json", headers=JSON, body=b'{"a":' * 50_000, says="nested too deeply"),
    "empty body": Case("POST", "/v1/chat/completions", 400, "invalid_json", headers=JSON, says="empty"),
    "JSON array": Case("POST", "/v1/chat/completions", 400, "invalid_json", headers=JSON, body=b"[1]", says="an array"),
    "bytes": Case("POST", "/v1/embeddings", 400, "invalid_json", body=b"\xff\xfe\x00garbage"),
    "model not a string": Case("POST", "/v1/chat/completions", 400, "missing_model", headers=JSON, body=b'{"model": 7}', param="model", says="must be a string"),
    "multipart without boundary": Case("POST", "/v1/audio/transcriptions", 400, "invalid_multipart", headers=[(b"content-type", b"multipart/form-data")], body=b"x", says="boundary"),
    "multipart over 1000 fields": Case("POST", "/v1/audio/transcriptions", 400, "too_many_fields", headers=MULTIPART, body=multipart(1001), says="1000"),
    "multipart without model": Case("POST", "/v1/audio/transcriptions", 400, "missing_model", headers=MULTIPART, body=multipart({"language": "en"})),
    # query parameters
    "API: no such day": Case("GET", "/api/metrics/activity", 400, "invalid_parameter", query=b"start=2026-02-30", param="start", says="2026-02-30"),
    "API: out of range": Case("GET", "/api/metrics/activity", 400, "invalid_parameter", query=b"end=0001-01-01T00:00:00%2B05:00", param="end"),
    "API: not a time": Case("GET", "/api/metrics/activity", 400, "invalid_parameter", query=b"start=soon", param="start"),
    "API: NUL in a filter": Case("GET", "/api/metrics/activity", 400, "invalid_parameter", query=b"model=a%00b", param="model"),
    "API: bad limit": Case("GET", "/api/metrics/activity", 400, "invalid_parameter", query=b"limit=0", param="limit"),
    "queue: bad limit": Case("GET", "/api/queue", 400, "invalid_limit", query=b"limit=x", param="limit"),
    "over 1000 query fields": Case("GET", "/api/queue", 400, "too_many_fields", query=b"&".join([b"a=1"] * 1001)),
    "over 1000 query fields (API)": Case("GET", "/api/metrics/activity", 400, "too_many_fields", query=b"&".join([b"a=1"] * 1001)),
    # 405: named code and Allow
    "GET on inference": Case("GET", "/v1/chat/completions", 405, "method_not_allowed", allow="POST"),
    "PUT on inference": Case("PUT", "/completion", 405, "method_not_allowed", allow="POST"),
    "POST on activity": Case("POST", "/api/metrics/activity", 405, "method_not_allowed", allow="GET, HEAD"),
    "DELETE on request API": Case("DELETE", "/api/requests/abc", 405, "method_not_allowed", allow="GET, HEAD"),
    **{
        f"POST on {p}": Case("POST", p, 405, "method_not_allowed", allow="GET, HEAD") for p in READ_ONLY
    },
    "PATCH on /metrics": Case("PATCH", "/metrics", 405, "method_not_allowed", allow="GET, HEAD"),
    "POST on /unload": Case("POST", "/unload", 405, "method_not_allowed", allow="GET"),
    "HEAD on /unload": Case("HEAD", "/unload", 405, "method_not_allowed", allow="GET"),
    "GET on /api/models/unload": Case("GET", "/api/models/unload", 405, "method_not_allowed", allow="POST"),
    "GET on /api/models/unload/m": Case("GET", "/api/models/unload/m", 405, "method_not_allowed", allow="POST"),
    # echoed values are cut
    "1 MB model name": Case("POST", "/v1/chat/completions", 404, "model_not_found", headers=JSON, body=json.dumps({"model": HUGE}).encode()),
    "1 MB model in /upstream": Case("GET", f"/upstream/{HUGE}/health", 404, "model_not_found"),
    "1 MB model to unload": Case("POST", f"/api/models/unload/{HUGE}", 404, "model_not_found"),
    "1 MB request id": Case("GET", f"/api/requests/{HUGE}", 404, "request_not_found"),
    "1 MB limit": Case("GET", "/api/queue", 400, "invalid_limit", query=b"limit=" + HUGE.encode()),
    "1 MB band": Case("GET", "/api/metrics/activity", 400, "invalid_parameter", query=b"band=" + HUGE.encode()),
    "1 MB unknown path": Case("GET", f"/v1/{HUGE}", 404, "not_found"),
    # Django's own 404 on API and proxy paths
    "unknown /v1 path": Case("GET", "/v1/nope", 404, "not_found", says="/v1/nope"),
    "unknown /api path": Case("POST", "/api/nope", 404, "not_found"),
    "bare /upstream/": Case("GET", "/upstream/", 404, "not_found"),
    "unload, an unknown id with /": Case("POST", "/api/models/unload/a/b", 404, "model_not_found"),
    "/metrics/ with a slash": Case("GET", "/metrics/", 404, "not_found"),
    "/v1/models/ with a slash": Case("GET", "/v1/models/", 404, "not_found"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_bad_requests_get_precise_json_errors(app, case):
    r = await app.call(case.method, case.path, case.query, case.headers, case.body)
    error = assert_json_error(r, case.status, case.code)
    if case.allow is not None:
        assert r.headers["allow"] == case.allow
    if case.param is not None:
        assert error.get("param") == case.param
    if case.says is not None:
        assert case.says in error["message"]
    assert len(r.body) < 1000, "an echoed value was not cut"
    assert await app.wait_idle()


async def test_json_nested_near_the_parsers_limit_is_never_a_500(app):
    """Parsed a few frames up the stack, dumped again a few frames down (the rewrite of a
    ``useModelName`` model): a depth at the edge could pass one and not the other."""
    for model in ("m", "renamed"):
        for n in range(960, 1010):
            body = b'{"model": "%s", "x": ' % model.encode() + b"[" * n + b"]" * n + b"}"
            r = await app.call("POST", "/v1/chat/completions", headers=JSON, body=body)
            if r.status != 200:
                assert_json_error(r, 400, "invalid_json")
    assert await app.wait_idle()


def charset_with_too_many_query_fields(headers, query: bytes) -> bool:
    """The case of :func:`test_a_charset_and_over_1000_query_fields_is_a_400` (the fuzz skips it)."""
    charset = any(k.lower() == b"content-type" and b"charset" in v.lower() for k, v in headers)
    return charset and query.count(b"&") >= 1000


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/metrics/activity"])
async def test_a_charset_and_over_1000_query_fields_is_a_400(app, path):
    method = "POST" if path.startswith("/v1/") else "GET"
    headers = [(b"content-type", b"application/json; charset=utf-8")]
    query = b"&".join([b"a=1"] * 1001)
    assert charset_with_too_many_query_fields(headers, query)
    r = await app.call(method, path, query, headers, b'{"model": "m"}')
    assert_json_error(r, 400, "too_many_fields")


async def test_echoed_values_are_cut_to_200_characters(app):
    r = await app.call("POST", "/v1/chat/completions", headers=JSON, body=json.dumps({"model": HUGE}).encode())
    message = assert_json_error(r, 404, "model_not_found")["message"]
    assert message == f"model {'x' * 200!r}… ({len(HUGE)} characters) not found"


async def test_read_only_endpoints_still_serve_get_and_head(app):
    for path in READ_ONLY:
        for method in ("GET", "HEAD"):
            r = await app.call(method, path)
            assert r.status == 200, (method, path, r.body[:200])
    # HEAD on the log stream: the headers, not a stream that never ends.
    r = await app.call("HEAD", "/logs/stream")
    assert r.status == 200 and not r.streamed and r.body == b""


async def test_the_documented_methods_still_work(app):
    ok = await app.call("POST", "/v1/chat/completions", headers=JSON, body=b'{"model": "m"}')
    assert ok.status == 200 and ok.body == UPSTREAM_BODY and len(ok.headers[REQUEST_ID]) == 32
    assert (await app.call("GET", "/unload")).body == b"OK"
    assert (await app.call("POST", "/api/models/unload")).json() == {"msg": "ok"}
    assert (await app.call("POST", "/api/models/unload/alias")).body == b"OK"  # llama-swap's
    assert (await app.call("GET", "/api/metrics/activity")).status == 200
    assert (await app.call("GET", "/upstream/m/health")).status == 200
    r = await app.call(
        "POST", "/v1/chat/completions", headers=[*JSON, (b"x-llamaswap-priority", b"\xff" * 5000)], body=b'{"model": "m"}'
    )
    assert r.status == 200  # a priority that is no number is 0, not an error
    assert await app.wait_idle()


# -- pages: HTML that says what was wrong, never a 500 -----------------------------------


@pytest.mark.parametrize(
    ("query", "says"),
    [
        (b"since=2026-02-30", "2026-02-30"),
        (b"until=2026-13-01T10:00", "2026-13-01T10:00"),
        (b"since=0001-01-01T00:00:00%2B05:00", "out of range"),
        (b"since=yesterday", "yesterday"),
        (b"model=a%00b", "NUL"),
    ],
)
async def test_history_filters_that_cannot_be_used_are_a_400_page(app, query, says):
    r = await app.call("GET", "/history/", query)
    assert r.status == 400
    assert r.headers["content-type"].startswith("text/html")
    assert says in r.body.decode()


async def test_pages_answer_html_errors(app):
    r = await app.call("GET", "/no/such/page/")
    assert r.status == 404 and r.headers["content-type"].startswith("text/html")
    r = await app.call("GET", f"/requests/{HUGE}/")
    assert r.status == 404 and r.headers["content-type"].startswith("text/html")
    assert len(r.body) < 20_000  # the id is cut
    r = await app.call("POST", "/history/")
    assert r.status == 405 and r.headers["allow"] == "GET, HEAD"
    assert r.headers["content-type"].startswith("text/html")


async def test_an_unexpected_exception_is_a_json_500_on_api_paths_and_a_page_elsewhere(app, monkeypatch):
    from dashboard import live

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(app.dispatcher, "running_models", broken)
    assert_json_error(await app.call("GET", "/running"), 500, "internal_error")
    monkeypatch.setattr(live, "current_snapshot", broken)
    r = await app.call("GET", "/")
    assert r.status == 500 and r.headers["content-type"].startswith("text/html")
    assert b"500" in r.body


def test_django_error_handlers_map_what_django_raises(rf):
    from django.core.exceptions import (
        PermissionDenied,
        RequestDataTooBig,
        SuspiciousOperation,
        TooManyFieldsSent,
    )
    from django.http.multipartparser import MultiPartParserError

    from web import errors

    api = rf.post("/v1/chat/completions")
    for exception, status, code in [
        (RequestDataTooBig("x"), 413, "request_too_large"),
        (TooManyFieldsSent("x"), 400, "too_many_fields"),
        (MultiPartParserError("Invalid boundary in multipart: " + HUGE), 400, "invalid_multipart"),
        (SuspiciousOperation("odd"), 400, "invalid_request"),
    ]:
        r = errors.bad_request(api, exception)
        body = json.loads(r.content)["error"]
        assert (r.status_code, body["code"]) == (status, code)
        assert len(body["message"]) < 300
    r = errors.permission_denied(api, PermissionDenied())
    assert (r.status_code, json.loads(r.content)["error"]["code"]) == (403, "forbidden")
    r = errors.csrf_failure(rf.post("/api/metrics/activity"), reason="CSRF cookie not set.")
    assert r.status_code == 403 and json.loads(r.content)["error"]["code"] == "csrf_failed"
    r = errors.csrf_failure(rf.post("/admin/login/"), reason="CSRF cookie not set.")
    assert r.status_code == 403 and r["Content-Type"].startswith("text/html")


def test_every_status_has_a_named_default_code():
    from web.errors import error_response

    for status in (400, 401, 403, 404, 405, 408, 409, 413, 415, 422, 429, 431, 500, 501, 502, 503, 504):
        code = json.loads(error_response(status, "m").content)["error"]["code"]
        assert code and not code.isdigit() and code.replace("_", "").isalpha(), (status, code)
    assert json.loads(error_response(405, "m").content)["error"]["code"] == "method_not_allowed"
    assert json.loads(error_response(500, "m").content)["error"]["code"] == "internal_error"


# -- a real server: malformed HTTP never reaches the app ----------------------------------

LAUNCH = textwrap.dedent(
    """
    import os, sys
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")
    import django
    django.setup()
    from llamaswap_site.http_server import install
    print("hooks:", ",".join(install()), flush=True)
    from django.core.management import call_command
    call_command("serve", *sys.argv[1:])
    """
)
"""``manage.py serve`` with ``http_server.install()`` first (serve calls it itself once wired;
install is idempotent)."""

HOOKS = {
    "_respondToBadRequestAndDisconnect",
    "lineLengthExceeded",
    "basic_error",
    "handle_reply",
    "_parsePOSTFormSubmission",
}

RAW_CASES = [
    (b"GARBAGE\r\n\r\n", 400, "malformed_request_line"),
    (b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n", 400, "malformed_request_line"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n", 400, "malformed_header"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n", 400, "malformed_header"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "invalid_content_length"),
    (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        400,
        "malformed_body",
    ),
    (b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431, "headers_too_large"),
    (
        b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(600)) + b"\r\n",
        431,
        "headers_too_large",
    ),
    # parsed by Twisted, refused by daphne: JSON on API paths
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-A: a\x0bb\r\nConnection: close\r\n\r\n", 400, "invalid_header_value"),
]


def raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def parse_raw(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = dict(line.split(": ", 1) for line in lines[1:])
    headers = {k.lower(): v for k, v in headers.items()}
    if headers.get("transfer-encoding") == "chunked":
        decoded = b""
        while True:
            size, _, rest = body.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            decoded, body = decoded + rest[:n], rest[n + 2 :]
        body = decoded
    return status, headers, body


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http-errors")
    port = free_port()
    config = tmp / "config.yaml"
    config.write_text(
        yaml.safe_dump({"models": {"m": {"cmd": "/bin/false", "proxy": "http://127.0.0.1:9"}}})
    )
    log = tmp / "server.log"
    env = {"DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, "--config", str(config), "--listen", f"127.0.0.1:{port}", "--grace", "1"],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {log.read_text()[-3000:]}")
            time.sleep(0.05)
        yield port, log
    finally:
        children = descendants(proc.pid)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_malformed_http_gets_a_json_error_from_the_real_server(real_server):
    """Fails when Twisted or daphne moves a hook: the seam in llamaswap_site/http_server.py."""
    port, log = real_server
    hooks = next(line for line in log.read_text().splitlines() if line.startswith("hooks:"))
    assert set(hooks.removeprefix("hooks:").strip().split(",")) == HOOKS
    for data, status, code in RAW_CASES:
        got, headers, body = parse_raw(raw_exchange(port, data))
        assert (got, headers.get("content-type")) == (status, "application/json"), (data[:60], got, body[:300])
        error = json.loads(body)["error"]
        assert error["code"] == code, (data[:60], error)
        assert len(headers["x-llamaswap-request-id"]) == 32
    # daphne's own page stays for dashboard pages...
    got, headers, _ = parse_raw(
        raw_exchange(port, b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x0bb\r\nConnection: close\r\n\r\n")
    )
    assert got == 400 and headers["content-type"].startswith("text/html")
    # ...and the server keeps serving.
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).text == "OK"
