"""Slow, stalled and oversized clients against the real server (daphne and Twisted read
the whole request before the application sees it, so this is where the limits live)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.server import chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(60)

LIMITS = {"headerTimeout": 0.5, "bodyTimeout": 1.5, "bodyIdleTimeout": 0.8, "maxBodyBytes": 10_000}


def answer(sock: socket.socket, timeout: float = 5.0) -> tuple[float, bytes]:
    """Read until the server closes; return how long that took and what it sent."""
    sock.settimeout(timeout)
    started = time.monotonic()
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return time.monotonic() - started, data


def error_of(data: bytes) -> tuple[int, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port_block(1)
    with serve(tmp_path_factory.mktemp("limits"), {"m": fake_model(port)}, {"limits": LIMITS}) as s:
        yield s


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port))


def test_headers_that_stall_are_cut_with_a_408(server):
    with connect(server) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        took, data = answer(sock)
    status, error = error_of(data)
    assert status == 408 and error["code"] == "request_timeout"
    assert "headerTimeout" in error["message"]
    assert took < 3


def test_headers_trickled_byte_by_byte_are_cut_at_the_deadline(server):
    # Each byte resets an idle timer; only a deadline stops a slowloris.
    with connect(server) as sock:
        started = time.monotonic()
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        cut = False
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                cut = True
                break
            time.sleep(0.05)
            if time.monotonic() - started > 3:
                break
        if not cut:
            _, data = answer(sock)
            assert error_of(data)[0] == 408
    assert time.monotonic() - started < 3


def test_a_body_that_stops_arriving_is_cut(server):
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n" + b"{" * 10
        )
        took, data = answer(sock)
    status, error = error_of(data)
    assert status == 408 and error["code"] == "request_timeout"
    assert "bodyIdleTimeout" in error["message"]
    assert took < 3


def test_a_body_trickled_byte_by_byte_is_cut_at_its_deadline(server):
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n"
        )
        started = time.monotonic()
        sock.setblocking(False)
        data = b""
        while time.monotonic() - started < 4:
            try:
                chunk = sock.recv(65536)
            except BlockingIOError:
                chunk = None
            except OSError:
                break
            if chunk == b"":
                break
            if chunk:
                data += chunk
                continue
            try:
                sock.send(b" ")  # one byte every 50 ms: never idle for bodyIdleTimeout
            except OSError:
                # The server answered and closed (a reset, as bytes it never read were
                # still arriving): its answer is in our buffer all the same.
                sock.setblocking(True)
                data += answer(sock, 1.0)[1]
                break
            time.sleep(0.05)
        took = time.monotonic() - started
    status, error = error_of(data)
    assert status == 408 and "bodyTimeout" in error["message"]
    assert 1.4 < took < 3


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000000\r\n\r\n"
        )
        took, data = answer(sock)
    status, error = error_of(data)
    assert status == 413 and error["code"] == "request_too_large"
    assert "maxBodyBytes" in error["message"]


def test_the_server_goes_on_serving_and_says_why_it_cut(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("m"), timeout=10)
    assert r.status_code == 200
    assert server.queue()["depth"] == 0 and not server.queue()["running"]
    assert "slow client cut off" in server.log_path.read_text()
