"""llama-swap's web-UI API through a real server: /running's records, /api/version,
cancelling a waiting and a running request (POST /api/inflight/{id}/cancel)."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from pathlib import Path

import httpx
import pytest

from proxy.uiapi import shown_cmd
from scheduler.config import ModelConfig
from tests.server import chat, fake_model, fake_requests, free_port_block, serve

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uiapi")
    port = free_port_block(2)
    models = {
        "slow": fake_model(port, name="Slow", description="d", ttl=300),
        "claude": {
            "cmd": f"{sys.executable} {ROOT / 'tests' / 'anthropic_model.py'} {port + 1}",
            "proxy": f"http://127.0.0.1:{port + 1}",
        },
    }
    with serve(tmp, models, {"captureBuffer": 1}, migrate=True) as srv:
        srv.port_of_slow = port
        yield srv


def activity_of(server, request_id: str) -> dict:
    """The activity row of ``request_id`` (written a moment after the answer)."""
    deadline = time.monotonic() + 10
    while True:
        rows = httpx.get(server.url + "/api/metrics/activity", timeout=5).json()["data"]
        found = [row for row in rows if row["request_id"] == request_id]
        if found:
            return found[0]
        assert time.monotonic() < deadline, rows
        time.sleep(0.05)


def test_running_has_llama_swaps_fields(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("slow"), timeout=20)
    assert r.status_code == 200, r.text
    [record] = httpx.get(server.url + "/running", timeout=5).json()["running"]
    assert record["model"] == "slow" and record["state"] == "ready"
    assert record["name"] == "Slow" and record["description"] == "d" and record["ttl"] == 300
    assert record["proxy"].startswith("http://127.0.0.1:")
    assert "-m fakellm" in record["cmd"] and record["lane"] == "default"


def test_version(server):
    r = httpx.get(server.url + "/api/version", timeout=5)
    assert r.status_code == 200
    assert set(r.json()) == {"version", "commit", "build_date"}


def test_cancel_a_waiting_then_a_running_request(server):
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            slow = chat("slow", stream=True, fake_tokens=400, fake_tokens_per_second=40)
            async with client.stream("POST", "/v1/chat/completions", json=slow) as streaming:
                assert streaming.status_code == 200
                running_id = streaming.headers["X-LlamaSwap-Request-Id"]
                waiting = asyncio.create_task(
                    client.post("/v1/chat/completions", json=chat("slow"))
                )
                state = await asyncio.to_thread(server.wait_queue, 1)
                waiting_id = state["waiting"][0]["request_id"]

                r = await client.post(f"/api/inflight/{waiting_id}/cancel")
                assert r.status_code == 200 and r.json() == {"msg": "ok", "was": "waiting"}
                answer = await waiting
                assert answer.status_code == 499
                assert answer.json()["error"]["code"] == "request_cancelled"

                r = await client.post(f"/api/inflight/{running_id}/cancel")
                assert r.status_code == 200 and r.json() == {"msg": "ok", "was": "running"}
                body = b"".join([chunk async for chunk in streaming.aiter_raw()])
                assert b"[DONE]" not in body  # cut, as a stream whose model stopped

            r = await client.post(f"/api/inflight/{running_id}/cancel")
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "request_not_found"
            # The GPU is free again: the next request is answered at once.
            r = await client.post("/v1/chat/completions", json=chat("slow"))
            assert r.status_code == 200

    asyncio.run(scenario())
    state = server.queue()
    assert state["depth"] == 0 and state["running"] == []


def test_cancel_needs_post(server):
    r = httpx.get(server.url + "/api/inflight/x/cancel", timeout=5)
    assert r.status_code == 405


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (
            ("llama-server", "--api-key", "sk-1", "-m", "x.gguf"),
            "llama-server --api-key '***' -m x.gguf",
        ),
        (
            ("srv", "--hf-token=hf_1", "--tokens-per-second", "9"),
            "srv '--hf-token=***' --tokens-per-second 9",
        ),
        (("srv", "--port", "80", "--password"), "srv --port 80 --password"),
        (("srv", "-m", "a b.gguf"), "srv -m 'a b.gguf'"),
    ],
)
def test_running_hides_credentials_in_the_command(argv, shown):
    assert shown_cmd(ModelConfig(id="x", cmd=argv, proxy="http://127.0.0.1:1")) == shown


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_token_accounting_of_anthropic_and_responses_shapes(server, path, stream):
    body = {"model": "claude", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + path, json=body, timeout=20)
    assert r.status_code == 200, r.text
    row = activity_of(server, r.headers["X-LlamaSwap-Request-Id"])
    tokens = row["tokens"]
    assert (tokens["input_tokens"], tokens["output_tokens"], tokens["cache_tokens"]) == (21, 5, 8)
    assert (row["input_tokens"], row["output_tokens"]) == (21, 5)  # our flat fields too


def test_activity_in_llama_swaps_shape_with_a_capture(server):
    body = chat("slow", fake_tokens=3)
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": "Bearer sk-not-kept"},
        timeout=20,
    )
    assert r.status_code == 200
    row = activity_of(server, r.headers["X-LlamaSwap-Request-Id"])
    assert row["req_path"] == "/v1/chat/completions" and row["resp_status_code"] == 200
    assert row["tokens"]["output_tokens"] == 3 and row["tokens"]["draft_tokens"] == -1
    assert row["has_capture"] is True
    page = httpx.get(
        server.url + "/api/metrics/activity",
        params=[("model", "slow"), ("model", "claude"), ("sort", "id"), ("order", "asc")],
        timeout=5,
    ).json()
    assert {"data", "page", "limit", "total", "total_pages"} <= set(page)
    ids = [r["id"] for r in page["data"]]
    assert ids == sorted(ids) and row["id"] in ids
    only = httpx.get(
        server.url + "/api/metrics/activity", params={"min_id": row["id"], "max_id": row["id"]}
    ).json()["data"]
    assert [r["id"] for r in only] == [row["id"]]
    bad = httpx.get(server.url + "/api/metrics/activity", params={"sort": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sort"

    captured = httpx.get(server.url + f"/api/captures/{row['id']}", timeout=5).json()
    assert captured["id"] == row["id"] and captured["req_path"] == "/v1/chat/completions"
    assert json.loads(base64.b64decode(captured["req_body"])) == body
    answer = json.loads(base64.b64decode(captured["resp_body"]))
    assert answer["choices"][0]["message"] == r.json()["choices"][0]["message"]
    assert captured["req_headers"]["authorization"] == "[REDACTED]"
    assert "sk-not-kept" not in json.dumps(captured)
    missing = httpx.get(server.url + "/api/captures/999999", timeout=5)
    assert missing.status_code == 404


def test_a_streamed_answer_is_captured_whole(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json=chat("slow", stream=True, fake_tokens=5),
        timeout=20,
    )
    request_id = r.headers["X-LlamaSwap-Request-Id"]
    captured = httpx.get(server.url + f"/api/captures/{request_id}", timeout=5).json()
    assert base64.b64decode(captured["resp_body"]) == r.content


@pytest.mark.parametrize(
    ("method", "path", "reaches"),
    [
        ("POST", "/v1/messages/count_tokens", "/v1/messages/count_tokens"),
        ("POST", "/v/chat/completions", "/chat/completions"),
        ("POST", "/v/messages/count_tokens", "/messages/count_tokens"),
        ("POST", "/audioapi/v1/tasks/run", "/v1/tasks/run"),
        ("POST", "/sdapi/v1/txt2img", "/sdapi/v1/txt2img"),
        ("POST", "/v1/audio/voices", "/v1/audio/voices"),
        ("GET", "/v1/audio/voices?model=slow", "/v1/audio/voices"),
        ("GET", "/props?model=slow", "/props"),
        ("GET", "/sdapi/v1/loras?model=slow", "/sdapi/v1/loras"),
    ],
)
def test_llama_swaps_other_routes_reach_the_model(server, method, path, reaches):
    body = {"model": "slow", "prompt": "x"} if method == "POST" else None
    r = httpx.request(method, server.url + path, json=body, timeout=20)
    assert r.headers.get("X-LlamaSwap-Request-Id"), r.text
    received = fake_requests(server.port_of_slow)[-1]
    assert (received["method"], received["path"]) == (method, reaches)


def test_images_edits_take_the_model_from_the_form(server):
    r = httpx.post(
        server.url + "/v1/images/edits",
        data={"model": "slow", "prompt": "a cat"},
        files={"image": ("a.png", b"\x89PNG....", "image/png")},
        timeout=20,
    )
    assert r.status_code == 200, r.text
    assert fake_requests(server.port_of_slow)[-1]["path"] == "/v1/images/edits"


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("POST", "/props", 405), ("GET", "/v1/messages/count_tokens", 405), ("GET", "/props", 400)],
)
def test_llama_swaps_other_routes_refuse(server, method, path, status):
    r = httpx.request(method, server.url + path, timeout=5)
    assert r.status_code == status
    assert "error" in r.json()


def test_stats_in_llama_swaps_shape(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("slow"), timeout=20)
    activity_of(server, r.headers["X-LlamaSwap-Request-Id"])
    stats = httpx.get(server.url + "/api/metrics/stats", params={"model": "slow"}, timeout=5).json()
    assert set(stats) == {
        "total_requests",
        "total_input_tokens",
        "total_output_tokens",
        "total_cache_tokens",
        "prompt_histogram",
        "gen_histogram",
    }
    assert stats["total_requests"] >= 1 and stats["total_output_tokens"] > 0
    assert set(stats["gen_histogram"]) == {"bins", "min", "max", "binSize", "p50", "p95", "p99"}
    assert sum(stats["gen_histogram"]["bins"]) >= 1
    none = httpx.get(server.url + "/api/metrics/stats", params={"model": "nope"}).json()
    assert none["total_requests"] == 0 and none["gen_histogram"] is None


def test_histogram_as_llama_swap_computes_it():
    from dashboard.api import histogram

    assert histogram([]) is None
    assert histogram([3.0, 3.0]) == {
        "bins": [2],
        "min": 3.0,
        "max": 3.0,
        "binSize": 0,
        "p50": 3.0,
        "p95": 3.0,
        "p99": 3.0,
    }
    h = histogram([float(v) for v in range(1, 11)])  # 10 values: ceil(log2 10) + 1 = 5 bins
    assert h is not None
    assert h["bins"] == [2, 2, 2, 2, 2] and h["binSize"] == pytest.approx(1.8)
    assert h["p50"] == pytest.approx(5.5) and h["p95"] == pytest.approx(9.55)


def test_global_concurrency_limit(tmp_path):
    """globalConcurrencyLimit: 2 in the server (waiting or answered, any model); the third
    is refused at once with 429; once one ends, the next is let in."""
    port = free_port_block(2)
    models = {"a": fake_model(port), "b": fake_model(port + 1)}
    extra = {
        "globalConcurrencyLimit": 2,
        "groups": {"both": {"swap": False, "members": ["a", "b"]}},  # no swap to wait for
    }
    with serve(tmp_path, models, extra) as srv:

        async def scenario():
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
                slow = [
                    asyncio.create_task(
                        client.post("/v1/chat/completions", json=chat(m, fake_delay=1))
                    )
                    for m in ("a", "b")
                ]
                await asyncio.to_thread(
                    srv.wait_for, "both in", lambda s: s["depth"] + len(s["running"]) == 2
                )
                refused = await client.post("/v1/chat/completions", json=chat("a"))
                assert refused.status_code == 429
                assert refused.json()["error"]["code"] == "global_concurrency_limit"
                assert refused.headers["retry-after"] == "1"
                assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
                again = await client.post("/v1/chat/completions", json=chat("b"))
                assert again.status_code == 200

        asyncio.run(scenario())


@pytest.mark.parametrize(
    ("path", "location"),
    [
        ("/upstream", "/ui/models"),
        ("/ui", "/"),
        ("/ui/", "/"),
        ("/ui/models", "/models/"),
        ("/ui/logs", "/dashboard/logs/"),
        ("/ui/activity", "/history/"),
        ("/ui/performance", "/"),
        ("/ui/some/old/page", "/"),
    ],
)
def test_llama_swaps_web_ui_addresses_land_on_the_dashboard(server, path, location):
    r = httpx.get(server.url + path, timeout=5)
    assert r.status_code == 302 and r.headers["location"] == location


def test_hardware_snapshot_in_llama_swaps_shape(server):
    r = httpx.get(server.url + "/api/hardware", timeout=5)
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {
        "schema_version",
        "captured_at",
        "capture",
        "architecture",
        "operating_system",
        "environment",
        "cpu",
        "memory",
        "accelerators",
    }
    import os

    assert body["cpu"]["logical_thread_count"] == os.cpu_count()
    assert body["memory"]["capacity_bytes"] > 0
    assert body["operating_system"]["family"] == "linux"
    assert isinstance(body["accelerators"], list)


def test_performance_says_sampling_is_off(server):
    r = httpx.get(server.url + "/api/performance?after=2020-01-01T00:00:00Z", timeout=5)
    assert r.status_code == 503 and r.json() == {"enabled": False}


def test_cpu_facts_count_sockets_cores_and_threads():
    from proxy.hardware import cpu_facts

    text = "".join(
        f"processor : {i}\nvendor_id : GenuineIntel\nmodel name : Xeon\n"
        f"physical id : {i // 4}\ncore id : {i % 4 // 2}\n\n"
        for i in range(8)
    )
    assert cpu_facts(text) == {
        "vendor": "GenuineIntel",
        "model": "Xeon",
        "socket_count": 2,
        "physical_core_count": 4,
        "logical_thread_count": 8,
    }
