"""What the dispatcher-level tests share: configs, a fake clock, waiting helpers, and an
observer that keeps what it saw. Fixtures built on these live in ``conftest.py``."""

from __future__ import annotations

import asyncio

from scheduler.config import Config, parse_config
from scheduler.process import ModelState

WALL0 = 1_790_000_000.0
"""Unix seconds at the fake monotonic clock's zero."""


class FakeClock:
    """A monotonic clock the test moves by hand (``advance``); ``wall`` is Unix time."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL0 + self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_config(*models: str, use: str = "serial", fifo: dict | None = None, **serial) -> Config:
    """Models with fake commands on ports 9000, 9001, ...; ``serial`` settings as keywords."""
    raw = {
        "models": {
            m: {"cmd": "fake", "proxy": f"http://127.0.0.1:{9000 + i}"} for i, m in enumerate(models)
        },
        "routing": {
            "scheduler": {
                "use": use,
                "settings": {"serial": serial, "fifo": {"priority": fifo or {}}},
            }
        },
    }
    return parse_config(raw)


async def granted(ticket, timeout: float = 2.0) -> str:
    """The ticket's grant, within ``timeout``."""
    async with asyncio.timeout(timeout):
        return await ticket.wait()


async def until(predicate, timeout: float = 3.0) -> None:
    """Until ``predicate()`` holds, within ``timeout``."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.002)


async def settle() -> None:
    """Let the dispatcher task handle everything posted so far."""
    for _ in range(5):
        await asyncio.sleep(0)


class EventLog:
    """A dispatcher observer that keeps what it saw and lets a test await a model state."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.states: list[tuple[str, ModelState]] = []
        self._changed = asyncio.Event()

    def on_enqueue(self, ticket):
        self.events.append(("enqueue", ticket.request_id))

    def on_dispatch(self, ticket):
        self.events.append(("dispatch", ticket.request_id))

    def on_finish(self, ticket):
        self.events.append(("finish", ticket.request_id))

    def on_model_state(self, model, state):
        self.states.append((model, state))
        self._changed.set()

    def on_settings(self, settings, source):
        self.events.append(("settings", source))

    async def wait_state(self, model: str, state: ModelState) -> None:
        while (model, state) not in self.states:
            self._changed.clear()
            await self._changed.wait()
