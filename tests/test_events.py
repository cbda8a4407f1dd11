"""/api/events (proxy/events.py): llama-swap's framing, bounded per-subscriber queues,
nothing built while nobody listens; then the stream through a real server."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from proxy import events
from scheduler.config import Config
from scheduler.runtime import Runtime
from tests.server import chat, fake_model, free_port_block, serve


def parse(raw: bytes) -> list[tuple[str, object]]:
    """(type, payload) of each message of an /api/events body."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block or block.startswith(":"):
            continue
        kind, data = block.split("\n")
        assert kind == "event:message" and data.startswith("data:"), block
        envelope = json.loads(data[5:])
        assert set(envelope) == {"type", "data"} and isinstance(envelope["data"], str)
        out.append((envelope["type"], json.loads(envelope["data"])))
    return out


RT = Runtime(Config(models={}), dispatcher=None, upstreams=None)  # type: ignore[arg-type]
"""The server a bare hub's subscribers are served by (nothing of it is read here)."""


def test_frame_is_llama_swaps_envelope():
    raw = events.frame("profileChanged", {"active": None})
    assert raw == b'event:message\ndata:{"type":"profileChanged","data":"{\\"active\\":null}"}\n\n'
    assert parse(raw) == [("profileChanged", {"active": None})]


def test_a_slow_subscriber_is_dropped_not_waited_for():
    async def scenario():
        hub = events.EventHub()
        slow = hub.subscribe(RT)
        assert slow is not None
        for _ in range(events.QUEUE_SIZE + 5):
            hub.publish(b"x")
        assert slow.dropped and slow.queue.qsize() == events.QUEUE_SIZE
        hub.unsubscribe(slow)
        assert not hub.subscribers

    asyncio.run(scenario())


def test_subscribers_are_bounded():
    hub = events.EventHub()
    subs = [hub.subscribe(RT) for _ in range(events.MAX_SUBSCRIBERS)]
    assert all(subs) and hub.subscribe(RT) is None


def test_nothing_is_built_while_nobody_listens(monkeypatch):
    hub = events.EventHub()
    monkeypatch.setattr(events, "frame", lambda *a: pytest.fail("built a frame"))
    hub.on_enqueue(object())  # type: ignore[arg-type]
    hub.on_finish(object())  # type: ignore[arg-type]
    hub.on_model_state("m", events.ModelState.READY)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("events")
    port = free_port_block(1)
    with serve(tmp, {"m": fake_model(port, name="M")}) as srv:
        yield srv


def test_the_stream_through_a_real_server(server):
    async def scenario():
        seen: list[tuple[str, object]] = []
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as client,
            client.stream("GET", "/api/events") as stream,
        ):
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            assert stream.headers["x-accel-buffering"] == "no"
            chunks = stream.aiter_raw()
            buffer = b""

            async def until(check):
                nonlocal buffer
                deadline = time.monotonic() + 20
                while not check():
                    assert time.monotonic() < deadline, seen
                    buffer += await asyncio.wait_for(chunks.__anext__(), 20)
                    *done, buffer = buffer.split(b"\n\n")
                    for block in done:
                        seen.extend(parse(block + b"\n\n"))

            kinds = ("logData", "modelStatus", "uiConfig", "profileChanged", "inflight")
            await until(lambda: {k for k, _ in seen} >= set(kinds))
            first = dict(reversed(seen))
            [model] = first["modelStatus"]
            assert model["id"] == "m" and model["state"] == "stopped"
            assert set(model) >= {"id", "name", "description", "state", "unlisted", "peerID"}
            assert first["inflight"] == {"operation": "snapshot"}  # Go's omitempty
            assert first["profileChanged"] == {"active": None}
            assert {s["source"] for k, s in seen if k == "logData"} == {"proxy", "upstream"}

            r = await client.post("/v1/chat/completions", json=chat("m"))
            request_id = r.headers["X-LlamaSwap-Request-Id"]

            def saw(op):
                return any(k == "inflight" and p.get("operation") == op for k, p in seen)

            await until(lambda: saw("remove"))
            upsert = next(p for k, p in seen if k == "inflight" and p["operation"] == "upsert")
            assert upsert["request"]["id"] == request_id
            assert upsert["request"]["model"] == "m"
            assert upsert["request"]["req_path"] == "/v1/chat/completions"
            assert ("inflight", {"operation": "remove", "id": request_id}) in seen
            await until(
                lambda: any(k == "modelStatus" and p[0]["state"] == "ready" for k, p in seen)
            )

    asyncio.run(scenario())
