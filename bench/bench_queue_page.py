"""What the queue page (dashboard/queue.py) costs the event loop at 5,000 and 10,000
waiting: one page of the table (the first ranking, a ranking made afresh as every second, then
reused), a search over every waiting request, and a waiting request's status. A real dispatcher with fake model
processes: one request running, the rest waiting over 3 models and the three bands.

Run: ``.venv/bin/python -m bench.bench_queue_page``. Every figure is the median of 9 runs,
in milliseconds, on the event loop's thread (what a dispatch waits for at worst).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import statistics
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")
django.setup()

from dashboard import queue  # noqa: E402
from scheduler.config import parse_config  # noqa: E402
from scheduler.dispatcher import Dispatcher  # noqa: E402
from scheduler.testing import FakeProcessFactory  # noqa: E402

SIZES = (5_000, 10_000)
RUNS = 9


def _ms(fn) -> float:
    times = []
    for _ in range(RUNS):
        if fn.__name__ == "first_table":  # nothing known: every search text made
            queue._ranking = None
        elif fn.__name__ == "fresh_table" and queue._ranking is not None:  # expired
            queue._ranking = dataclasses.replace(queue._ranking, at=-1e9)
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def measure(size: int) -> dict[str, float]:
    config = parse_config(
        {
            "models": {
                m: {"cmd": "fake", "proxy": f"http://127.0.0.1:{9000 + i}"}
                for i, m in enumerate("abc")
            }
        }
    )
    d = Dispatcher(config, process_factory=FakeProcessFactory())
    await d.start()
    try:
        running = d.submit(config.models["a"], 0, "run", "/v1/chat/completions")
        await running.wait()
        bands = (10, 0, -100)
        for i in range(size):
            t = d.submit(
                config.models["abc"[i % 3]], bands[i % 3], f"req-{i:06d}", "/v1/chat/completions"
            )
            t.api_key = f"key-{i % 7}"
        while len(d.queue) < size:
            await asyncio.sleep(0.01)
        deep = f"req-{size - 1:06d}"

        def first_table() -> None:
            queue.table(d, [], "all", 1)

        def fresh_table() -> None:
            queue.table(d, [], "all", 1)

        def cached_table() -> None:
            queue.table(d, [], "all", 1)

        def search() -> None:
            queue.table(d, ["req-0042"], "all", 1)

        def deep_status() -> None:
            queue.status(d, deep)

        queue.table(d, [], "all", 1)
        return {
            "table, first ranking": _ms(first_table),
            "table, ranking afresh (once a second)": _ms(fresh_table),
            "table, ranking reused": _ms(cached_table),
            "search (one word)": _ms(search),
            "a request's status": _ms(deep_status),
        }
    finally:
        await d.stop(grace=0)


def main() -> None:
    results = {size: asyncio.run(measure(size)) for size in SIZES}
    names = list(next(iter(results.values())))
    print("| ms on the loop | " + " | ".join(f"{s:,} waiting" for s in SIZES) + " |")
    print("| --- |" + " ---: |" * len(SIZES))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{results[s][name]:.1f}" for s in SIZES) + " |")


if __name__ == "__main__":
    main()
