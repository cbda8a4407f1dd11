"""The channel layer between the live observer and the dashboard consumers is bounded per
channel: a consumer that stops taking messages (its task starved) holds at most
``capacity`` (100) snapshots, the rest are dropped, and the sender never blocks or fails.
In-memory locally; channels_redis with REDIS_URL (skipped when no Redis answers)."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest
from channels.layers import InMemoryChannelLayer

from dashboard.live import EVENT_TYPE, GROUP

pytestmark = pytest.mark.timeout(30)

SNAPSHOT = {"type": EVENT_TYPE, "snapshot": {"waiting": [{"row": "x" * 700}] * 50}}
"""About the size of a busy dashboard's snapshot (~37 KB)."""
SENDS = 300


async def _flood(layer) -> str:
    stuck = await layer.new_channel()
    await layer.group_add(GROUP, stuck)
    async with asyncio.timeout(10):  # the sender is never held up by the stuck channel
        for _ in range(SENDS):
            await layer.group_send(GROUP, SNAPSHOT)
    return stuck


async def test_the_in_memory_layer_keeps_at_most_its_capacity_per_channel():
    layer = InMemoryChannelLayer()
    stuck = await _flood(layer)
    assert layer.capacity == 100
    assert layer.channels[stuck].qsize() == layer.capacity


def _redis_up() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _redis_up(), reason="no Redis on 127.0.0.1:6379")
async def test_the_redis_layer_keeps_at_most_its_capacity_per_channel():
    from channels_redis.core import RedisChannelLayer

    layer = RedisChannelLayer(
        hosts=["redis://127.0.0.1:6379/0"], prefix=f"llamaswap-test-{uuid.uuid4().hex[:8]}"
    )
    try:
        stuck = await _flood(layer)
        kept = 0
        async with asyncio.timeout(10):
            while True:
                try:
                    async with asyncio.timeout(0.3):
                        await layer.receive(stuck)
                except TimeoutError:
                    break
                kept += 1
        assert 0 < kept <= layer.capacity
    finally:
        await layer.flush()
        await layer.close_pools()
