"""Hostile requests against the real server: what one request or one connection can make
the server spend (time on the event loop, memory, bytes on a keep-alive connection).

* ``upstream.ignorePaths`` matches in time linear in the path (RE2), whatever the path.
* A JSON body's values are counted before it is parsed (``limits.maxJsonValues``).
* HEAD sends no body bytes, however large the response (response splitting).
* A client that takes none of its response is cut off (``limits.sendIdleTimeout``), and
  the server holds little for it meanwhile (the response waits: backpressure).

Each class also has a bounded fuzz or soak test here. ``/health`` is the probe of the
event loop: while the hostile traffic runs it must keep answering within a small bound.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server import Server, chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(120)

SEND_IDLE = 1.0
MAX_JSON_VALUES = 200_000
HEALTH_BOUND = 1.0
"""Seconds /health may take while hostile requests run (it took 12 s before)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    port = free_port_block(1)
    tmp = tmp_path_factory.mktemp("hostile")
    limits = {"limits": {"sendIdleTimeout": SEND_IDLE, "maxJsonValues": MAX_JSON_VALUES}}
    with serve(tmp, {"m": fake_model(port)}, limits, migrate=True) as s:
        yield s


def rss_peak_mb(server: Server) -> float:
    """The server process's peak resident memory so far (VmHWM), in MB."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def reset_peak(server: Server) -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs), where allowed."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{server.proc.pid}/clear_refs").write_text("5")


class HealthProbe:
    """GET /health in a loop on its own thread while a block runs: the slowest answer."""

    def __init__(self, server: Server) -> None:
        self.url = server.url + "/health"
        self.slowest = 0.0
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set() and self.count < 10_000:
                started = time.monotonic()
                assert client.get(self.url).status_code == 200
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.count += 1
                self._stop.wait(0.02)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def raw_request(server: Server, request: bytes, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect: the window the server may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(request)
    return sock


def read_response(sock: socket.socket, buffered: bytes, head_only: bool) -> tuple[int, dict, bytes, bytes]:
    """One HTTP/1.1 response from ``sock`` (Content-Length or chunked framing): its
    status, headers, body, and whatever followed it."""
    data = buffered
    deadline = time.monotonic() + 10
    while b"\r\n\r\n" not in data:
        assert time.monotonic() < deadline, data[:200]
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if head_only:
        return status, headers, b"", rest
    if "content-length" in headers:
        length = int(headers["content-length"])
        while len(rest) < length:
            assert time.monotonic() < deadline
            rest += sock.recv(65536)
        return status, headers, rest[:length], rest[length:]
    assert headers.get("transfer-encoding") == "chunked", headers
    body = b""
    while True:
        while b"\r\n" not in rest:
            rest += sock.recv(65536)
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        while len(rest) < size + 2:
            assert time.monotonic() < deadline
            rest += sock.recv(65536)
        body += rest[:size]
        rest = rest[size + 2 :]
        if size == 0:
            return status, headers, body, rest


def wait_log(server: Server, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in server.log_path.read_text(errors="replace"):
            return True
        time.sleep(0.05)
    return False


def nothing_running(server: Server, timeout: float = 10) -> dict:
    return server.wait_for("no request running", lambda q: not q["running"] and not q["waiting"], timeout)


# -- upstream.ignorePaths: linear matching ---------------------------------------------------


def test_ignore_paths_match_in_linear_time_and_health_stays_responsive(server: Server) -> None:
    # 16,000 dots and an extension the default pattern does not list (upstream.allowPaths
    # does): Python's backtracking re took ~2-6 s per request on llama-swap's default
    # pattern (quadratic), with the event loop blocked meanwhile.
    path = "/upstream/m/a" + "." * 16_000 + "html"
    times: list[float] = []
    statuses: list[int] = []

    def one() -> None:
        started = time.monotonic()
        response = httpx.get(server.url + path, timeout=60)
        times.append(time.monotonic() - started)
        statuses.append(response.status_code)

    with HealthProbe(server) as probe:
        threads = [threading.Thread(target=one) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=90)
    assert len(times) == 4 and all(s < 500 for s in statuses), statuses
    assert max(times) < 5, times  # includes the model's start on the first one
    assert probe.count > 0 and probe.slowest < HEALTH_BOUND, probe.slowest


def test_ignore_paths_still_refuse_a_matching_path_for_an_unloaded_model(server: Server) -> None:
    httpx.post(server.url + "/api/models/unload", timeout=30)
    response = httpx.get(server.url + "/upstream/m/a" + "." * 10_000 + "js", timeout=10)
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "model_not_loaded"


# -- JSON bodies: values counted before parsing ---------------------------------------------


def test_json_body_of_many_empty_objects_is_refused_before_parsing(server: Server) -> None:
    # 30 MB of {}: parsed, it cost +750 MB and 0.9 s of blocked event loop.
    body = b'{"model": "m", "messages": [], "x": [' + b"{}," * 10_000_000 + b"{}]}"
    reset_peak(server)
    before = rss_peak_mb(server)
    with HealthProbe(server) as probe:
        response = httpx.post(
            server.url + "/v1/chat/completions",
            content=body,
            headers={"Content-Type": "application/json"},
            timeout=60,
        )
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "request_too_large"
    assert "limits.maxJsonValues" in error["message"]
    grew = rss_peak_mb(server) - before
    assert grew < 250, f"peak RSS grew {grew:.0f} MB for a 30 MB body"
    assert probe.slowest < HEALTH_BOUND, probe.slowest


def test_json_body_with_one_huge_string_still_works(server: Server) -> None:
    # A base64 image: one value, 20 MB.
    image = base64.b64encode(os.urandom(15_000_000)).decode()
    body = chat("m", image)
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text[:300]


def test_json_values_just_under_the_limit_are_parsed(server: Server) -> None:
    under = chat("m", x=[0] * (MAX_JSON_VALUES - 100))
    over = chat("m", x=[0] * (MAX_JSON_VALUES + 100))
    url = server.url + "/v1/chat/completions"
    assert httpx.post(url, json=under, timeout=30).status_code == 200
    response = httpx.post(url, json=over, timeout=30)
    assert response.status_code == 413
    message = response.json()["error"]["message"]
    assert f"over the limit of {MAX_JSON_VALUES} (limits.maxJsonValues)" in message


def hostile_bodies(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """Pathological JSON shapes and sizes, valid and not."""
    yield "empty objects", b'{"model":"m","x":[' + b"{}," * 2_000_000 + b"{}]}"
    yield "empty arrays", b'{"model":"m","x":[' + b"[]," * 2_000_000 + b"[]]}"
    yield "short strings", b'{"model":"m","x":[' + b'"ab",' * 1_500_000 + b'"ab"]}'
    yield "many keys", b'{"model":"m",' + b",".join(b'"k%d":0' % i for i in range(600_000)) + b"}"
    yield "duplicate keys", b'{"model":"m",' + b'"k":{},' * 800_000 + b'"z":1}'
    yield "deep arrays", b'{"model":"m","x":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    yield "deep objects", b'{"model":"m","x":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}"
    yield "deep but legal", b'{"model":"m","x":' + b"[" * 500 + b"]" * 500 + b"}"
    yield "huge number", b'{"model":"m","x":' + b"9" * 100_000 + b"}"
    yield "huge float", b'{"model":"m","x":1.' + b"5" * 1_000_000 + b"e5}"
    yield "escapes", b'{"model":"m","x":"' + b"\\ud83d\\ude00" * 200_000 + b'"}'
    yield "lone surrogates", b'{"model":"m","x":"' + b"\\udc00" * 100_000 + b'"}'
    yield "non-ascii", ('{"model":"m","x":"' + "é" * 10 + "\U0001f600" * 1_000_000 + '"}').encode()
    yield "invalid utf-8", b'{"model":"m","x":"\xff\xfe' + b"a" * 1000 + b'"}'
    yield "truncated", b'{"model":"m","x":[' + b"{}," * 100_000
    yield "top-level array", b"[" + b"1," * 100_000 + b"1]"
    yield "not json", b"\x00" * 100_000
    yield "nan", b'{"model":"m","x":[NaN,Infinity,-Infinity]}'
    yield "model not a string", b'{"model":{"a":[1,2,3]}}'
    for i in range(6):
        size = rng.choice((10, 1000, 100_000, 1_000_000))
        alphabet = b'{}[],:"0123456789.eE-+ tfnrul\\'
        yield f"random {i}", bytes(rng.choice(alphabet) for _ in range(min(size, 20_000))) * max(
            1, size // 20_000
        )


def test_fuzz_hostile_json_bodies_never_5xx_nor_stall_health(server: Server) -> None:
    rng = random.Random(19)
    reset_peak(server)
    before = rss_peak_mb(server)
    results: dict[str, int] = {}
    started = time.monotonic()
    with HealthProbe(server) as probe, httpx.Client(timeout=30) as client:
        for label, body in hostile_bodies(rng):
            response = client.post(
                server.url + "/v1/chat/completions",
                content=body,
                headers={"Content-Type": "application/json"},
            )
            results[label] = response.status_code
            assert response.status_code < 500, (label, response.text[:300])
            if response.status_code >= 400:
                assert "error" in response.json(), label
    assert time.monotonic() - started < 60
    assert probe.slowest < HEALTH_BOUND, (probe.slowest, results)
    grew = rss_peak_mb(server) - before
    assert grew < 400, f"peak RSS grew {grew:.0f} MB"
    assert results["empty objects"] == 413 and results["deep but legal"] == 200, results


# -- HEAD: no body bytes on the connection ----------------------------------------------------


def test_head_of_a_large_response_sends_no_body_and_keep_alive_stays_in_sync(
    server: Server,
) -> None:
    size = len(httpx.get(server.url + "/metrics", timeout=10).content)
    assert size > 65_536  # over one of Django's 64 KB body messages
    request = (
        b"HEAD /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    )
    with raw_request(server, request) as sock:
        sock.settimeout(10)
        status, headers, _, rest = read_response(sock, b"", head_only=True)
        assert status == 200 and "transfer-encoding" not in headers
        status, _, body, rest = read_response(sock, rest, head_only=False)
        assert (status, body, rest) == (200, b"OK", b"")


@pytest.mark.parametrize("path", ["/metrics", "/admin/login/?next=" + "x" * 8000])
def test_head_never_sends_body_bytes(server: Server, path: str) -> None:
    # A page (PagesHandler) as well as a proxy path; then the connection must be idle.
    with raw_request(server, f"HEAD {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()) as sock:
        sock.settimeout(10)
        _, _, _, rest = read_response(sock, b"", head_only=True)
        sock.settimeout(0.3)
        with contextlib.suppress(TimeoutError):
            rest += sock.recv(65536)
        assert rest == b""


# -- clients that do not read -------------------------------------------------------------------


def stalled_stream(server: Server, tokens: int = 400_000) -> socket.socket:
    """A streaming chat completion (~80 MB of SSE) whose client never reads."""
    body = json.dumps(chat("m", stream=True, fake_tokens=tokens)).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    ) + body
    return raw_request(server, request, rcvbuf=4096)


def test_client_that_never_reads_a_stream_is_cut_off_and_its_turn_ends(server: Server) -> None:
    marker = server.log_path.read_text(errors="replace").count("limits.sendIdleTimeout")
    reset_peak(server)
    before = rss_peak_mb(server)
    with stalled_stream(server) as sock:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = server.log_path.read_text(errors="replace")
            if text.count("limits.sendIdleTimeout") > marker:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the non-reading client was not cut off")
        grew = rss_peak_mb(server) - before
        # Connection reset by the server (abort): reading now fails or ends.
        sock.settimeout(5)
        with contextlib.suppress(OSError):
            while sock.recv(1 << 20):
                pass
    assert grew < 40, f"peak RSS grew {grew:.0f} MB for one non-reading client"
    assert "slow client cut off: took no response data" in server.log()
    nothing_running(server)
    response = httpx.post(server.url + "/v1/chat/completions", json=chat("m"), timeout=30)
    assert response.status_code == 200


def test_soak_non_reading_clients_are_all_cut_off(server: Server) -> None:
    """Several non-reading clients at once (streams, /metrics pipelined, /logs/stream):
    all cut, memory bounded, /health answered throughout, the GPU free afterwards."""
    marker = server.log_path.read_text(errors="replace").count("limits.sendIdleTimeout")
    reset_peak(server)
    before = rss_peak_mb(server)
    pipelined = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 400  # ~27 MB of answers
    with HealthProbe(server) as probe, contextlib.ExitStack() as stack:
        socks = [stack.enter_context(stalled_stream(server, 200_000)) for _ in range(2)]
        socks += [stack.enter_context(raw_request(server, pipelined, rcvbuf=4096)) for _ in range(3)]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            text = server.log_path.read_text(errors="replace")
            if text.count("limits.sendIdleTimeout") >= marker + len(socks):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"not all {len(socks)} non-reading clients were cut off")
    grew = rss_peak_mb(server) - before
    assert grew < 100, f"peak RSS grew {grew:.0f} MB"
    assert probe.slowest < HEALTH_BOUND, probe.slowest
    nothing_running(server)


# -- pathological paths and queries --------------------------------------------------------------


def hostile_paths(rng: random.Random) -> Iterator[str]:
    yield "/upstream/m/" + "." * 16_200
    yield "/upstream/m/" + "a." * 8_000
    yield "/upstream/m/" + "%2e" * 5_000
    yield "/upstream/m/" + "/" * 16_000
    yield "/upstream/" + "m" * 16_000
    yield "/v1/" + "/." * 8_000
    yield "/api/metrics/activity?" + "&".join(f"model=m{i}" for i in range(2_000))
    yield "/api/metrics/activity?model=" + "x" * 16_000
    yield "/api/metrics/activity?limit=" + "9" * 5_000
    yield "/logs?" + "a=" * 5_000
    yield "/dashboard/" + "%" * 5_000
    yield "/" + "../" * 5_000
    for _ in range(10):
        alphabet = "./%2e%2f?&=#;:@abc"
        yield "/upstream/m/" + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 16_000)))


def test_fuzz_pathological_paths_answer_fast_and_never_5xx(server: Server) -> None:
    rng = random.Random(7)
    slowest = 0.0
    with HealthProbe(server) as probe, httpx.Client(timeout=30) as client:
        for path in hostile_paths(rng):
            started = time.monotonic()
            try:
                response = client.get(server.url + path)
            except httpx.RemoteProtocolError:
                continue  # a line over Twisted's limit: answered 414 and closed
            took = time.monotonic() - started
            slowest = max(slowest, took)
            assert response.status_code < 500, (path[:80], response.status_code, response.text[:200])
    assert slowest < 3, slowest
    assert probe.slowest < HEALTH_BOUND, probe.slowest
