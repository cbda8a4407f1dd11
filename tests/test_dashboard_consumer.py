"""The dashboard's live path: dispatcher events -> LiveObserver -> channel layer -> consumer.

A real Dispatcher with in-memory model processes; Channels' WebsocketCommunicator as the
browser. Every wait is bounded; nothing sleeps to prove that nothing happened.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import pytest
from channels.layers import channel_layers
from channels.testing import WebsocketCommunicator

from dashboard.consumers import DashboardConsumer
from dashboard.live import LiveObserver
from scheduler.config import Config, ModelConfig
from scheduler.core.policy import SchedulerSettings
from scheduler.dispatcher import Dispatcher, Outcome
from scheduler.testing import FakeProcessFactory

# Channels closes stale database connections around each consumer event: allow it.
pytestmark = [pytest.mark.timeout(30), pytest.mark.django_db(transaction=True)]


def _config() -> Config:
    models = {
        m: ModelConfig(id=m, cmd=("true",), proxy=f"http://127.0.0.1:1/{m}") for m in ("a", "b")
    }
    return Config(
        models=models, scheduler=SchedulerSettings.create(aging_divisor=60, swap_affinity_bonus=10)
    )


@pytest.fixture
def fresh_layers():
    """A new channel layer per test (an in-memory layer's queues belong to one loop)."""
    channel_layers.backends = {}
    yield
    channel_layers.backends = {}


@pytest.fixture
async def live_env(fresh_layers):
    factory = FakeProcessFactory()
    live = LiveObserver(interval=0.1, sample_every=0.5)
    dispatcher = Dispatcher(_config(), process_factory=factory, observers=[live])
    await dispatcher.start()
    await live.start(dispatcher)
    yield dispatcher, live, factory
    await live.stop()
    await dispatcher.stop(grace=0)


async def _connect() -> WebsocketCommunicator:
    comm = WebsocketCommunicator(DashboardConsumer.as_asgi(), "/ws/dashboard/")
    connected, _ = await comm.connect(timeout=3)
    assert connected
    return comm


async def _until(
    comm: WebsocketCommunicator, test: Callable[[dict], bool], timeout: float = 5
) -> tuple[dict, int]:
    """Receive until a message passes ``test``; returns it and how many came."""
    count = 0
    async with asyncio.timeout(timeout):
        while True:
            msg = await comm.receive_json_from(timeout=timeout)
            count += 1
            if test(msg):
                return msg, count


def _ids(rows: list[dict]) -> list[str]:
    return [r["request_id"] for r in rows]


async def test_snapshot_on_connect(live_env):
    dispatcher, live, _ = live_env
    comm = await _connect()
    try:
        snap = await comm.receive_json_from(timeout=2)
        assert snap["type"] == "snapshot"
        assert [b["band"] for b in snap["bands"]] == ["interactive", "normal", "batch"]
        assert snap["depth"] == 0 and snap["waiting"] == [] and snap["running"] == []
        assert snap["settings"]["swapAffinityBonus"] == 10
        assert snap["settings"]["source"] == "config file"
        assert snap["samples"], "the charts' history comes with the snapshot"
    finally:
        await comm.disconnect()


async def test_updates_after_enqueue_dispatch_and_finish(live_env):
    dispatcher, live, factory = live_env
    factory.configure("a", hold_start=True)
    comm = await _connect()
    try:
        await comm.receive_json_from(timeout=2)  # the snapshot
        first = dispatcher.submit(dispatcher.config.models["a"], 0, "first", "/v1/chat/completions")
        # dispatched at once: its model is loading
        msg, _ = await _until(
            comm, lambda m: _ids(m["running"]) == ["first"] and m["model"]["state"] == "starting"
        )
        assert msg["type"] == "update"
        assert msg["running"][0]["state"] == "loading"
        assert _ids(msg["decisions"]) == ["first"]
        assert msg["model"] == {"id": "a", "state": "starting"}

        second = dispatcher.submit(
            dispatcher.config.models["b"], 100, "second", "/v1/chat/completions"
        )
        msg, _ = await _until(comm, lambda m: _ids(m["waiting"]) == ["second"])
        assert msg["bands"][0]["depth"] == 1 and msg["waiting"][0]["band"] == "interactive"

        factory.processes["a"].release()
        await asyncio.wait_for(first.wait(), 3)
        msg, _ = await _until(comm, lambda m: m["model"]["state"] == "ready")
        assert msg["running"][0]["state"] == "running"

        dispatcher.finish(first, Outcome.COMPLETED, 200)
        msg, _ = await _until(comm, lambda m: _ids(m["running"]) == ["second"])
        assert msg["depth"] == 0
        assert _ids(msg["decisions"]) == ["second", "first"]  # newest first
        assert msg["bands"][0]["dispatched"] == 1 and msg["bands"][1]["dispatched"] == 1

        await asyncio.wait_for(second.wait(), 3)
        dispatcher.finish(second, Outcome.COMPLETED, 200)
        msg, _ = await _until(comm, lambda m: m["running"] == [])
        assert msg["depth"] == 0
    finally:
        await comm.disconnect()


async def test_a_burst_is_coalesced_and_the_waiting_list_capped(live_env):
    dispatcher, live, factory = live_env
    factory.configure("a", hold_start=True)  # the first request holds the GPU
    comm = await _connect()
    try:
        await comm.receive_json_from(timeout=2)
        loop = asyncio.get_running_loop()
        started = loop.time()
        sent_before = live.sent
        burst = 2000
        for i in range(burst):
            dispatcher.submit(
                dispatcher.config.models["a" if i % 2 else "b"], [100, 0, -100][i % 3], f"r{i}", "/"
            )
            if i % 100 == 0:
                await asyncio.sleep(0)  # let the dispatcher and the observer run meanwhile
        msg, received = await _until(comm, lambda m: m["depth"] == burst - 1)
        elapsed = loop.time() - started
        # at most one update per 100 ms (plus the one in flight when the burst began)
        assert received <= elapsed / live.interval + 2, (received, elapsed)
        assert live.sent - sent_before <= elapsed / live.interval + 2
        assert msg["waiting_shown"] == 50 and len(msg["waiting"]) == 50
        assert sum(b["depth"] for b in msg["bands"]) == burst - 1
        assert [w["rank"] for w in msg["waiting"][:3]] == [1, 2, 3]
    finally:
        await comm.disconnect()


async def test_settings_change_reaches_the_dashboard(live_env):
    dispatcher, live, _ = live_env
    comm = await _connect()
    try:
        await comm.receive_json_from(timeout=2)
        new = dispatcher.settings.with_changes(swap_affinity_bonus=42)
        dispatcher.set_settings(new, source="admin edit: swapAffinityBonus by alice")
        msg, _ = await _until(comm, lambda m: m["settings"]["swapAffinityBonus"] == 42)
        assert msg["settings"]["source"] == "admin edit: swapAffinityBonus by alice"
        assert msg["settings"]["since"] is not None
    finally:
        await comm.disconnect()


async def test_live_path_over_redis(settings):
    """With REDIS_URL the app uses channels_redis: the same path through the local Redis."""
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": ["redis://127.0.0.1:6379/0"],
                "prefix": f"llamaswap-test-{uuid.uuid4().hex[:8]}",
            },
        }
    }
    channel_layers.backends = {}
    factory = FakeProcessFactory()
    factory.configure("a", hold_start=True)
    live = LiveObserver(interval=0.05)
    dispatcher = Dispatcher(_config(), process_factory=factory, observers=[live])
    await dispatcher.start()
    await live.start(dispatcher)
    comm = await _connect()
    try:
        assert type(channel_layers["default"]).__name__ == "RedisChannelLayer"
        snap = await comm.receive_json_from(timeout=3)
        assert snap["type"] == "snapshot"
        dispatcher.submit(dispatcher.config.models["a"], 0, "one", "/")
        dispatcher.submit(dispatcher.config.models["b"], -100, "two", "/")
        msg, _ = await _until(
            comm, lambda m: _ids(m["waiting"]) == ["two"] and _ids(m["running"]) == ["one"]
        )
        assert msg["bands"][2]["depth"] == 1
    finally:
        await comm.disconnect()
        await live.stop()
        await dispatcher.stop(grace=0)
        layer = channel_layers["default"]
        await layer.flush()
        channel_layers.backends = {}


