"""llama-swap's log endpoints through the real server: ``/logs`` (the proxy's lines and the
models' output together), ``/logs/stream/proxy`` (llamaswap's own stamped lines),
``/logs/stream/upstream`` (every model's output) and ``/logs/stream/{model}`` (one model's,
ids with ``/`` included); a model that cannot start leaves a line naming it and why."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from scheduler.logbuffer import LogBuffer
from tests.server import chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(60)

STAMP = re.compile(rb"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \[(debug|info|warn|error)\] ")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp: Path = tmp_path_factory.mktemp("logs")
    port = free_port_block(2)
    models = {
        "alpha": fake_model(port),
        "org/beta": fake_model(port + 1),
        "broken": {"cmd": "/nonexistent/llama-server --port 9", "proxy": "http://127.0.0.1:9"},
    }
    with serve(tmp, models) as srv:
        assert httpx.post(
            srv.url + "/v1/chat/completions", json=chat("alpha"), timeout=20
        ).is_success
        yield srv


def _first_chunk(url: str, needle: bytes, timeout: float = 10) -> bytes:
    """Read the stream until ``needle`` shows up (history first, then live)."""
    seen = b""
    with httpx.stream("GET", url, timeout=timeout) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        for chunk in r.iter_bytes():
            seen += chunk
            if needle in seen:
                return seen
    raise AssertionError(f"{needle!r} never came: {seen[-500:]!r}")


def test_proxy_stream_has_stamped_scheduler_lines_history_then_live(server):
    history = _first_chunk(server.url + "/logs/stream/proxy", b"model ready")
    line = next(x for x in history.splitlines() if b"model ready" in x)
    assert STAMP.match(line), line
    assert b"model=alpha" in line and b"[alpha]" not in history  # the proxy's own, unprefixed
    with httpx.stream("GET", server.url + "/logs/stream/proxy?no-history", timeout=10) as r:
        httpx.post(server.url + "/api/models/unload", timeout=20)
        live = b""
        for chunk in r.iter_bytes():
            live += chunk
            if b"model=alpha" in live:
                break
    assert b"model ready" not in live  # no history: only what happened since


def test_upstream_and_per_model_streams(server):
    upstream = _first_chunk(server.url + "/logs/stream/upstream", b"[alpha] ")
    assert b"[alpha] fakellm" in upstream
    assert b"[info]" not in upstream  # model output only
    with httpx.stream("GET", server.url + "/logs/stream/org/beta", timeout=10) as r:
        assert r.status_code == 200
        r2 = httpx.post(server.url + "/v1/chat/completions", json=chat("org/beta"), timeout=20)
        assert r2.is_success
        seen = b""
        for chunk in r.iter_bytes():
            seen += chunk
            if b"listening" in seen:
                break
    assert b"fakellm" in seen and b"[org/beta]" not in seen  # as the model printed it
    missing = httpx.get(server.url + "/logs/stream/nope", timeout=5)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert httpx.head(server.url + "/logs/stream/proxy", timeout=5).status_code == 200


def test_a_failed_start_names_the_model_and_cause_in_logs_and_record(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("broken"), timeout=20)
    assert r.status_code == 503
    assert "/nonexistent/llama-server" in r.json()["error"]["message"]
    text = httpx.get(server.url + "/logs", timeout=5).text
    failed = [x for x in text.splitlines() if "model failed to start" in x]
    assert failed and "model=broken" in failed[-1] and "/nonexistent/llama-server" in failed[-1]
    assert "[alpha] fakellm" in text  # the models' output too: the combined log
    # The next request within startFailureCooldown fails at once with the same cause.
    again = httpx.post(server.url + "/v1/chat/completions", json=chat("broken"), timeout=5)
    assert again.status_code == 503
    assert "/nonexistent/llama-server" in again.json()["error"]["message"]


def test_since_reads_only_what_is_new_and_stays_bounded():
    buffer = LogBuffer(max_bytes=200, clock=lambda: 5.0)
    for i in range(40):
        buffer.write("m", f"line {i}".encode())
    entries = buffer.since(0)
    assert sum(len(e[3]) + 4 for e in entries) <= 200  # bounded by bytes
    last = entries[-1][0]
    buffer.write("m", b"new")
    assert [e[3] for e in buffer.since(last)] == [b"new\n"]
    assert len(buffer.since(0, limit=3)) == 3 and buffer.since(0, limit=3)[-1][3] == b"new\n"
    assert entries[0][1] == 5.0
