"""The health check's schedule: a model that becomes healthy is found at the next check of a
fast backoff, and a slow one is not hammered (the waits grow to the configured ceiling)."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import pytest

from scheduler import process as process_module
from scheduler.config import ModelConfig
from scheduler.process import (
    HEALTH_BACKOFF,
    HEALTH_FIRST_DELAY,
    HEALTH_POLL_INTERVAL,
    LogBuffer,
    ModelProcess,
    ModelState,
    health_delays,
    set_state_dir,
)
from tests.conftest import ROOT, pick_free_port

pytestmark = pytest.mark.timeout(15)

SWAPMODEL = ROOT / "bench" / "swapmodel.py"


def test_waits_start_fast_grow_and_stop_at_the_ceiling():
    waits = list(itertools.islice(health_delays(), 200))
    assert waits[0] == HEALTH_FIRST_DELAY
    assert waits[1] == pytest.approx(HEALTH_FIRST_DELAY * HEALTH_BACKOFF)
    assert all(a <= b for a, b in itertools.pairwise(waits))  # never faster again
    assert max(waits) == HEALTH_POLL_INTERVAL
    # Bounded: a model that takes long to load is asked at most every HEALTH_POLL_INTERVAL
    # once the backoff has grown; in its first 10 s of waits, ~110 checks, not thousands.
    elapsed = list(itertools.accumulate(waits))
    within_10s = sum(1 for t in elapsed if t <= 10.0)
    assert within_10s <= 10.0 / HEALTH_POLL_INTERVAL + 30
    # ...and a model healthy after 0.1 s has been asked several times by then.
    assert sum(1 for t in elapsed if t <= 0.1) >= 10


def test_waits_follow_the_given_schedule():
    waits = list(itertools.islice(health_delays(0.01, 2.0, 0.05), 5))
    assert waits == [0.01, 0.02, 0.04, 0.05, 0.05]


class Recording(ModelProcess):
    """Notes each health check: (monotonic ns when sent, answered 200)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checks: list[tuple[int, bool]] = []

    async def _health_once(self, client, url):
        sent = time.monotonic_ns()
        ok = await super()._health_once(client, url)
        self.checks.append((sent, ok))
        return ok


async def test_a_model_healthy_after_its_load_is_found_at_the_next_check(tmp_path, monkeypatch):
    """The model (bench/swapmodel.py) listens 0.15 s after its first instruction and stamps
    the moment; the checks before it were refused, the first check sent after it passed, and
    the start returned once it had: READY within one step of the backoff, not of a fixed
    0.1 s poll."""
    set_state_dir(tmp_path / "state")
    stamps = tmp_path / "stamps"
    port = pick_free_port()
    cfg = ModelConfig(
        id="m",
        cmd=(sys.executable, "-I", "-S", str(SWAPMODEL), str(port), str(stamps), "0.15"),
        proxy=f"http://127.0.0.1:{port}",
        health_check_timeout=10,
        unload_timeout=2,
    )
    process = Recording(cfg, LogBuffer())
    asked: list[float] = []

    def recorded_delays():
        for delay in health_delays():
            asked.append(delay)
            yield delay

    monkeypatch.setattr(process_module, "health_delays", recorded_delays)
    try:
        await process.start()
        ready = time.monotonic_ns()
        assert process.state is ModelState.READY
        events = dict(line.split()[::2] for line in Path(stamps).read_text().splitlines())
        listen, health = int(events["listen"]), int(events["health"])
        refused = [sent for sent, ok in process.checks if not ok]
        passed = [sent for sent, ok in process.checks if ok]
        assert len(passed) == 1 and process.checks[-1][1]
        # Every refused check before the server listened, the passing one after them all.
        # The waits between them were the schedule's (one drawn per check, the last unused).
        assert asked == list(itertools.islice(health_delays(), len(process.checks)))
        assert len(refused) >= 2
        assert all(sent < listen for sent in refused)
        assert passed[0] > refused[-1]
        # Never faster than the schedule: each wait at least the backoff's.
        sent = [at for at, _ in process.checks]
        for gap, wait in zip(itertools.pairwise(sent), health_delays(), strict=False):
            assert gap[1] - gap[0] >= wait * 1e9 - 1e5
        assert listen <= health <= ready
    finally:
        await process.stop()
        set_state_dir(None)
    assert process.state is ModelState.STOPPED
