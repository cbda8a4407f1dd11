"""sendLoadingState end to end: a waiting streaming client is told where it stands.

The real server and fakellm models; the client is the ``openai`` SDK, which must parse
every event without error: progress arrives as ``reasoning_content`` deltas, then the
answer, in one stream.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.server import chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(90)


async def collect(client: AsyncOpenAI, model: str, **extra) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of one streamed chat completion."""
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "queued"}], stream=True, **extra
    )
    reasoning, content, finish = [], [], None
    async for chunk in stream:
        for choice in chunk.choices:
            extra_fields = choice.delta.model_extra or {}
            reasoning.append(extra_fields.get("reasoning_content") or "")
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(reasoning), "".join(content), finish


def test_a_streaming_client_waiting_behind_two_others_sees_its_place_then_its_answer(tmp_path):
    port = free_port_block(1)
    with serve(tmp_path, {"m": fake_model(port)}, {"sendLoadingState": True}) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as http, AsyncOpenAI(
                base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
            ) as client:
                await http.post(server.url + "/v1/chat/completions", json=chat("m", "warm"))
                ahead = [
                    asyncio.create_task(
                        http.post(server.url + "/v1/chat/completions", json=chat("m", f"job{i}", fake_delay=1.3))
                    )
                    for i in range(3)
                ]
                await asyncio.to_thread(server.wait_queue, 2)
                mine = await collect(client, "m")
                return mine, await asyncio.gather(*ahead)

        (reasoning, content, finish), ahead = asyncio.run(scenario())
    assert all(r.status_code == 200 for r in ahead)
    places = re.findall(r"#(\d+) of (\d+) in line \(normal\), about", reasoning)
    assert places[0] == ("3", "3")  # behind the running job's two waiting companions
    assert [p for p, _ in places] == sorted({p for p, _ in places}, reverse=True)  # moving up
    assert ("1", "1") in places
    assert content and finish == "stop"


def test_a_streaming_client_sees_its_model_load(tmp_path):
    port = free_port_block(1)
    models = {"m": fake_model(port, load_seconds=1.5, sendLoadingState=True)}
    with serve(tmp_path, models) as server:

        async def scenario():
            async with AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
                return await collect(client, "m")

        reasoning, content, finish = asyncio.run(scenario())
    assert "llamaswap: loading model m" in reasoning and "Done! (" in reasoning
    assert content and finish == "stop"


def test_an_error_after_the_progress_began_reaches_the_sdk_as_an_api_error(tmp_path):
    port = free_port_block(1)
    extra = {
        "sendLoadingState": True,
        "routing": {"scheduler": {"settings": {"serial": {"maxWait": {"normal": 1}}}}},
    }
    with serve(tmp_path, {"m": fake_model(port)}, extra) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as http, AsyncOpenAI(
                base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60
            ) as client:
                blocker = asyncio.create_task(
                    http.post(
                        server.url + "/v1/chat/completions",
                        json=chat("m", "blocker", fake_delay=3),
                        headers={"X-LlamaSwap-Priority": "interactive"},
                    )
                )
                await asyncio.to_thread(server.wait_running)
                with pytest.raises(openai.APIError) as caught:
                    await collect(client, "m")
                await blocker
                return caught.value

        error = asyncio.run(scenario())
    assert "maxWait" in str(error)


def test_without_send_loading_state_a_waiting_stream_gets_no_progress(tmp_path):
    port = free_port_block(1)
    with serve(tmp_path, {"m": fake_model(port, load_seconds=0.5)}) as server:

        async def scenario():
            async with AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
                return await collect(client, "m")

        reasoning, content, finish = asyncio.run(scenario())
    assert reasoning == "" and content and finish == "stop"
