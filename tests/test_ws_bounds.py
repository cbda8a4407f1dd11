"""The dashboard websocket under hostile clients, through the real server (daphne, autobahn,
Twisted): a flood of ``refresh`` messages is closed with 1008 before it is queued, refreshes
are merged, a client that does not read is dropped with bounded memory, and a well-behaved
dashboard keeps getting its updates meanwhile. The soak test mixes every kind at once.

The queue holds 25 waiting requests (a model that loads for a minute) so that each
snapshot is ~10 KB, as on a busy box.
"""

from __future__ import annotations

import contextlib
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server import Server, chat, fake_model, free_port_block, serve
from tests.wsclient import TEXT, Closed, WebSocket

pytestmark = pytest.mark.timeout(90)

WAITING = 25
STALL_SECONDS = 1.5
REFRESH = WebSocket.frame(TEXT, b'{"type":"refresh"}')


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def health_times(url: str, count: int = 8) -> list[float]:
    times = []
    with httpx.Client(timeout=5) as client:
        for _ in range(count):
            started = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            times.append(time.monotonic() - started)
    return times


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    port = free_port_block(1)
    environ = {
        "DASHBOARD_WS_STALL_SECONDS": str(STALL_SECONDS),
        "DASHBOARD_WS_SEND_BACKLOG_BYTES": "16384",
    }
    with serve(
        tmp_path_factory.mktemp("wsbounds"),
        {"m": fake_model(port, load_seconds=60)},
        {"healthCheckTimeout": 120},
        environ=environ,
        grace=0.5,
    ) as srv:
        pool = ThreadPoolExecutor(WAITING + 1)

        def wait_in_line() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(srv.url + "/v1/chat/completions", json=chat("m"), timeout=90)

        for _ in range(WAITING + 1):
            pool.submit(wait_in_line)
        srv.wait_queue(WAITING, timeout=20)
        try:
            yield srv
        finally:
            srv.stop()  # the waiting requests end with the server
            pool.shutdown(wait=True, cancel_futures=True)


class Dashboard:
    """A well-behaved dashboard: reads every message in a thread, answers pings."""

    def __init__(self, port: int) -> None:
        self.ws = WebSocket.connect(port)
        self.times: list[float] = []
        self.closed: int | None | bool = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.ws.recv(timeout=0.5)
                self.times.append(time.monotonic())
            except TimeoutError:
                continue
            except (Closed, OSError) as exc:
                self.closed = getattr(exc, "code", None)
                return

    def wait_updates(self, count: int, timeout: float = 6) -> None:
        start = len(self.times)
        deadline = time.monotonic() + timeout
        while len(self.times) < start + count:
            assert self.closed is False, f"the good dashboard was closed: {self.closed}"
            assert time.monotonic() < deadline, f"{len(self.times) - start} updates in {timeout}s"
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.ws.close()


def read_until_closed(ws: WebSocket, timeout: float) -> tuple[int | None, int]:
    """Read (answering pings) until the server closes; its close code and the messages
    that came first. Fails if the socket is still open after ``timeout``."""
    deadline = time.monotonic() + timeout
    received = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"still open after {timeout}s ({received} messages)")
        try:
            ws.recv(timeout=left)
            received += 1
        except Closed as closed:
            return closed.code, received
        except ConnectionResetError:
            return None, received


def test_a_refresh_flood_is_closed_with_1008_and_the_dashboard_keeps_updating(server):
    good = Dashboard(server.port)
    flooder = WebSocket.connect(server.port)
    try:
        flooder.recv_json()  # its snapshot on connect
        good.wait_updates(1)
        before = rss_mb(server.proc.pid)
        with contextlib.suppress(OSError):  # the server may hang up mid-send
            flooder.sock.sendall(REFRESH * 5000)
        code, snapshots = read_until_closed(flooder, timeout=10)
        assert code == 1008
        assert snapshots <= 5, "the messages before the cut were merged"
        good.wait_updates(2)  # updates every second, as before the flood
        times = health_times(server.url)
        assert statistics.median(times) < 1.0, times
        assert rss_mb(server.proc.pid) - before < 30
        log = server.log_path.read_text()
        assert "websocket flood" in log
        assert "Traceback" not in log
    finally:
        good.close()
        flooder.close()


