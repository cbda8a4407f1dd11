"""llamaswap in front of llama.cpp's real ``llama-server``: the stack users run.

The models are tiny random-weight LLaMAs (scripts/real-llama/make_tiny_gguf.py): replies
are gibberish English words, but every request goes through the real tokenizer, chat
template, forward pass, sampler and OpenAI JSON/SSE encoding. They never stop by
themselves, so ``max_tokens`` sets a reply's exact length (and a job's duration).
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from datetime import datetime

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

pytestmark = pytest.mark.timeout(180)

PRINTABLE = re.compile(r"[ -~]+")  # the models' words are printable ASCII
FLAGS = ["-c", "8192", "--parallel", "1"]  # one slot with the model's whole context
LONG = 2000  # tokens: a job that holds the model for ~3 s (measured 0.9 s for 1000, 7 s for 3000)


def when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def body(model: str, content: str, max_tokens: int, **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


def ask(url: str, model: str, content: str = "hello", max_tokens: int = 16) -> str:
    r = httpx.post(url + "/v1/chat/completions", json=body(model, content, max_tokens), timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == max_tokens
    return reply["choices"][0]["message"]["content"]


async def stream(client: AsyncOpenAI, model: str, n: int, max_tokens: int):
    """One streamed chat completion: (text, finish_reason, usage)."""
    chunks = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"stream number {n}"}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    async for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


def test_streaming_chat_with_the_openai_sdk(llamaswap):
    swap = llamaswap({"tiny-a": ["tiny-a", *FLAGS]})
    client = OpenAI(base_url=swap.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "hello proxy, stream me a reply"}]
    stream = client.chat.completions.create(
        model="tiny-a",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-LlamaSwap-Priority": "interactive"},
    )
    pieces, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    text = "".join(pieces)
    assert chunks > 10, chunks  # token by token, not one buffered answer
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 48 and usage.prompt_tokens > 0
    assert PRINTABLE.fullmatch(text) and len(text.split()) >= 10, text

    # The same request, not streamed: the same words (greedy sampling).
    whole = client.chat.completions.create(
        model="tiny-a",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=48,
        temperature=0,
    )
    assert whole.choices[0].message.content == text
    assert swap.running() == [{"model": "tiny-a", "state": "ready", "lane": "default"}]
    [(_, cmdline)] = swap.processes("tiny-a")
    assert "--parallel 1" in cmdline


def test_swap_between_two_models(llamaswap):
    # Two different weight files, started with different flags.
    swap = llamaswap(
        {
            "tiny-a": ["tiny-a", "-c", "2048", "--parallel", "1"],
            "tiny-b": ["tiny-b", "-c", "1024", "--parallel", "2"],
        }
    )

    def props(model: str) -> dict:
        r = httpx.get(f"{swap.url}/upstream/{model}/props", timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    a1 = ask(swap.url, "tiny-a")
    assert swap.running() == [{"model": "tiny-a", "state": "ready", "lane": "default"}]
    [(pid_a1, _)] = swap.processes("tiny-a")
    assert swap.processes("tiny-b") == []
    assert props("tiny-a")["model_path"] == str(swap.model("tiny-a"))

    b = ask(swap.url, "tiny-b")
    assert swap.running() == [{"model": "tiny-b", "state": "ready", "lane": "default"}]
    # The old model was stopped before the new one started: one llama-server at a time.
    assert swap.processes("tiny-a") == []
    assert len(swap.processes("tiny-b")) == 1
    b_props = props("tiny-b")
    assert b_props["model_path"] == str(swap.model("tiny-b"))
    assert b_props["total_slots"] == 2

    a2 = ask(swap.url, "tiny-a")
    assert swap.running() == [{"model": "tiny-a", "state": "ready", "lane": "default"}]
    assert swap.processes("tiny-b") == []
    [(pid_a2, _)] = swap.processes("tiny-a")
    assert pid_a2 != pid_a1  # a new process, loaded again
    assert a1 != b  # other weights, other words
    assert a2 == a1  # the same weights, the same words

    rows = sorted(swap.activity(5).values(), key=lambda r: r["dispatched_at"])
    chats = [r for r in rows if r["path"] == "/v1/chat/completions"]
    assert [r["model"] for r in chats] == ["tiny-a", "tiny-b", "tiny-a"]
    assert all(r["swapped"] and r["load_ms"] > 0 for r in chats), chats


def test_priority_order_under_load(llamaswap):
    swap = llamaswap({"tiny-a": ["tiny-a", *FLAGS]})
    ask(swap.url, "tiny-a")  # loaded: the blocker below holds the model, not a load
    queued = [  # (tag, header), sent in this order while the blocker runs
        ("batch", "batch"),
        ("normal-1", None),
        ("batch-max", "-98"),
        ("interactive", "interactive"),
        ("normal-pro", "+1"),
        ("normal-2", "0"),
    ]
    expected = ["blocker", "interactive", "normal-pro", "normal-1", "normal-2", "batch-max"]
    expected.append("batch")

    async def post(client, tag, max_tokens, priority):
        headers = {"X-LlamaSwap-Priority": priority} if priority is not None else {}
        r = await client.post(
            swap.url + "/v1/chat/completions",
            json=body("tiny-a", f"request {tag}", max_tokens),
            headers=headers,
        )
        return tag, r, time.monotonic()

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(post(client, "blocker", LONG, None))]
            await asyncio.to_thread(swap.server.wait_running)
            for n, (tag, priority) in enumerate(queued, 1):
                tasks.append(asyncio.create_task(post(client, tag, 8, priority)))
                # Arrival order decides ties: send one at a time.
                await asyncio.to_thread(swap.server.wait_queue, n)
            return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    for tag, r, _ in results:
        assert r.status_code == 200, (tag, r.text)
    tokens = {tag: r.json()["usage"]["completion_tokens"] for tag, r, _ in results}
    assert tokens == {"blocker": LONG, **{tag: 8 for tag, _ in queued}}

    # Served in priority order: by the answers' arrival here...
    assert [tag for tag, _, done in sorted(results, key=lambda x: x[2])] == expected
    # ...and by the dispatch times in the activity log.
    ids = {r.headers["x-llamaswap-request-id"]: tag for tag, r, _ in results}
    rows = [row for rid, row in swap.activity(len(results) + 1).items() if rid in ids]
    rows.sort(key=lambda row: when(row["dispatched_at"]))
    assert [ids[row["request_id"]] for row in rows] == expected
    blocker = rows[0]
    assert all(when(row["arrived_at"]) < when(blocker["finished_at"]) for row in rows)
    # One at a time: each started after the previous one finished.
    for before, after in zip(rows, rows[1:], strict=False):
        assert when(after["dispatched_at"]) >= when(before["finished_at"]), (before, after)
    assert [row["band"] for row in rows] == [
        "normal",
        "interactive",
        "normal",
        "normal",
        "normal",
        "batch",
        "batch",
    ]


def test_four_concurrent_streams_on_a_parallel_4_model(llamaswap):
    # /slots is an operator endpoint: upstream.allowPaths must name it (not in the default).
    allow = {"upstream": {"allowPaths": ["^/props$", "^/slots$", "^/v1/"]}}
    swap = llamaswap({"tiny-p": ["tiny-a", "-c", "2048", "--parallel", "4"]}, allow)
    r = httpx.get(swap.url + "/upstream/tiny-p/props", timeout=60)
    assert r.status_code == 200 and r.json()["total_slots"] == 4, r.text
    slots = httpx.get(swap.url + "/upstream/tiny-p/slots", timeout=60)
    assert slots.status_code == 200 and len(slots.json()) == 4, slots.text

    async def scenario():
        async with AsyncOpenAI(
            base_url=swap.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(stream(client, "tiny-p", n, 64) for n in range(4)))

    results = asyncio.run(scenario())
    for text, finish, usage in results:
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 64
        assert PRINTABLE.fullmatch(text) and len(text.split()) >= 10, text

    rows = [r for r in swap.activity(6).values() if r["path"] == "/v1/chat/completions"]
    assert len(rows) == 4 and all(r["outcome"] == "completed" for r in rows), rows
    assert all(r["output_tokens"] == 64 for r in rows), rows
    # The serial scheduler (the default) runs one request at a time, whatever the model's
    # slots: the four streams were served one after another.
    rows.sort(key=lambda row: when(row["dispatched_at"]))
    for before, after in zip(rows, rows[1:], strict=False):
        assert when(after["dispatched_at"]) >= when(before["finished_at"]), (before, after)


def test_slots_4_on_a_parallel_4_model_serves_four_streams_at_once(llamaswap):
    swap = llamaswap(
        {"tiny-p": ["tiny-a", "-c", "2048", "--parallel", "4"]}, keys={"tiny-p": {"slots": 4}}
    )

    async def scenario():
        async with AsyncOpenAI(
            base_url=swap.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            await stream(client, "tiny-p", -1, 400)  # load the model first: the four then start together
            return await asyncio.gather(*(stream(client, "tiny-p", n, 400) for n in range(4)))

    results = asyncio.run(scenario())
    for text, finish, usage in results:
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 400
        assert PRINTABLE.fullmatch(text), text
    rows = [r for r in swap.activity(5).values() if r["path"] == "/v1/chat/completions"]
    rows = sorted(rows, key=lambda row: when(row["arrived_at"]))[1:]
    assert len(rows) == 4 and all(r["outcome"] == "completed" for r in rows), rows
    # slots: 4 on a --parallel 4 server: all four were dispatched before any finished,
    # i.e. llama-server's four slots decoded them side by side.
    first_end = min(when(r["finished_at"]) for r in rows)
    assert all(when(r["dispatched_at"]) < first_end for r in rows), rows


def test_sigterm_finishes_the_running_stream_and_leaves_no_process(llamaswap):
    swap = llamaswap({"tiny-a": ["tiny-a", *FLAGS]}, grace=60)
    ask(swap.url, "tiny-a")
    [(pid, cmdline)] = swap.processes("tiny-a")
    port = int(cmdline.split("--port ")[1].split()[0])

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:

            async def stream():
                events = []
                async with client.stream(
                    "POST",
                    swap.url + "/v1/chat/completions",
                    json=body("tiny-a", "a long stream", LONG, stream=True),
                ) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                return events

            running = asyncio.create_task(stream())
            await asyncio.to_thread(swap.server.wait_running)
            waiting = asyncio.create_task(
                client.post(swap.url + "/v1/chat/completions", json=body("tiny-a", "late", 8))
            )
            await asyncio.to_thread(swap.server.wait_queue, 1)
            code = await asyncio.to_thread(swap.terminate)
            return code, await running, await waiting

    code, events, waiting = asyncio.run(scenario())
    assert code == 0, swap.server.log()
    # The running stream was given its grace period and ended properly...
    assert events[-1] == "[DONE]"
    assert '"finish_reason":"length"' in events[-2].replace(" ", "")
    # ...the waiting request was refused...
    assert waiting.status_code == 503, waiting.text
    assert waiting.json()["error"]["code"] == "shutting_down"
    # ...and no llama-server is left, nor anything on its port.
    assert swap.processes() == []
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
