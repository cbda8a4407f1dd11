"""The idle watchdogs of requests waiting for their headers share one timer per loop
(proxy/relay.py ``_Alarms``): each fires at its own time, a closed one never does, and a
watchdog asking for an earlier time than the timer's moves the timer."""

from __future__ import annotations

import asyncio

import pytest

from proxy.relay import _Alarms  # noqa: PLC2701 - the mechanism under test

pytestmark = pytest.mark.timeout(10)


class Dog:
    def __init__(self, fired: list[str], name: str) -> None:
        self.fired, self.name = fired, name

    def fire(self) -> None:
        self.fired.append(self.name)


async def test_each_watchdog_fires_at_its_time_and_a_closed_one_never():
    fired: list[str] = []
    alarms = _Alarms.of(asyncio.get_running_loop())
    late, early, closed = Dog(fired, "late"), Dog(fired, "early"), Dog(fired, "closed")
    alarms.add(late, 0.15)  # type: ignore[arg-type]
    alarms.add(closed, 0.02)  # type: ignore[arg-type]
    alarms.add(early, 0.05)  # type: ignore[arg-type]  # later than the timer: no new timer
    alarms.due.pop(closed)  # closed before its time: what _Watchdog.close does
    await asyncio.sleep(0.1)
    assert fired == ["early"]
    await asyncio.sleep(0.1)
    assert fired == ["early", "late"]
    assert not alarms.due and alarms.timer is None  # nothing left: no timer either


async def test_an_earlier_time_moves_the_timer():
    fired: list[str] = []
    alarms = _Alarms.of(asyncio.get_running_loop())
    alarms.add(Dog(fired, "slow"), 30)  # type: ignore[arg-type]
    alarms.add(Dog(fired, "quick"), 0.02)  # type: ignore[arg-type]
    await asyncio.sleep(0.1)
    assert fired == ["quick"]
    alarms.due.clear()
