"""fakellm over real loopback HTTP: the simulated model server the end-to-end tests rely on."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.timeout(10)

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "say three words"}]}


async def sse_events(response: httpx.Response) -> list[Any]:
    """The ``data:`` payloads of an event stream, JSON-decoded except ``[DONE]``."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture
async def client():
    async with httpx.AsyncClient(trust_env=False, timeout=5) as c:
        yield c


@pytest.fixture
async def server(fakellm):
    return await fakellm()


async def test_health_is_503_while_loading_then_200(fakellm, client):
    srv = await fakellm("--load-seconds", "0.4")
    async with asyncio.timeout(3):
        first = await client.get(f"{srv.url}/health")
        assert first.status_code == 503
        assert first.json() == {
            "error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}
        }
        # Inference is refused while loading too, as llama-server does.
        assert (await client.post(f"{srv.url}/v1/chat/completions", json=CHAT)).status_code == 503
        while (response := await client.get(f"{srv.url}/health")).status_code != 200:
            await asyncio.sleep(0.05)
        assert response.json() == {"status": "ok"}
        await srv.line_with("model loaded")


async def test_chat_completion_shape(server, client):
    response = await client.post(
        f"{server.url}/v1/chat/completions", json={**CHAT, "max_tokens": 3}
    )
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m1"  # echoes the request's model
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 3
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    timings = body["timings"]
    assert timings["prompt_n"] == 3 and timings["predicted_n"] == 3
    assert set(timings) == {
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
    }


async def test_chat_stream_shape_with_usage(server, client):
    request = {**CHAT, "stream": True, "max_tokens": 4, "stream_options": {"include_usage": True}}
    async with (
        asyncio.timeout(3),
        client.stream("POST", f"{server.url}/v1/chat/completions", json=request) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await sse_events(response)

    assert events[-1] == "[DONE]"
    role, *tokens, final, usage, _ = events
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert len(tokens) == 4
    assert all(t["object"] == "chat.completion.chunk" and t["model"] == "m1" for t in tokens)
    assert "".join(t["choices"][0]["delta"]["content"] for t in tokens).split() == [
        "The",
        "quick",
        "brown",
        "fox",
    ]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["timings"]["predicted_n"] == 4
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


async def test_stream_without_include_usage_has_no_usage_chunk(server, client):
    request = {**CHAT, "stream": True, "fake_tokens": 2}
    async with client.stream("POST", f"{server.url}/v1/chat/completions", json=request) as r:
        events = await sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"  # fake_tokens: a natural stop
    assert not any(isinstance(e, dict) and "usage" in e for e in events)


async def test_text_and_native_completions(server, client):
    text = (
        await client.post(f"{server.url}/v1/completions", json={"prompt": "a b", "max_tokens": 2})
    ).json()
    assert text["object"] == "text_completion"
    assert text["choices"][0]["text"] == "The quick "
    native = (
        await client.post(f"{server.url}/completion", json={"prompt": "a", "n_predict": 1})
    ).json()
    assert native["content"] == "The " and native["stop"] is True
    assert native["timings"]["predicted_n"] == 1


async def test_embeddings(server, client):
    response = await client.post(
        f"{server.url}/v1/embeddings", json={"model": "e", "input": ["a", "b c"]}
    )
    body = response.json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(len(d["embedding"]) == 8 for d in body["data"])
    assert body["data"][0]["embedding"] != body["data"][1]["embedding"]
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    again = await client.post(f"{server.url}/v1/embeddings", json={"input": "a"})
    assert again.json()["data"][0]["embedding"] == body["data"][0]["embedding"]  # deterministic


async def test_fake_delay_holds_the_answer(server, client):
    loop = asyncio.get_running_loop()
    began = loop.time()
    response = await client.post(
        f"{server.url}/v1/chat/completions", json={**CHAT, "fake_delay": 0.3}
    )
    assert response.status_code == 200
    assert 0.3 <= loop.time() - began < 2


async def test_fake_delay_as_header(server, client):
    loop = asyncio.get_running_loop()
    began = loop.time()
    response = await client.post(
        f"{server.url}/v1/chat/completions", json=CHAT, headers={"X-Fake-Delay": "0.2"}
    )
    assert response.status_code == 200
    assert loop.time() - began >= 0.2


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_fake_status_gives_openai_error(server, client, status):
    response = await client.post(
        f"{server.url}/v1/chat/completions", json={**CHAT, "fake_status": status}
    )
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]


