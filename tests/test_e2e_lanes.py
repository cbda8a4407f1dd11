"""Lanes, slots and groups end to end: the real server, real model processes, real sockets.

What a user with two GPUs (or an embedding model beside the chat model) would notice:
requests on different lanes overlap in time at the model servers, requests on one lane
do not, a persistent model is never restarted, a model with slots drains before a swap,
and a model crashing on one lane leaves the other lane's request untouched.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server import chat, fake_model, fake_requests, free_port_block, recorded, serve

pytestmark = pytest.mark.timeout(90)


def lanes(use: str = "serial", **lane_members: list[str]) -> dict:
    return {"routing": {"scheduler": {"use": use, "settings": {"serial": {"lanes": lane_members}}}}}


async def post(client: httpx.AsyncClient, base: str, body: dict, priority: str | None = None):
    headers = {"X-LlamaSwap-Priority": priority} if priority is not None else {}
    return await client.post(base + "/v1/chat/completions", json=body, headers=headers)


def arrivals(log) -> dict[str, float]:
    """When the model servers writing to ``log`` received each request, by its tag.
    (The file outlives swapped-out processes; a request's end is its arrival plus the
    ``fake_delay`` it asked for, at least.)"""
    return {r["body"]["messages"][0]["content"]: r["received_at"] for r in recorded(log)}


def test_two_lanes_serve_at_once_and_one_lane_serialises(tmp_path):
    port = free_port_block(3)
    log = tmp_path / "requests.jsonl"
    models = {
        "a": fake_model(port, record=log),
        "c": fake_model(port + 1, record=log),
        "b": fake_model(port + 2, record=log),
    }
    with serve(tmp_path, models, lanes(gpu0=["a", "c"], gpu1=["b"])) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                ta = asyncio.create_task(post(client, server.url, chat("a", "a", fake_delay=1.0)))
                await asyncio.to_thread(server.wait_running)
                tb = asyncio.create_task(post(client, server.url, chat("b", "b", fake_delay=1.0), "batch"))
                tc = asyncio.create_task(post(client, server.url, chat("c", "c"), "interactive"))
                return await asyncio.gather(ta, tb, tc)

        responses = asyncio.run(scenario())
        assert [r.status_code for r in responses] == [200, 200, 200]
        running = httpx.get(server.url + "/running", timeout=5).json()["running"]
    at = arrivals(log)
    # b (batch, gpu1) ran during a's second (gpu0); c (interactive, gpu0) waited for a.
    assert at["b"] < at["a"] + 1.0
    assert at["c"] >= at["a"] + 1.0
    assert {r["model"]: r["lane"] for r in running} == {"c": "gpu0", "b": "gpu1"}


def test_a_persistent_group_is_never_evicted(tmp_path):
    port = free_port_block(3)
    models = {"embed": fake_model(port), "a": fake_model(port + 1), "b": fake_model(port + 2)}
    extra = {
        "routing": {
            "router": {
                "use": "group",
                "settings": {
                    "groups": {
                        "always": {"persistent": True, "swap": False, "exclusive": False, "members": ["embed"]},
                        "chat": {"members": ["a", "b"]},
                    }
                },
            }
        }
    }
    with serve(tmp_path, models, extra) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                for i, model in enumerate(["embed", "a", "embed", "b", "embed", "a", "embed"]):
                    r = await post(client, server.url, chat(model, f"{model}{i}"))
                    assert r.status_code == 200, r.text

        asyncio.run(scenario())
        # One process served every embed request (its in-memory record would have been
        # lost with a restart), while a and b swapped each other out.
        assert [r["body"]["messages"][0]["content"] for r in fake_requests(port)] == [
            "embed0", "embed2", "embed4", "embed6",
        ]
        assert [r["body"]["messages"][0]["content"] for r in fake_requests(port + 1)] == ["a5"]


def test_slots_run_together_then_drain_before_a_swap(tmp_path):
    port = free_port_block(2)
    log = tmp_path / "requests.jsonl"
    models = {"m": fake_model(port, record=log, slots=2), "n": fake_model(port + 1, record=log)}
    with serve(tmp_path, models) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                await post(client, server.url, chat("m", "warm"))
                first = asyncio.create_task(post(client, server.url, chat("m", "m1", fake_delay=1.0)))
                second = asyncio.create_task(post(client, server.url, chat("m", "m2", fake_delay=1.0)))
                await asyncio.to_thread(server.wait_running, 2)
                urgent = asyncio.create_task(post(client, server.url, chat("n", "n1"), "interactive"))
                await asyncio.to_thread(server.wait_queue, 1)
                late = asyncio.create_task(post(client, server.url, chat("m", "m3")))
                await asyncio.to_thread(server.wait_queue, 2)
                return await asyncio.gather(first, second, urgent, late)

        responses = asyncio.run(scenario())
        assert all(r.status_code == 200 for r in responses)
    at = arrivals(log)
    assert abs(at["m1"] - at["m2"]) < 1.0  # two slots: both at once
    # A slot was free when m3 arrived, but n's interactive request was the lane's best:
    # m admitted no more, drained, n swapped in, and m3 went last.
    assert at["n1"] >= max(at["m1"], at["m2"]) + 1.0
    assert at["m3"] > at["n1"]


def test_a_crash_on_one_lane_does_not_disturb_the_other(tmp_path):
    port = free_port_block(2)
    models = {"a": fake_model(port), "b": fake_model(port + 1)}
    with serve(tmp_path, models, lanes(gpu0=["a"], gpu1=["b"])) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                long = asyncio.create_task(
                    post(client, server.url, chat("b", "long", stream=True, fake_tokens=40, fake_tokens_per_second=40))
                )
                await asyncio.to_thread(server.wait_running)
                crash = await post(
                    client, server.url, chat("a", "boom", stream=True, fake_tokens=20, fake_crash_after=2)
                )
                again = await post(client, server.url, chat("a", "again"))
                return await long, crash, again

        long, crash, again = asyncio.run(scenario())
        assert long.status_code == 200 and long.text.rstrip().endswith("data: [DONE]")
        assert crash.status_code == 200  # the stream broke after its headers
        assert again.status_code == 200
        assert len(fake_requests(port + 1)) == 1  # b's process served on, never restarted