def test_refreshes_are_merged(server):
    ws = WebSocket.connect(server.port)
    try:
        assert ws.recv_json()["type"] == "snapshot"
        time.sleep(0.15)  # past the snapshot on connect: the next refresh is answered at once
        ws.sock.sendall(REFRESH * 30)  # within the budget (a burst of 50)
        snapshots = 0
        deadline = time.monotonic() + 1.0
        while (left := deadline - time.monotonic()) > 0:
            try:
                if ws.recv_json(timeout=left)["type"] == "snapshot":
                    snapshots += 1
            except TimeoutError:
                break
        assert 1 <= snapshots <= 3, f"{snapshots} full snapshots for 30 refreshes"
    finally:
        ws.close()


def test_a_client_that_does_not_read_is_dropped(server):
    good = Dashboard(server.port)
    reader = WebSocket.connect(server.port, rcvbuf=4096)
    try:
        reader.recv_json()
        before = rss_mb(server.proc.pid)
        started = time.monotonic()
        dropped = False
        # Ask for ~8 snapshots a second (within the budget) and read none of them.
        while time.monotonic() - started < STALL_SECONDS + 8:
            try:
                reader.sock.sendall(REFRESH)
            except OSError:
                dropped = True
                break
            time.sleep(0.12)
        assert dropped, "a client that reads nothing is still connected"
        assert "websocket client not reading" in server.log_path.read_text()
        assert rss_mb(server.proc.pid) - before < 20
        good.wait_updates(2)
    finally:
        good.close()
        reader.sock.close()


def _hostile(port: int, kind: str, seconds: float) -> str:
    """One hostile client; returns how it ended."""
    try:
        ws = WebSocket.connect(port, rcvbuf=4096 if kind == "silent" else None)
    except OSError as exc:
        return f"refused: {exc}"
    try:
        if kind == "flood":
            with contextlib.suppress(OSError):
                ws.sock.sendall(REFRESH * 3000)
            return f"closed {read_until_closed(ws, seconds + 5)[0]}"
        if kind == "big":
            with contextlib.suppress(OSError):
                ws.send_text("x" * 200_000)
            return f"closed {read_until_closed(ws, seconds + 5)[0]}"
        if kind == "garbage":
            with contextlib.suppress(OSError):
                ws.sock.sendall(WebSocket.frame(TEXT, b"{not json"))
            return f"closed {read_until_closed(ws, seconds + 5)[0]}"
        if kind == "binary":
            with contextlib.suppress(OSError):
                ws.sock.sendall(WebSocket.frame(0x2, struct.pack("!Q", 7) * 8))
            return f"closed {read_until_closed(ws, seconds + 5)[0]}"
        # silent: asks and never reads, until it is dropped
        deadline = time.monotonic() + seconds + STALL_SECONDS + 6
        while time.monotonic() < deadline:
            try:
                ws.sock.sendall(REFRESH)
            except OSError:
                return "dropped"
            time.sleep(0.12)
        return "still open"
    finally:
        ws.sock.close()


def test_soak_hostile_websockets_leave_the_server_bounded(server):
    """Thirty hostile clients of five kinds in waves over a few seconds, against one good
    dashboard: each is cut with its code, the good one keeps its updates, /health stays
    quick and the server's memory flat."""
    good = Dashboard(server.port)
    try:
        good.wait_updates(1)
        before = rss_mb(server.proc.pid)
        kinds = ["flood", "big", "garbage", "binary", "silent"] * 6
        with ThreadPoolExecutor(len(kinds)) as pool:
            futures = []
            for i, kind in enumerate(kinds):
                futures.append(pool.submit(_hostile, server.port, kind, 2.0))
                if i % 5 == 4:
                    time.sleep(0.3)  # waves
            during = health_times(server.url, 6)
            good.wait_updates(2)
            ends = [f.result(timeout=30) for f in futures]
        by_kind: dict[str, set[str]] = {}
        for kind, end in zip(kinds, ends, strict=True):
            by_kind.setdefault(kind, set()).add(end)
        # Every flooder is cut. Most read the 1008 close frame; one whose unread flood is
        # still in the server's receive buffer when the server closes gets a TCP reset
        # that can overtake the frame ("closed None"): cut all the same.
        assert by_kind["flood"] <= {"closed 1008", "closed None"}, by_kind
        assert kinds.count("flood") > 1 and "closed 1008" in by_kind["flood"], by_kind
        assert by_kind["garbage"] == {"closed 4400"} and by_kind["binary"] == {"closed 4400"}
        assert by_kind["big"] <= {"closed 1009", "closed None"}, by_kind  # autobahn drops it
        assert by_kind["silent"] == {"dropped"}, by_kind
        assert max(during) < 2.0, during
        assert rss_mb(server.proc.pid) - before < 40
        good.wait_updates(2)
        assert good.closed is False
        assert "Traceback" not in server.log_path.read_text()
    finally:
        good.close()