async def test_malformed_json_is_400(server, client):
    response = await client.post(
        f"{server.url}/v1/chat/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_crash_after_ends_stream_without_done_and_exits(server, client):
    request = {**CHAT, "stream": True, "fake_tokens": 10, "fake_crash_after": 2}
    events: list[Any] = []
    async with asyncio.timeout(3):
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream(
                "POST", f"{server.url}/v1/chat/completions", json=request
            ) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
        assert await server.proc.wait() == 3
    assert len(events) == 3  # the role chunk and two tokens
    assert "data: [DONE]" not in events


async def test_requests_are_recorded_in_arrival_order(server, client):
    await client.post(f"{server.url}/v1/chat/completions", json={**CHAT, "model": "first"})
    await client.get(f"{server.url}/health")  # health polls are not recorded
    await client.post(f"{server.url}/v1/embeddings", json={"model": "second", "input": "x"})
    records = (await client.get(f"{server.url}/fake/requests")).json()
    assert [(r["path"], r["model"]) for r in records] == [
        ("/v1/chat/completions", "first"),
        ("/v1/embeddings", "second"),
    ]
    assert records[0]["body"]["messages"] == CHAT["messages"]
    assert records[0]["status"] == 200 and records[0]["disconnected"] is False
    assert records[0]["received_at"] <= records[1]["received_at"]
    assert (await client.post(f"{server.url}/fake/reset")).json() == {"ok": True}
    assert (await client.get(f"{server.url}/fake/requests")).json() == []


async def test_record_file_outlives_the_process(fakellm, client, tmp_path):
    path = tmp_path / "requests.jsonl"
    srv = await fakellm("--record-file", str(path))
    await client.post(f"{srv.url}/v1/chat/completions", json={**CHAT, "model": "one"})
    await client.post(f"{srv.url}/v1/completions", json={"model": "two", "prompt": "x"})
    srv.proc.kill()
    await srv.proc.wait()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["seq"], r["path"], r["model"]) for r in lines] == [
        (1, "/v1/chat/completions", "one"),
        (2, "/v1/completions", "two"),
    ]


async def test_client_disconnect_is_recorded(server, client):
    request = {**CHAT, "stream": True, "fake_tokens": 50, "fake_tokens_per_second": 20}
    async with asyncio.timeout(3):
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=request) as r:
            async for line in r.aiter_lines():
                if '"content": "The ' in line:
                    break  # leave after the first token: closes the connection
        while not (records := (await client.get(f"{server.url}/fake/requests")).json())[0][
            "finished_at"
        ]:
            await asyncio.sleep(0.02)
    assert records[0]["disconnected"] is True
    assert records[0]["status"] is None


async def test_models_transcription_and_passthrough(fakellm, client):
    srv = await fakellm("--model-name", "whisper-fake")
    models = (await client.get(f"{srv.url}/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["whisper-fake"]
    response = await client.post(
        f"{srv.url}/v1/audio/transcriptions",
        data={"model": "whisper"},
        files={"file": ("a.wav", b"RIFF0000", "audio/wav")},
    )
    assert response.json() == {"text": "fake transcription of a.wav (8 bytes)"}
    echo = await client.post(f"{srv.url}/v1/rerank", json={"model": "r"})
    assert echo.json() == {"path": "/v1/rerank", "ok": True}
    assert (await client.get(f"{srv.url}/nope")).status_code == 404
    records = (await client.get(f"{srv.url}/fake/requests")).json()
    assert [r["model"] for r in records[1:3]] == ["whisper", "r"]


async def test_keep_alive_and_chunked_request_body(server):
    """Two requests on one raw connection, the first with a chunked body."""
    port = server.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        await writer.drain()
        async with asyncio.timeout(3):
            for expected in (b'"text_completion"', b'"ok"'):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 OK")
                length = int(
                    next(
                        h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
                    ).split(b":")[1]
                )
                assert expected in await reader.readexactly(length)
    finally:
        writer.close()


def test_starts_fast():
    """Start-up stays cheap: the application imports no third-party package, and serving it
    (daphne, Twisted) brings in no Django, Channels or HTTP client."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    watched = "{'django', 'channels', 'httpx', 'aiohttp', 'twisted', 'daphne'}"

    def imported(code: str) -> str:
        code += f"; print(sorted({{m.split('.')[0] for m in sys.modules}} & {watched}))"
        argv = [sys.executable, "-c", "import sys; " + code]
        out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip()

    assert imported("import fakellm.app") == "[]"
    assert imported("import fakellm.app, daphne.server") == "['daphne', 'twisted']"
