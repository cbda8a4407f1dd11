"""The proxy end to end: endpoints, errors, streaming, disconnects, crashes, orphans."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time

import httpx
import openai
import pytest

from tests.server import (
    Server,
    alive,
    chat,
    fake_model,
    fake_requests,
    free_port_block,
    serve,
    sse_events,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("proxy")
    port = free_port_block(3)
    models = {
        "qwen": fake_model(port, aliases=["gpt-4o-mini"], name="Qwen 3"),
        "hidden": fake_model(port + 1, unlisted=True),
        "renamed": fake_model(
            port + 2,
            useModelName="upstream-name",
            filters={"stripParams": "temperature, top_p", "setParams": {"seed": 42}},
        ),
    }
    with serve(tmp, models) as srv:
        srv.ports = {"qwen": port, "hidden": port + 1, "renamed": port + 2}
        yield srv


def test_chat_completion_round_trip(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("qwen"), timeout=20)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] > 0
    assert len(r.headers["X-LlamaSwap-Request-Id"]) == 32


def test_request_ids_are_unique_and_on_errors_too(server):
    ids = {
        httpx.post(server.url + "/v1/chat/completions", json=chat("qwen"), timeout=20).headers[
            "X-LlamaSwap-Request-Id"
        ]
        for _ in range(3)
    }
    bad = httpx.post(server.url + "/v1/chat/completions", content=b"{", timeout=5)
    ids.add(bad.headers["X-LlamaSwap-Request-Id"])
    assert len(ids) == 4


def test_alias_resolves(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("gpt-4o-mini"), timeout=20)
    assert r.status_code == 200
    assert fake_requests(server.ports["qwen"])[-1]["body"]["model"] == "gpt-4o-mini"


def test_use_model_name_and_filters_rewrite_the_body(server):
    body = chat("renamed", temperature=0.1, top_p=0.5, max_tokens=3)
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 200
    sent = fake_requests(server.ports["renamed"])[-1]["body"]
    assert sent["model"] == "upstream-name"
    assert "temperature" not in sent and "top_p" not in sent
    assert sent["seed"] == 42 and sent["max_tokens"] == 3


@pytest.mark.parametrize(
    ("content", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),  # malformed JSON
        (b"[1, 2]", 400, "invalid_json"),  # JSON, but not an object
        (json.dumps({"messages": []}).encode(), 400, "missing_model"),  # no model
        (json.dumps({"model": ""}).encode(), 400, "missing_model"),  # empty model
        (json.dumps({"model": 7}).encode(), 400, "missing_model"),  # model not a string
        (json.dumps(chat("nope")).encode(), 404, "model_not_found"),  # unknown model
    ],
)
def test_bad_requests_get_openai_shaped_errors(server, content, status, code):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=5,
    )
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == code
    assert error["message"] and error["type"] == "invalid_request_error"
    # ...and the server keeps serving everyone else.
    assert httpx.post(server.url + "/v1/chat/completions", json=chat("qwen"), timeout=20).status_code == 200


def test_upstream_error_status_passes_through(server):
    r = httpx.post(
        server.url + "/v1/chat/completions", json=chat("qwen", fake_status=418), timeout=20
    )
    assert r.status_code == 418
    assert "error" in r.json()


def test_models_list_hides_unlisted(server):
    r = httpx.get(server.url + "/v1/models", timeout=5)
    ids = [m["id"] for m in r.json()["data"]]
    assert ids == ["qwen", "renamed"]
    assert r.json()["object"] == "list"


def test_upstream_passthrough_loads_the_model_from_the_path(server):
    r = httpx.post(server.url + "/upstream/qwen/tokenize", json={"x": 1}, timeout=20)
    assert r.status_code == 200
    assert r.json()["path"] == "/tokenize"  # a native route upstream.allowPaths lets through
    [running] = httpx.get(server.url + "/running", timeout=5).json()["running"]
    assert (running["model"], running["state"], running["lane"]) == ("qwen", "ready", "default")
    assert running["name"] == "Qwen 3"  # and llama-swap's other keys (test_llamaswap_diff)


def test_unload_stops_every_model_process(server):
    httpx.post(server.url + "/v1/chat/completions", json=chat("qwen"), timeout=20)
    assert server.children()
    r = httpx.post(server.url + "/api/models/unload", timeout=20)
    assert r.status_code == 200
    assert httpx.get(server.url + "/running", timeout=5).json()["running"] == []
    # The process is gone by the time unload answers.
    assert not [p for p in server.children() if alive(p)]


def test_logs_show_model_output(server):
    httpx.post(server.url + "/v1/chat/completions", json=chat("qwen"), timeout=20)
    r = httpx.get(server.url + "/logs", timeout=5)
    assert r.status_code == 200
    assert "qwen" in r.text


def test_logs_stream_sends_history_then_live_lines(server):
    httpx.post(server.url + "/v1/chat/completions", json=chat("qwen"), timeout=20)
    with httpx.stream("GET", server.url + "/logs/stream", timeout=10) as r:
        assert r.status_code == 200
        first = next(r.iter_bytes())
    assert b"qwen" in first  # history first
    with httpx.stream("GET", server.url + "/logs/stream?no-history", timeout=10) as r:
        httpx.post(server.url + "/api/models/unload", timeout=20)
        httpx.post(server.url + "/v1/chat/completions", json=chat("qwen"), timeout=20)
        live = next(r.iter_bytes())  # a new line from the restarted model
    assert b"qwen" in live


def test_multipart_transcription_takes_the_model_from_the_form(server):
    r = httpx.post(
        server.url + "/v1/audio/transcriptions",
        data={"model": "qwen"},
        files={"file": ("a.wav", b"RIFF....", "audio/wav")},
        timeout=20,
    )
    assert r.status_code == 200
    assert "text" in r.json()
    assert fake_requests(server.ports["qwen"])[-1]["path"] == "/v1/audio/transcriptions"


def test_streaming_passes_through_chunk_by_chunk(server):
    body = chat("qwen", stream=True, fake_tokens=5)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=20) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        text = "".join(r.iter_text())
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert len(events) >= 6


def test_openai_client_streaming_and_not(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    headers = {"X-LlamaSwap-Priority": "interactive"}
    reply = client.chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": "hi"}], extra_headers=headers
    )
    assert reply.choices[0].message.content
    stream = client.chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        extra_headers=headers,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces)


# -- failures, disconnects, orphans: one server each -----------------------------------


def test_disconnect_while_queued_is_never_dispatched(tmp_path):
    port = free_port_block(1)
    with serve(tmp_path, {"m": fake_model(port)}) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                blocker = asyncio.create_task(
                    client.post(server.url + "/v1/chat/completions", json=chat("m", "blocker", fake_delay=1.5))
                )
                await asyncio.to_thread(server.wait_running)
                async with httpx.AsyncClient(timeout=30) as leaver:
                    gone = asyncio.create_task(
                        leaver.post(server.url + "/v1/chat/completions", json=chat("m", "gone"))
                    )
                    await asyncio.to_thread(server.wait_queue, 1)
                    gone.cancel()
                # The queue forgets it as soon as the connection closes.
                await asyncio.to_thread(server.wait_depth, 0)
                after = await client.post(server.url + "/v1/chat/completions", json=chat("m", "after"))
                return await blocker, after

        blocker, after = asyncio.run(scenario())
        assert blocker.status_code == after.status_code == 200
        tags = [r["body"]["messages"][0]["content"] for r in fake_requests(port)]
        assert tags == ["blocker", "after"]


def test_disconnect_while_streaming_starts_the_next_job_at_once(tmp_path):
    port = free_port_block(1)
    with serve(tmp_path, {"m": fake_model(port)}) as server:

        async def scenario():
            slow = chat("m", "slow", stream=True, fake_tokens=400, fake_tokens_per_second=20)
            url = server.url + "/v1/chat/completions"
            async with httpx.AsyncClient(timeout=60) as client, httpx.AsyncClient(timeout=60) as leaver:
                async with leaver.stream("POST", url, json=slow) as r:
                    chunks = r.aiter_bytes()
                    await anext(chunks)  # the slow stream is running
                    nxt = asyncio.create_task(client.post(url, json=chat("m", "next")))
                    await asyncio.to_thread(server.wait_queue, 1)
                    await chunks.aclose()
                # The client has left the slow stream.
                left = time.monotonic()
                response = await nxt
                return response, time.monotonic() - left

        response, elapsed = asyncio.run(scenario())
        assert response.status_code == 200
        # The slow stream had ~20 s left; the next job did not wait for it.
        assert elapsed < 10
        records = fake_requests(port)
        assert [r["body"]["messages"][0]["content"] for r in records] == ["slow", "next"]
        # The model stops streaming to nobody: it sees the proxy's connection close at its
        # next token (which a loaded machine may deliver after "next" was answered).
        deadline = time.monotonic() + 10
        while records[0]["finished_at"] is None:
            assert time.monotonic() < deadline, "the model still streams the abandoned answer"
            time.sleep(0.05)
            records = fake_requests(port)
        assert records[0]["disconnected"]


def test_model_crash_mid_stream_ends_with_an_error_event_and_restarts(tmp_path):
    port = free_port_block(1)
    with serve(tmp_path, {"m": fake_model(port)}) as server:
        body = chat("m", stream=True, fake_tokens=50, fake_crash_after=3)
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=20) as r:
            text = "".join(r.iter_text())
        events = sse_events(text)
        assert len(events) >= 2 and "[DONE]" not in events
        # The client is told the answer was cut, not finished (OpenAI's error event).
        assert json.loads(events[-1])["error"]["code"] == "upstream_stream_broken", events[-1]
        again = httpx.post(server.url + "/v1/chat/completions", json=chat("m"), timeout=20)
        assert again.status_code == 200


def test_the_request_queued_behind_a_crash_gets_a_restarted_model_not_a_502(tmp_path):
    # The crashed process's exit may not be reaped when the next request is granted: the
    # refused connection must lead to a restart and one resend, not to a 502.
    port = free_port_block(1)
    with serve(tmp_path, {"m": fake_model(port)}) as server:

        async def scenario():
            url = server.url + "/v1/chat/completions"
            crash = chat("m", "crash", stream=True, fake_tokens=50, fake_tokens_per_second=4, fake_crash_after=6)
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", url, json=crash) as r:
                    chunks = r.aiter_bytes()
                    await anext(chunks)
                    behind = asyncio.create_task(client.post(url, json=chat("m", "behind")))
                    await asyncio.to_thread(server.wait_queue, 1)
                    async for _ in chunks:
                        pass
                return await behind

        behind = asyncio.run(scenario())
        assert behind.status_code == 200, behind.text
        tags = [r["body"]["messages"][0]["content"] for r in fake_requests(port)]
        assert tags[-1] == "behind"


def test_model_that_exits_at_start_fails_with_503_naming_it(tmp_path):
    broken = {"cmd": f"{sys.executable} -c 'import sys; sys.exit(3)'", "proxy": "http://127.0.0.1:9"}
    port = free_port_block(1)
    with serve(tmp_path, {"broken": broken, "ok": fake_model(port)}) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("broken"), timeout=20)
        assert r.status_code == 503
        assert "broken" in r.json()["error"]["message"]
        assert "3" in r.json()["error"]["message"]
        # Everyone else is still served; the next request for it tries again.
        assert httpx.post(server.url + "/v1/chat/completions", json=chat("ok"), timeout=20).status_code == 200
        assert httpx.post(server.url + "/v1/chat/completions", json=chat("broken"), timeout=20).status_code == 503


def test_a_model_that_does_not_answer_is_a_502_and_the_server_goes_on(tmp_path):
    dead_port = free_port_block(2)
    silent = {
        # Runs, but nothing listens where the proxy points; no health check to catch it.
        "cmd": f"{sys.executable} -c 'import time; time.sleep(60)'",
        "proxy": f"http://127.0.0.1:{dead_port}",
        "checkEndpoint": "none",
    }
    with serve(tmp_path, {"silent": silent, "ok": fake_model(dead_port + 1)}) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("silent"), timeout=20)
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "upstream_unavailable"
        assert "silent" in error["message"]
        assert r.headers["X-LlamaSwap-Request-Id"]
        assert httpx.post(server.url + "/v1/chat/completions", json=chat("ok"), timeout=20).status_code == 200


def test_health_check_timeout_fails_with_503(tmp_path):
    port = free_port_block(1)
    never = fake_model(port, load_seconds=600)
    with serve(tmp_path, {"never": never}, {"healthCheckTimeout": 15}) as server:
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("never"), timeout=40)
        assert r.status_code == 503
        assert "never" in r.json()["error"]["message"]
        assert "timed out" in r.json()["error"]["message"]
        assert not [p for p in server.children() if alive(p)]


def test_sigkill_of_the_server_leaves_no_model_process(tmp_path):
    port = free_port_block(1)
    server = Server(tmp_path, {"m": fake_model(port)})
    try:
        server.wait_ready()
        assert httpx.post(server.url + "/v1/chat/completions", json=chat("m"), timeout=20).status_code == 200
        models = server.children()
        assert models
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in models):
            time.sleep(0.05)
        assert not [p for p in models if alive(p)]
    finally:
        server.stop()


def test_sigterm_lets_the_running_request_finish_then_stops_models(tmp_path):
    port = free_port_block(1)
    server = Server(tmp_path, {"m": fake_model(port)}, grace=10)
    try:
        server.wait_ready()

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                running = asyncio.create_task(
                    client.post(server.url + "/v1/chat/completions", json=chat("m", fake_delay=1.0))
                )
                await asyncio.to_thread(server.wait_running)
                models = server.children()
                os.killpg(server.proc.pid, signal.SIGTERM)
                return await running, models

        response, models = asyncio.run(scenario())
        assert response.status_code == 200
        assert server.proc.wait(timeout=15) == 0
        assert not [p for p in models if alive(p)]
    finally:
        server.stop()
