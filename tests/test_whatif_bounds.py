"""The what-if page's work is bounded: identical requests share one replay, a client has at
most MAX_PENDING_PER_CLIENT replays pending and everyone MAX_PENDING, a request over a
bound gets a 429 with Retry-After at once, and the cache is bounded in pages and in
replayed jobs. The last test drives the real server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

import httpx
import pytest
from django.urls import reverse

from dashboard import whatif
from scheduler.core.replay import ReplayError
from tests.server import ROOT, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(60)


class Worker:
    """``whatif._submit`` that holds every job until the test finishes it."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[[], Any], Future]] = []

    def __call__(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self.jobs.append((fn, future))
        return future

    def finish(self, index: int, result: Any) -> None:
        self.jobs[index][1].set_result(result)


@pytest.fixture
def worker(monkeypatch) -> Worker:
    # A replay another test started on the real worker may still be pending: start empty.
    with whatif._lock:
        whatif._running.clear()
        whatif._owners.clear()
    whatif.clear()
    held = Worker()
    monkeypatch.setattr(whatif, "_submit", held)
    yield held
    for _, future in held.jobs:
        if not future.done():
            future.cancel()
    with whatif._lock:
        whatif._running.clear()
        whatif._owners.clear()
    whatif.clear()


PAGE = whatif.WhatIf(
    results=[],
    error=ReplayError(
        requests=10, abs_p50=0, abs_p90=0, abs_max=0, band_p95={}, same_order=1.0
    ),
    advice=None,
    crossing=None,  # type: ignore[arg-type]
    requests=10,
    skipped=0,
    loads={},
    origin=None,
    seconds=3.0,
)


def page(requests: int, columns: int = 2) -> whatif.WhatIf:
    return replace(PAGE, requests=requests, results=[None] * columns)  # type: ignore[list-item]


def test_identical_requests_share_one_replay(worker):
    assert whatif.lookup_or_start(("k",), lambda: PAGE, "address:a") is None
    assert whatif.lookup_or_start(("k",), lambda: PAGE, "address:b") is None
    assert len(worker.jobs) == 1
    worker.finish(0, PAGE)
    assert whatif.lookup_or_start(("k",), lambda: PAGE, "address:b") is PAGE


def test_a_client_has_at_most_its_share_pending(worker):
    per = whatif.MAX_PENDING_PER_CLIENT
    for k in range(per):
        assert whatif.lookup_or_start((k,), lambda: PAGE, "address:a") is None
    busy = whatif.lookup_or_start(("one more",), lambda: PAGE, "address:a")
    assert isinstance(busy, whatif.Busy) and "per client" in busy.reason
    assert busy.retry_after >= whatif.REFRESH_SECONDS
    assert len(worker.jobs) == per  # nothing queued for the refused one
    # Another client still gets a slot; and a's first replay done frees one of a's.
    assert whatif.lookup_or_start(("b",), lambda: PAGE, "address:b") is None
    worker.finish(0, PAGE)
    assert whatif.lookup_or_start(("one more",), lambda: PAGE, "address:a") is None


def test_everyone_together_has_at_most_max_pending(worker):
    for k in range(whatif.MAX_PENDING):
        assert whatif.lookup_or_start((k,), lambda: PAGE, f"address:{k}") is None
    busy = whatif.lookup_or_start(("late",), lambda: PAGE, "address:late")
    assert isinstance(busy, whatif.Busy) and f"at most {whatif.MAX_PENDING}" in busy.reason
    assert len(worker.jobs) == whatif.MAX_PENDING


def test_retry_after_follows_the_last_replay_and_is_capped(worker):
    for k in range(whatif.MAX_PENDING):
        whatif.lookup_or_start((k,), lambda: PAGE, f"address:{k}")
    worker.finish(0, replace(PAGE, seconds=30.0))  # 3 pending left, 30 s each
    for k in range(whatif.MAX_PENDING - 1, whatif.MAX_PENDING + 1):
        whatif.lookup_or_start(("x", k), lambda: PAGE, f"address:x{k}")
    busy = whatif.lookup_or_start(("late",), lambda: PAGE, "address:late")
    assert isinstance(busy, whatif.Busy)
    assert busy.retry_after == whatif.RETRY_MAX_SECONDS


def test_the_cache_is_bounded_in_replayed_jobs(worker, monkeypatch):
    monkeypatch.setattr(whatif, "CACHE_DISPATCHES", 1000)
    for k in range(4):
        whatif.lookup_or_start((k,), lambda: PAGE, f"address:{k}")
        worker.finish(k, page(requests=200, columns=2))  # 400 jobs each
    assert list(whatif._cache) == [(2,), (3,)]
    # One page over the bound on its own is still kept: it is the one being looked at.
    whatif.lookup_or_start(("huge",), lambda: PAGE, "address:h")
    worker.finish(4, page(requests=5000, columns=5))
    assert list(whatif._cache) == [("huge",)]


def test_failures_are_bounded(worker):
    for k in range(whatif.FAILED_SIZE + 5):
        whatif.lookup_or_start((k,), lambda: PAGE, f"address:{k}")
        worker.jobs[k][1].set_exception(RuntimeError(f"boom {k}"))
    assert len(whatif._failed) == whatif.FAILED_SIZE


@pytest.mark.django_db
def test_the_page_over_a_bound_is_a_429_with_retry_after(client, worker, monkeypatch):
    from activity.models import RequestRecord

    monkeypatch.setattr(whatif, "_stamp", lambda since, until: (10, 10))
    monkeypatch.setattr(
        RequestRecord.objects, "aggregate", lambda **kw: {"last": None}, raising=False
    )
    url = reverse("dashboard:whatif")
    answers = [client.get(url, {"c1": f"agingDivisor={600 + k}"}) for k in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 429, 429]
    busy = answers[2]
    assert busy["Retry-After"].isdigit() and int(busy["Retry-After"]) >= 2
    text = busy.content.decode()
    assert "what-if worker is busy" in text and 'http-equiv="refresh"' in text
    assert len(worker.jobs) == whatif.MAX_PENDING_PER_CLIENT


# -- through the real server ----------------------------------------------------------------

HISTORY = 5_000


def _record_history(database_url: str) -> None:
    """A recorded day of a generated overload (HISTORY rows) in the server's database."""
    code = (
        "import django; django.setup()\n"
        "from scheduler.core.policy import SchedulerSettings\n"
        "from scheduler.core.simulate import GENERATED_LOAD_SECONDS, generate_trace, simulate\n"
        "from tests.test_replay import record_run\n"
        f"trace = generate_trace({HISTORY}, seed=1)\n"
        "record_run(simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS), trace,"
        " GENERATED_LOAD_SECONDS)\n"
    )
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": "llamaswap_site.settings",
    }
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)


