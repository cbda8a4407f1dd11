"""A dashboard websocket flood against the real server (docs/dashboard.md, "Bounds").

``python -m bench.bench_ws_flood [MESSAGES] [SECONDS]``: ~25 requests waiting (snapshots of
~12 KB), one well-behaved dashboard reading, then one client sends MESSAGES (default
20,000) ``refresh`` messages at once from a small receive buffer and reads nothing more.
Prints, every half second for SECONDS (default 15), the server's CPU share, its RSS, the
latency of ``/health`` and the updates the good dashboard got. Uses the test suite's
helpers (tests/server.py, tests/wsclient.py). Not in ``make bench``: it measures a bound.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.server import chat, fake_model, free_port_block, serve
from tests.wsclient import TEXT, Closed, WebSocket


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(messages: int = 20_000, seconds: float = 15) -> str:
    port = free_port_block(1)
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve(
            Path(tmp),
            {"m": fake_model(port, load_seconds=60)},
            {"healthCheckTimeout": 120},
            grace=0.5,
        ) as server,
        ThreadPoolExecutor(26) as pool,
        httpx.Client(timeout=30) as http,
    ):
        pid = server.proc.pid

        def wait_in_line() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(server.url + "/v1/chat/completions", json=chat("m"), timeout=90)

        for _ in range(26):
            pool.submit(wait_in_line)
        server.wait_queue(25, timeout=30)
        good = WebSocket.connect(server.port)
        got = [0]
        stop = threading.Event()

        def read() -> None:
            while not stop.is_set():
                try:
                    good.recv(timeout=1)
                    got[0] += 1
                except TimeoutError:
                    continue
                except (Closed, OSError):
                    return

        threading.Thread(target=read, daemon=True).start()
        flooder = WebSocket.connect(server.port, rcvbuf=4096)
        rss0 = rss_mb(pid)
        frame = WebSocket.frame(TEXT, b'{"type":"refresh"}')
        with contextlib.suppress(OSError):
            flooder.sock.sendall(frame * messages)
        started = time.monotonic()
        cpu, at = cpu_seconds(pid), started
        health = []
        while time.monotonic() - started < seconds:
            t = time.monotonic()
            http.get(server.url + "/health")
            health.append((time.monotonic() - t) * 1000)
            time.sleep(0.5)
            now_cpu, now = cpu_seconds(pid), time.monotonic()
            print(
                f"t={now - started:5.1f}s cpu={(now_cpu - cpu) / (now - at):4.2f} "
                f"rss={rss_mb(pid)}MB health={health[-1]:.0f}ms good={got[0]}",
                flush=True,
            )
            cpu, at = now_cpu, now
        rss1 = rss_mb(pid)
        stop.set()
        server.stop()
        log = server.log_path.read_text()
    health.sort()
    report = (
        f"{messages:,} refresh messages from one client: server RSS {rss0} -> {rss1} MB, "
        f"/health p50 {health[len(health) // 2]:.0f} ms, max {health[-1]:.0f} ms, "
        f"the good dashboard got {got[0]} messages in {seconds:g} s; "
        f"flooder closed with 1008: {'websocket flood' in log}."
    )
    print(report)
    return report


if __name__ == "__main__":
    main(*(int(a) if i == 0 else float(a) for i, a in enumerate(sys.argv[1:3])))
