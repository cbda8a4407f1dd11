"""Chat latency through the real server while what-if replays run (docs/dashboard.md, "Bounds").

``python -m bench.bench_whatif_chat [REQUESTS]``: one fake model, a recorded history of
``HISTORY`` requests, then chat p50/p99 idle, ``REQUESTS`` (default 40) what-if requests
with new candidates from one client, and chat p50/p99 while the replays they started run.
Uses the test suite's server helpers (tests/server.py). Not in ``make bench``: it takes a
minute and measures a bound, not a speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.server import ROOT, chat, fake_model, free_port_block, serve

HISTORY = 20_000


def record_history(database_url: str, rows: int = HISTORY) -> None:
    code = (
        "import django; django.setup()\n"
        "from scheduler.core.policy import SchedulerSettings\n"
        "from scheduler.core.simulate import GENERATED_LOAD_SECONDS, generate_trace, simulate\n"
        "from tests.test_replay import record_run\n"
        f"trace = generate_trace({rows}, seed=1)\n"
        "record_run(simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS), trace,"
        " GENERATED_LOAD_SECONDS)\n"
    )
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": "llamaswap_site.settings",
    }
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=300)


def latency(http: httpx.Client, url: str, count: int = 150) -> tuple[float, float]:
    """Chat p50 and p99 in ms over ``count`` sequential requests."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        answer = http.post(url + "/v1/chat/completions", json=chat("m"))
        times.append(time.perf_counter() - started)
        answer.raise_for_status()
    times.sort()
    return times[count // 2] * 1000, times[int(count * 0.99) - 1] * 1000


def main(requests: int = 40) -> str:
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve(Path(tmp), {"m": fake_model(free_port_block(1))}, migrate=True) as server,
        httpx.Client(timeout=60) as http,
    ):
        record_history(server.database_url)
        latency(http, server.url, 30)  # warm up
        idle = latency(http, server.url)
        started = time.monotonic()
        codes = [
            http.get(
                server.url + "/whatif/",
                params={"since": "2026-01-01", "tz": "UTC", "c1": f"agingDivisor={601 + k}"},
            ).status_code
            for k in range(requests)
        ]
        answered = time.monotonic() - started
        busy = latency(http, server.url)
    accepted, refused = codes.count(200), codes.count(429)
    lines = [
        "| | chat p50 | chat p99 |",
        "| --- | --- | --- |",
        f"| idle | {idle[0]:.1f} ms | {idle[1]:.1f} ms |",
        f"| while the replays run | {busy[0]:.1f} ms | {busy[1]:.1f} ms |",
        "",
        f"{requests} what-if requests with new candidates over {HISTORY:,} recorded requests: "
        f"{accepted} accepted, {refused} answered 429, all in {answered:.1f} s.",
    ]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
