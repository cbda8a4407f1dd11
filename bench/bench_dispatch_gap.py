"""The gap between one job finishing and the next being forwarded, recording on and off.

In process: a real :class:`~scheduler.dispatcher.Dispatcher` (serial, default settings)
with :class:`~scheduler.testing.FakeModelProcess` models, one model loaded, 1,000 requests
waiting, each awaited by its own task as a view would. One step: the running request
finishes (``dispatcher.finish``) and the gap is the time until the next request's
``ticket.wait()`` returns in its task. Then a fresh request arrives to keep 1,000
waiting, and the loop yields so the dispatcher files it before the next finish.

"Recording on" adds the activity log's :class:`~activity.recorder.Recorder` writing to a
real SQLite database (a temporary file, WAL mode, migrated) plus the /metrics observer;
"off" has no observer. Both run in the same process, alternating in rounds so drift on
the machine hits both alike. GC stays on: allocation is part of what recording costs.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import tempfile
import time
from pathlib import Path

from bench import fmt_us, machine, markdown_table, quantile_us

WAITING = 1_000
ROUNDS = 6
STEPS = 3_000
"""Gaps measured per round and mode."""
TARGET_P99_WIDENING_US = 1_000.0


def _setup_django(db_path: Path) -> None:
    """A fresh SQLite file for the records (unless Django is already set up)."""
    import django
    from django.apps import apps

    if not apps.ready:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")
        os.environ["DATABASE_URL"] = f"sqlite:///{db_path}"
        django.setup()
    from django.core.management import call_command

    call_command("migrate", "activity", verbosity=0)


def _config():
    from scheduler.config import Config, ModelConfig

    model = ModelConfig(id="m", cmd=("true",), proxy="http://127.0.0.1:9")
    return Config(models={"m": model})


async def _run(record: bool, steps: int, seed: int) -> tuple[list[int], int]:
    """Gaps in ns, and how many records the recorder dropped."""
    from activity.metrics import MetricsObserver
    from activity.recorder import Recorder
    from scheduler.dispatcher import Dispatcher, Outcome
    from scheduler.testing import FakeProcessFactory

    config = _config()
    rng = random.Random(seed)
    recorder = Recorder(config.scheduler) if record else None
    observers = [MetricsObserver(config), recorder] if recorder is not None else []
    dispatcher = Dispatcher(config, process_factory=FakeProcessFactory(), observers=observers)
    await dispatcher.start()
    if recorder is not None:
        await recorder.start()
    model = config.models["m"]
    clock = time.perf_counter_ns
    gaps: list[int] = []
    state = {"t0": 0, "running": None}
    granted = asyncio.Event()
    count = 0

    async def view(ticket) -> None:
        await ticket.wait()
        now = clock()
        if state["t0"]:
            gaps.append(now - state["t0"])
        state["running"] = ticket
        granted.set()

    def arrive() -> asyncio.Task[None]:
        nonlocal count
        count += 1
        priority = rng.choices((100, 0, -100), weights=(2, 5, 3))[0] + rng.choice((0, 1, 2))
        ticket = dispatcher.submit(
            model, priority, f"{'r' if record else 'o'}{seed}-{count}", "/v1/x"
        )
        return asyncio.create_task(view(ticket))

    tasks = [arrive()]
    await granted.wait()  # the first request loads the model
    granted.clear()
    tasks += [arrive() for _ in range(WAITING)]
    for _ in range(3):
        await asyncio.sleep(0)
    for _ in range(steps):
        running = state["running"]
        state["t0"] = clock()
        dispatcher.finish(running, Outcome.COMPLETED, 200)
        await granted.wait()
        granted.clear()
        tasks.append(arrive())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    state["t0"] = 0
    await dispatcher.stop(grace=0)
    dropped = 0
    if recorder is not None:
        await recorder.stop(timeout=30)
        dropped = recorder.dropped
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return gaps, dropped


def measure(rounds: int = ROUNDS, steps: int = STEPS) -> tuple[dict[str, list[int]], int]:
    """Gap samples per mode, and the records dropped (expected: none)."""
    samples: dict[str, list[int]] = {"off": [], "on": []}
    dropped = 0
    for r in range(rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            gc.collect()
            gaps, lost = asyncio.run(_run(mode == "on", steps, seed=r))
            samples[mode] += gaps
            dropped += lost
    return samples, dropped


def main() -> str:
    print("== dispatch_gap: finish -> next forwarded, 1,000 waiting, recording on vs off ==")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        _setup_django(Path(tmp) / "bench.sqlite3")
        # Two INFO lines per request to the terminal would dominate both modes alike.
        logging.getLogger("llamaswap").setLevel(logging.WARNING)
        from activity.models import RequestRecord

        samples, dropped = measure()
        rows_saved = RequestRecord.objects.count()
    elapsed = time.perf_counter() - started
    rows = []
    stats = {}
    for mode, label in (("off", "recording off"), ("on", "recording on (SQLite, WAL)")):
        p50, p99 = quantile_us(samples[mode], 0.5), quantile_us(samples[mode], 0.99)
        p999 = quantile_us(samples[mode], 0.999)
        stats[mode] = (p50, p99)
        rows.append([label, fmt_us(p50), fmt_us(p99), fmt_us(p999), f"{len(samples[mode]):,}"])
        print(f"  {label}: p50 {fmt_us(p50)} µs, p99 {fmt_us(p99)} µs")
    widening = stats["on"][1] - stats["off"][1]
    verdict = (
        f"Target (recording widens the p99 gap by at most {TARGET_P99_WIDENING_US / 1000:g} ms): "
        f"{widening:+.0f} µs — {'met' if widening <= TARGET_P99_WIDENING_US else 'NOT met'}."
    )
    print(f"  {verdict}")
    lines = [
        "`.venv/bin/python -m bench dispatch_gap` (`make bench` runs all benches). "
        f"Machine: {machine()}. One run, {elapsed:.0f} s.",
        "",
        markdown_table(["", "gap p50 µs", "gap p99 µs", "gap p99.9 µs", "samples"], rows),
        "",
        f"In process: the real dispatcher (serial, default settings), a fake model already "
        f"loaded, {WAITING:,} requests waiting (priorities 100/0/-100 plus 0..2), each awaited "
        "by its own task. Gap = `dispatcher.finish()` of the running request to the next "
        "request's `ticket.wait()` returning. Recording on = the activity-log recorder "
        "(batches saved by a background task in Django's sync thread) and the /metrics "
        f"observer; {rows_saved:,} rows saved, {dropped} dropped. Modes alternate in {ROUNDS} rounds of "
        f"{STEPS:,} gaps; GC on; the dispatcher's per-request INFO log lines off in both.",
        "",
        verdict,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