async def test_nothing_is_built_while_no_dashboard_is_open_and_one_that_opens_is_current(live_env):
    dispatcher, live, factory = live_env
    factory.configure("a", hold_start=True)
    dispatcher.submit(dispatcher.config.models["a"], 0, "first", "/")
    for i in range(20):
        dispatcher.submit(dispatcher.config.models["b"], 0, f"w{i}", "/")
    # The charts keep their history meanwhile: wait for two samples (sample_every 0.5 s).
    samples = len(live.samples)
    async with asyncio.timeout(5):
        while len(live.samples) < samples + 2:
            await asyncio.sleep(0.05)
    assert live.sent == 0  # twenty events and a second went by: no snapshot for nobody
    comm = await _connect()
    try:
        snap = await comm.receive_json_from(timeout=3)
        assert snap["depth"] == 20 and _ids(snap["running"]) == ["first"]
        dispatcher.submit(dispatcher.config.models["b"], 100, "late", "/")
        msg, _ = await _until(comm, lambda m: m["depth"] == 21)
        assert live.sent >= 1
    finally:
        await comm.disconnect()
    sent, samples = live.sent, len(live.samples)
    dispatcher.submit(dispatcher.config.models["b"], 0, "after", "/")
    async with asyncio.timeout(5):  # a sample, 0.5 s on: an update would have gone before
        while len(live.samples) < samples + 1:
            await asyncio.sleep(0.05)
    assert live.sent == sent
