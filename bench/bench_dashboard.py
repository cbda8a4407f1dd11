"""What the dashboard costs the event loop at 5,000 waiting, against the code before the
control room (issue 21).

A real :class:`~scheduler.dispatcher.Dispatcher` with fake model processes (one request
running, 5,000 waiting over 3 models and the three bands), installed as the running
server's runtime, and a :class:`~dashboard.live.LiveObserver` watching it. Timed on the
event loop's thread (what a dispatch waits for at worst), each figure the median of
:data:`RUNS` calls:

* the live update the websocket sends (``LiveObserver.snapshot(full=False)``, built and
  JSON-encoded as ``send_json`` does), and the full snapshot a dashboard gets on connect;
* the models feed (``/models/feed/``: ``dashboard.models_page.model_rows``);
* the queue page's first page (``dashboard.queue.table``) with its ranking made afresh
  (as at most once a second, the search texts kept) and reused, and a waiting request's
  status (``dashboard.queue.status``, the request page's poll; the ranking reused) for
  the last request in line.

The baseline is commit :data:`BASELINE_COMMIT` checked out at :data:`BASELINE` (``git
worktree add /tmp/wt-333 333f1c5``; another path through ``LLAMASWAP_BASELINE``): only the
snapshot existed then. Each measurement is a fresh process (``--worker ROOT`` imports that
tree), this tree's and the baseline's alternating in :data:`ROUNDS` rounds so drift on the
machine hits both alike; the ratio is this tree's median over the baseline's.

Run: ``.venv/bin/python -m bench dashboard [--write]``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WAITING = 5_000
RUNS = 21
"""Calls timed per figure in one process."""
ROUNDS = 7
"""Processes per tree, alternating."""
TOLERANCE = 0.10
"""How much slower than the baseline still counts as "as fast" (run-to-run noise)."""
BASELINE_COMMIT = "333f1c5"
BASELINE = Path(os.environ.get("LLAMASWAP_BASELINE", "/tmp/wt-333"))
HERE = Path(__file__).resolve().parent.parent

SNAPSHOT = "live update (built + JSON)"
FULL = "snapshot on connect (built + JSON)"
FIGURES = [
    SNAPSHOT,
    FULL,
    "models feed",
    "queue table, ranking afresh",
    "queue table, ranking reused",
    "a waiting request's status",
]
COMPARED = (SNAPSHOT, FULL)


# -- the worker: one tree, one process ------------------------------------------------


def _median_ms(fn, before=None) -> float:
    import time

    if before is not None:
        before()
    fn()  # warm: the first call pays for imports and caches
    times = []
    for _ in range(RUNS):
        if before is not None:
            before()
        started = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - started)
    return statistics.median(times) / 1e6


async def _measure() -> dict[str, float]:
    import asyncio
    import dataclasses

    from dashboard.live import LiveObserver
    from scheduler import runtime
    from scheduler.config import parse_config
    from scheduler.dispatcher import Dispatcher
    from scheduler.testing import FakeProcessFactory

    models = {
        m: {"cmd": "fake", "proxy": f"http://127.0.0.1:{9000 + i}"} for i, m in enumerate("abc")
    }
    config = parse_config({"models": models})
    d = Dispatcher(config, process_factory=FakeProcessFactory())
    await d.start()
    rt = runtime.Runtime(config=config, dispatcher=d, upstreams=None)
    runtime.install(rt)
    live = LiveObserver()
    await live.start(d)
    live.runtime = rt  # its keys in the snapshot (set so: the baseline's start takes no rt)
    try:
        running = d.submit(config.models["a"], 0, "run", "/v1/chat/completions")
        await running.wait()
        bands = (10, 0, -100)
        for i in range(WAITING):
            d.submit(
                config.models["abc"[i % 3]], bands[i % 3], f"req-{i:06d}", "/v1/chat/completions"
            )
        while len(d.queue) < WAITING:
            await asyncio.sleep(0.01)
        for _ in range(600):  # the charts' 10 minutes, as on a server up for a while
            live.take_sample()
        results = {
            SNAPSHOT: _median_ms(lambda: json.dumps(live.snapshot(full=False))),
            FULL: _median_ms(lambda: json.dumps(live.snapshot(full=True))),
        }
        try:
            from dashboard import models_page, queue
        except ImportError:  # the baseline: only the snapshot existed
            return results

        def expire() -> None:  # as a second later: the ranking made again, texts kept
            if queue._ranking is not None:
                queue._ranking = dataclasses.replace(queue._ranking, at=-1e9)

        deep = f"req-{WAITING - 1:06d}"
        results["models feed"] = _median_ms(lambda: json.dumps(models_page.model_rows(rt)))
        results["queue table, ranking afresh"] = _median_ms(
            lambda: queue.table(d, [], "all", 1), before=expire
        )
        queue.table(d, [], "all", 1)
        results["queue table, ranking reused"] = _median_ms(lambda: queue.table(d, [], "all", 1))
        results["a waiting request's status"] = _median_ms(lambda: queue.status(d, deep))
        return results
    finally:
        await live.stop()
        runtime.install(None)
        await d.stop(grace=0)


def worker(root: str) -> None:
    """Measure the tree at ``root`` (this process imports its modules) and print JSON."""
    import asyncio
    import logging

    sys.path[0] = root  # not bench/: the tree's own packages first
    os.chdir(root)
    os.environ["DJANGO_SETTINGS_MODULE"] = "llamaswap_site.settings"
    import django

    django.setup()
    logging.disable(logging.WARNING)
    print(json.dumps(asyncio.run(_measure())))


# -- the driver ----------------------------------------------------------------------


def _run(root: Path, database: Path) -> dict[str, float]:
    env = {**os.environ, "DATABASE_URL": f"sqlite:///{database}", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", str(root)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"worker for {root} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _load() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main() -> str:
    from bench import machine, markdown_table

    baseline = BASELINE if (BASELINE / "dashboard" / "live.py").exists() else None
    if baseline is None:
        print(f"no baseline at {BASELINE}: git worktree add {BASELINE} {BASELINE_COMMIT}")
    load_before = _load()
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        database = Path(tmp) / "bench.sqlite3"
        for round_ in range(ROUNDS):
            order = [("now", HERE), ("before", baseline)]
            if round_ % 2:
                order.reverse()
            for name, root in order:
                if root is None:
                    continue
                figures = _run(root, database)
                (ours if name == "now" else theirs).append(figures)
                shown = ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
                print(f"round {round_ + 1}/{ROUNDS} {name}: {shown} ms")
    load_after = _load()

    def med(runs: list[dict[str, float]], figure: str) -> float:
        return statistics.median(r[figure] for r in runs)

    def ms(value: float) -> str:
        return f"{value:.1f}" if value >= 10 else f"{value:.2f}" if value >= 0.1 else f"{value:.3f}"

    rows = []
    for figure in FIGURES:
        now = ms(med(ours, figure))
        if theirs and figure in COMPARED:
            before = ms(med(theirs, figure))
            ratios = [o[figure] / t[figure] for o, t in zip(ours, theirs, strict=True)]
            ratio = f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})"
        else:
            before, ratio = "–", "– (did not exist)"
        rows.append([figure, now, before, ratio])
    table = markdown_table(["ms on the event loop", "now", BASELINE_COMMIT, "now / before"], rows)
    if theirs:
        worst = max(
            statistics.median(o[f] / t[f] for o, t in zip(ours, theirs, strict=True))
            for f in COMPARED
        )
        verdict = (
            f"Target (the snapshot no slower than before, within {TOLERANCE:.0%}): "
            f"{worst:.2f}× at worst, {'met' if worst <= 1 + TOLERANCE else 'NOT met'}."
        )
    else:
        verdict = f"No baseline at {BASELINE} (`git worktree add {BASELINE} {BASELINE_COMMIT}`)."
    return "\n".join(
        [
            f"`python -m bench dashboard`: a real dispatcher with fake model processes, one "
            f"request running and {WAITING:,} waiting over 3 models and the three bands; "
            f"each figure the median over {ROUNDS} fresh processes of the median of {RUNS} "
            f"calls, in ms on the event loop's thread. `{BASELINE_COMMIT}` is the code "
            "before the control room (issue 21), run from a `git worktree`, its processes "
            "alternating with this tree's; the ratio is the median of the rounds' ratios "
            "(their range in brackets). The live update is what the websocket sends at "
            "most 10 times a second while a dashboard is open; the queue ranking is made "
            "at most once a second however many pages ask.",
            "",
            table,
            "",
            verdict,
            "",
            f"Machine: {machine()}; load average (1/5/15 min) {load_before} before, "
            f"{load_after} after.",
        ]
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        print(main())
