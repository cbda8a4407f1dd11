"""How soon a starting server is found healthy: ``python -m bench.health_latency [N] [LOAD_S]``.

Spawns the simulated model server (``python -m fakellm --load-seconds LOAD_S``: it listens at
once, answers ``/health`` 503 while it "loads", then 200, and writes ``fakellm: model
loaded`` the moment it turns healthy, as llama-server writes ``model loaded``) through a
real :class:`scheduler.process.ModelProcess`, ``N`` times one after another, and prints the
time from that line's arrival in the server's log to the process being READY (p50, max).
Outside ``make bench``; figures in BENCHMARKS.md ("Beside llama-swap: swaps").
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from bench import machine
from scheduler.config import ModelConfig
from scheduler.logbuffer import LogBuffer
from scheduler.process import ModelProcess
from scheduler.testing import free_port

FAKELLM = (sys.executable, "-m", "fakellm")


async def _one(load: float) -> float:
    logs = LogBuffer()
    port = free_port()
    argv = (*FAKELLM, "--port", str(port), "--load-seconds", str(load))
    config = ModelConfig(
        id="m", cmd=argv, proxy=f"http://127.0.0.1:{port}", check_endpoint="/health"
    )
    process = ModelProcess(config, logs)
    subscription = logs.subscribe("m")
    line_at: list[float] = []

    async def watch() -> None:
        async for line in subscription:
            if b"model loaded" in line:
                line_at.append(time.monotonic())
                return

    watcher = asyncio.create_task(watch())
    try:
        await process.start()
        ready_at = time.monotonic()
        async with asyncio.timeout(5):
            await watcher
    finally:
        watcher.cancel()
        await process.stop()
    return (ready_at - line_at[0]) * 1000


async def _main(n: int, load: float) -> str:
    times = sorted([await _one(load) for _ in range(n)])
    return (
        f"{machine()}; {n} starts of fakellm loading {load:g} s: its 'model loaded' line → "
        f"READY p50 {statistics.median(times):.1f} ms, max {times[-1]:.1f} ms"
    )


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
    load = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    print(asyncio.run(_main(n, load)))


if __name__ == "__main__":
    main()
