"""The garbage collector's pacing in the serving process (proxy/collector.py).

Young collections run just after a request went to its model, the middle generation every
third time; full ones are the server's to start, at most every ``full_every`` seconds while
models work, or from a timer. A fake of the :mod:`gc` module keeps the interpreter's
counting rules; the last tests run the real one.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from proxy.collector import MIDDLE_AT, NEVER, YOUNG_AT, Collector


class FakeGC:
    """The interpreter's counts: ``collect(n)`` zeroes the counts of generations 0..n and
    adds one to generation n+1's; allocations add to generation 0's."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.threshold = (700, 10, 10)
        self.enabled = True
        self.collections: list[int] = []
        self.fail = 0

    def allocate(self, n: int) -> None:
        self.count[0] += n

    def isenabled(self) -> bool:
        return self.enabled

    def get_count(self) -> tuple[int, int, int]:
        return (self.count[0], self.count[1], self.count[2])

    def get_threshold(self) -> tuple[int, int, int]:
        return self.threshold

    def set_threshold(self, *threshold: int) -> None:
        self.threshold = (*threshold, *self.threshold[len(threshold) :])  # type: ignore[assignment]

    def collect(self, generation: int = 2) -> int:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("collector broke")
        for i in range(generation + 1):
            self.count[i] = 0
        if generation < 2:
            self.count[generation + 1] += 1
        self.collections.append(generation)
        return 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def installed(full_every: float = 60.0) -> tuple[Collector, FakeGC, Clock]:
    fake, clock = FakeGC(), Clock()
    collector = Collector(fake, clock, full_every=full_every)
    collector.install()
    return collector, fake, clock


def test_install_takes_full_collections_from_the_interpreter() -> None:
    collector, fake, _ = installed()
    assert fake.get_threshold() == (700, MIDDLE_AT, NEVER)
    collector.uninstall()
    assert fake.get_threshold() == (700, 10, 10)


def test_a_young_collection_runs_when_a_request_went_to_its_model_with_enough_pending() -> None:
    collector, fake, _ = installed()
    fake.allocate(YOUNG_AT - 1)
    collector.model_started()
    assert fake.collections == []
    fake.allocate(1)
    collector.model_started()
    assert fake.collections == [0]
    assert fake.get_count()[0] == 0


def test_the_middle_generation_is_collected_where_the_interpreter_would() -> None:
    collector, fake, _ = installed()
    for _ in range(7):
        fake.allocate(YOUNG_AT)
        collector.model_started()
    # Two young collections, then the middle one (its count passed MIDDLE_AT), and again:
    # each middle collection holds what two young ones left, short enough to overlap a job.
    assert fake.collections == [0, 0, 1] * 2 + [0]
    assert 2 not in fake.collections


def test_a_full_collection_runs_while_a_model_works_once_its_time_came() -> None:
    collector, fake, clock = installed(full_every=60)
    clock.now += 59.9
    collector.model_started()
    assert 2 not in fake.collections
    clock.now += 0.1
    collector.model_started()
    assert fake.collections == [2]
    assert collector.full_collections == 1
    clock.now += 30
    collector.model_started()
    assert fake.collections == [2]  # the next one a full interval later


def test_the_timer_collects_only_when_nothing_did_for_twice_the_interval() -> None:
    collector, fake, clock = installed(full_every=60)
    clock.now += 100
    assert not collector.tick()
    clock.now += 20
    assert collector.tick()
    assert fake.collections == [2]
    clock.now += 60
    collector.model_started()  # under load: the model's turn got it
    clock.now += 60
    assert not collector.tick()


def test_nothing_runs_while_collection_is_disabled_or_before_install() -> None:
    fake, clock = FakeGC(), Clock()
    collector = Collector(fake, clock, full_every=1)
    clock.now += 10
    assert not collector.tick()  # not installed: the interpreter's rules stand
    collector.install()
    fake.enabled = False
    clock.now += 10
    fake.allocate(YOUNG_AT)
    collector.model_started()
    assert not collector.tick()
    assert fake.collections == []


async def test_the_timer_runs_and_survives_a_failing_collection(caplog: pytest.LogCaptureFixture) -> None:
    fake, clock = FakeGC(), Clock()
    collector = Collector(fake, clock, full_every=0.001)
    collector.install()
    fake.fail = 1
    clock.now += 1
    task = asyncio.create_task(collector.pace())
    try:
        async with asyncio.timeout(5):
            while collector.full_collections < 1:
                await asyncio.sleep(0.001)
    finally:
        task.cancel()
    assert "full garbage collection failed" in caplog.text
    assert fake.collections == [2]


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_with_the_real_collector_garbage_in_the_oldest_generation_waits_for_its_time() -> None:
    clock = Clock()
    collector = Collector(gc, clock, full_every=60)
    threshold = gc.get_threshold()
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        collector.install()
        assert gc.get_threshold()[2] == NEVER
        cycle = Cycle()
        gone = weakref.ref(cycle)
        gc.collect(1)  # now in the oldest generation
        del cycle
        for _ in range(30):  # young and middle collections, automatic or started here
            _ = [Cycle() for _ in range(YOUNG_AT)]
            collector.model_started()
        assert gone() is not None  # no full collection yet: the interpreter no longer starts one
        clock.now += 60
        collector.model_started()
        assert gone() is None
        assert collector.full_collections == 1
    finally:
        collector.uninstall()
        gc.set_threshold(*threshold)
        if not was_enabled:
            gc.disable()