def test_a_burst_of_new_candidates_is_refused_at_once_and_the_worker_does_bounded_work(
    tmp_path,
):
    models = {"m": fake_model(free_port_block(1))}  # never started: only the history is used
    with serve(tmp_path, models, migrate=True) as server:
        _record_history(server.database_url)
        url = server.url + "/whatif/"
        window = {"since": "2026-01-01", "tz": "UTC"}
        statuses = []
        with httpx.Client(timeout=10) as http:
            for k in range(8):
                started = time.monotonic()
                answer = http.get(url, params={**window, "c1": f"agingDivisor={601 + k}"})
                took = time.monotonic() - started
                statuses.append(answer.status_code)
                if answer.status_code == 429:
                    assert int(answer.headers["Retry-After"]) >= 2
                    assert "what-if worker is busy" in answer.text
                    assert took < 2.0, f"a refusal took {took:.2f}s"
            per = whatif.MAX_PENDING_PER_CLIENT
            assert statuses == [200] * per + [429] * (8 - per), statuses
            # The two accepted replays finish; nothing else was queued.
            deadline = time.monotonic() + 40
            for k in range(per):
                params = {**window, "c1": f"agingDivisor={601 + k}"}
                while "Replaying" in (text := http.get(url, params=params).text):
                    assert time.monotonic() < deadline, "the replay never finished"
                    time.sleep(0.2)
                assert "dispatched request" in text
            done = server.log_path.read_text().count("what-if replay done")
            assert done == per, f"{done} replays ran for {per} accepted"
            # With the slots free again, the next new candidate is accepted.
            again = http.get(url, params={**window, "c1": "agingDivisor=999"})
            assert again.status_code == 200
