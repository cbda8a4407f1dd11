"""Priority scheduling end to end: the real server, real model processes, real sockets.

Each test occupies the GPU with one long request, queues more behind it, and reads the
order in which the simulated model server received them.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server import chat, fake_model, fake_requests, free_port_block, recorded, serve

pytestmark = pytest.mark.timeout(60)

HOLD = 1.0  # seconds the blocking job holds the GPU


async def post(client: httpx.AsyncClient, base: str, body: dict, priority: str | None = None):
    headers = {"X-LlamaSwap-Priority": priority} if priority is not None else {}
    return await client.post(base + "/v1/chat/completions", json=body, headers=headers)


async def run_behind_blocker(server, blocker: dict, queued: list[tuple[dict, str | None]]):
    """Send ``blocker``, then every queued request once the blocker runs; wait for all."""
    async with httpx.AsyncClient(timeout=30) as client:
        first = asyncio.create_task(post(client, server.url, blocker))
        await asyncio.to_thread(server.wait_running)
        tasks = []
        for body, priority in queued:
            tasks.append(asyncio.create_task(post(client, server.url, body, priority)))
            # Arrival order is part of the contract (ties keep it): send one at a time.
            await asyncio.to_thread(server.wait_queue, len(tasks))
        responses = await asyncio.gather(first, *tasks)
    assert all(r.status_code == 200 for r in responses), (
        [(r.status_code, r.text[:300]) for r in responses if r.status_code != 200],
        server.log()[-3000:],
    )
    return responses


def received_tags(port: int) -> list[str]:
    return [r["body"]["messages"][0]["content"] for r in fake_requests(port)]


def test_priority_order_end_to_end(tmp_path):
    port = free_port_block(1)
    with serve(tmp_path, {"m": fake_model(port)}) as server:
        queued = [
            (chat("m", "batch"), "batch"),
            (chat("m", "normal"), None),
            (chat("m", "unparseable"), "high"),  # counts as 0, arrived after 'normal'
            (chat("m", "batch-max"), "-98"),
            (chat("m", "interactive"), "interactive"),
            (chat("m", "normal-pro"), "+1"),
            (chat("m", "batch-pro"), "-99"),
        ]
        asyncio.run(run_behind_blocker(server, chat("m", "blocker", fake_delay=HOLD), queued))
        assert received_tags(port) == [
            "blocker",
            "interactive",
            "normal-pro",
            "normal",
            "unparseable",
            "batch-max",
            "batch-pro",
            "batch",
        ]


def test_swap_affinity_keeps_same_model_work_together_but_never_crosses_a_band(tmp_path):
    port = free_port_block(2)
    log = tmp_path / "requests.jsonl"
    models = {"a": fake_model(port, record=log), "b": fake_model(port + 1, record=log)}
    with serve(tmp_path, models) as server:
        queued = [
            (chat("b", "b-normal-1"), None),
            (chat("a", "a-normal-1"), None),  # same model as the blocker: affinity +10
            (chat("b", "b-interactive"), "interactive"),  # a band up: beats any affinity
            (chat("a", "a-normal-2"), None),
            (chat("a", "a-batch"), "batch"),  # affinity never lifts batch over normal
        ]
        asyncio.run(run_behind_blocker(server, chat("a", "blocker", fake_delay=HOLD), queued))
    # interactive goes first (a swap to b); b's normal request then has the affinity
    # bonus; a's normal work runs together after one swap back; batch goes last even
    # though it waits on the loaded model.
    assert tags(recorded(log)) == [
        "blocker",
        "b-interactive",
        "b-normal-1",
        "a-normal-1",
        "a-normal-2",
        "a-batch",
    ]


def test_affinity_beats_arrival_order_inside_a_band(tmp_path):
    port = free_port_block(2)
    log = tmp_path / "requests.jsonl"
    models = {"a": fake_model(port, record=log), "b": fake_model(port + 1, record=log)}
    with serve(tmp_path, models) as server:
        queued = [
            (chat("b", "b-first"), None),  # came first, but needs a swap
            (chat("a", "a-second"), None),  # runs on the loaded model: +10
            (chat("b", "b-pro"), "+2"),  # a tier offset does not beat the bonus
        ]
        asyncio.run(run_behind_blocker(server, chat("a", "blocker", fake_delay=HOLD), queued))
    assert tags(recorded(log)) == ["blocker", "a-second", "b-pro", "b-first"]


def test_aging_lets_old_batch_work_overtake_normal(tmp_path):
    port = free_port_block(1)
    extra = {"routing": {"scheduler": {"settings": {"serial": {"agingDivisor": 0.005}}}}}
    with serve(tmp_path, {"m": fake_model(port)}, extra) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                blocker = asyncio.create_task(
                    post(client, server.url, chat("m", "blocker", fake_delay=1.2))
                )
                await asyncio.to_thread(server.wait_running)
                old = asyncio.create_task(post(client, server.url, chat("m", "old-batch"), "batch"))
                await asyncio.to_thread(server.wait_queue, 1)
                # 100 points of aging at 0.005 s each is 0.5 s: wait well past it.
                await asyncio.sleep(0.8)
                new = asyncio.create_task(post(client, server.url, chat("m", "new-normal")))
                await asyncio.to_thread(server.wait_queue, 2)
                return await asyncio.gather(blocker, old, new)

        responses = asyncio.run(scenario())
        assert all(r.status_code == 200 for r in responses)
        assert received_tags(port) == ["blocker", "old-batch", "new-normal"]


def test_fifo_orders_swaps_by_model_priority_plus_header(tmp_path):
    port = free_port_block(3)
    log = tmp_path / "requests.jsonl"
    models = {name: fake_model(port + i, record=log) for i, name in enumerate("abc")}
    extra = {
        "routing": {
            "scheduler": {"use": "fifo", "settings": {"fifo": {"priority": {"b": 10, "c": -5}}}}
        }
    }
    with serve(tmp_path, models, extra) as server:
        queued = [
            (chat("c", "c-normal"), None),  # -5
            (chat("b", "b-batch"), "batch"),  # 10 - 100 = -90
            (chat("b", "b-normal"), None),  # 10
            (chat("c", "c-interactive"), "interactive"),  # -5 + 100 = 95
        ]
        asyncio.run(run_behind_blocker(server, chat("a", "blocker", fake_delay=HOLD), queued))
    # c-interactive (95) swaps c in and c's other waiting request is served with it
    # (the model is ready); then b-normal (10) swaps b in, with b's batch request.
    order = tags(recorded(log))
    assert order[0] == "blocker"
    assert set(order[1:3]) == {"c-interactive", "c-normal"}
    assert set(order[3:5]) == {"b-normal", "b-batch"}


def test_fifo_serves_the_ready_model_at_once_up_to_its_concurrency_limit(tmp_path):
    port = free_port_block(1)
    models = {"m": fake_model(port, concurrencyLimit=2)}
    with serve(tmp_path, models, {"routing": {"scheduler": {"use": "fifo"}}}) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                warm = await post(client, server.url, chat("m", "warm"))
                slow = [
                    asyncio.create_task(post(client, server.url, chat("m", f"s{i}", fake_delay=1.0)))
                    for i in range(2)
                ]
                await asyncio.to_thread(server.wait_running, 2)
                third = await post(client, server.url, chat("m", "third"))
                return warm, await asyncio.gather(*slow), third

        warm, slow, third = asyncio.run(scenario())
        assert warm.status_code == 200
        assert [r.status_code for r in slow] == [200, 200]  # both at once, no queueing
        assert third.status_code == 429
        assert third.headers["Retry-After"] == "1"
        assert third.json()["error"]["type"] == "rate_limit_error"


def tags(records: list[dict]) -> list[str]:
    return [r["body"]["messages"][0]["content"] for r in records]
