"""A soak through the real server: nothing is lost, nothing is left.

A few hundred requests across two models, some streaming, about a fifth of the clients
leaving at random moments, and one model SIGKILLed in the middle of the run. Afterwards:
one record per request with the outcome its client saw, ``dispatched_total`` equal to the
dispatched records, the dispatcher idle, and no model process left once the server stops.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import Server, alive, chat, fake_model, free_port_block

pytestmark = pytest.mark.timeout(240)

REQUESTS = 240
CONCURRENCY = 24
LEAVERS = 0.2


def all_records(server: Server, count: int, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    rows: list[dict] = []
    while time.monotonic() < deadline:
        r = httpx.get(server.url + "/api/metrics/activity", params={"limit": 1000}, timeout=10)
        rows = r.json()["data"]
        if len(rows) >= count:
            return rows
        time.sleep(0.2)
    return rows


def dispatched_total(server: Server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "llamaswap_scheduler_dispatched":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no llamaswap_scheduler_dispatched_total")


def model_pid(server: Server, port: int) -> int:
    for pid in server.children():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"fakellm" in cmdline and str(port).encode() in cmdline:
            return pid
    raise AssertionError(f"no model process on port {port}")


def test_soak(tmp_path):
    rng = random.Random(8)
    port = free_port_block(2)
    models = {"a": fake_model(port, tps=400), "b": fake_model(port + 1, tps=400)}
    server = Server(tmp_path, models, migrate=True)
    seen: dict[int, dict] = {}  # request number -> what its client saw
    try:
        server.wait_ready()

        async def one(client: httpx.AsyncClient, n: int, killed: asyncio.Event) -> None:
            model = rng.choices("ab", weights=(3, 1))[0]
            stream = rng.random() < 0.5
            leave_after = rng.uniform(0, 0.08) if rng.random() < LEAVERS else None
            priority = rng.choice(["interactive", "normal", "batch", "-7", "42"])
            body = chat(model, f"r{n}", stream=stream, fake_tokens=rng.randint(1, 30))
            view: dict = {"left": False, "id": None, "status": None, "complete": False}
            seen[n] = view

            async def talk() -> None:
                headers = {"X-LlamaSwap-Priority": priority}
                url = server.url + "/v1/chat/completions"
                async with client.stream("POST", url, json=body, headers=headers) as r:
                    view["id"] = r.headers.get("x-llamaswap-request-id")
                    view["status"] = r.status_code
                    text = (await r.aread()).decode()
                    view["complete"] = r.status_code == 200 and (not stream or "[DONE]" in text)

            if leave_after is None:
                await talk()
                return
            # A client that leaves: the whole request is sent (it reached the server and
            # must be recorded), then the connection is closed at a random moment.
            view["left"] = True
            payload = json.dumps(body).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nX-LlamaSwap-Priority: " + priority.encode()
                + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            await writer.drain()
            try:
                async with asyncio.timeout(leave_after):
                    head = await reader.readuntil(b"\r\n\r\n")
                    for line in head.decode().split("\r\n"):
                        if line.lower().startswith("x-llamaswap-request-id:"):
                            view["id"] = line.split(":", 1)[1].strip()
                    await reader.read(rng.randint(1, 400))
                    await asyncio.sleep(leave_after)
            except (TimeoutError, asyncio.IncompleteReadError):
                pass
            writer.close()

        async def run() -> None:
            limits = httpx.Limits(max_connections=CONCURRENCY * 2)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                semaphore = asyncio.Semaphore(CONCURRENCY)
                killed = asyncio.Event()

                async def guarded(n: int) -> None:
                    async with semaphore:
                        await one(client, n, killed)
                        if n == REQUESTS // 2 and not killed.is_set():
                            killed.set()
                            # SIGKILL a model mid-run, as the OOM killer would.
                            for p in (port, port + 1):
                                try:
                                    os.kill(model_pid(server, p), signal.SIGKILL)
                                    break
                                except AssertionError:
                                    continue

                await asyncio.gather(*(guarded(n) for n in range(REQUESTS)))
                assert killed.is_set()

        asyncio.run(run())
        server.children()

        # The dispatcher is idle.
        state = server.wait_for("idle", lambda s: s["depth"] == 0 and not s["running"], timeout=10)
        assert state["depth"] == 0

        # One record per request, with the outcome its client saw.
        unmatched = [view for view in seen.values() if view["id"] is None]
        records = all_records(server, REQUESTS)
        assert len(records) == REQUESTS, (len(unmatched), server.log()[-3000:])
        by_id = {r["request_id"]: r for r in records}
        assert len(by_id) == REQUESTS
        killed_under = 0  # leavers whose model was SIGKILLed under them: in flight then
        for n, view in seen.items():
            if view["id"] is None:
                continue  # left before the answer began: matched by count below
            record = by_id.pop(view["id"])
            outcome = record["outcome"]
            if view["left"]:
                # It left while the answer was on its way: the model may have finished, or
                # been the one SIGKILLed under it (then the server saw the model fail first).
                died = outcome == "failed" and bool(record.get("error_msg"))
                assert outcome in ("cancelled_running", "completed") or died, (n, view, record)
                killed_under += died
            elif view["complete"]:
                assert outcome == "completed", (n, view, outcome)
            else:
                assert outcome == "failed", (n, view, outcome)
        assert killed_under <= CONCURRENCY
        assert all(view["left"] for view in unmatched)
        assert len(by_id) == len(unmatched)
        assert {r["outcome"] for r in by_id.values()} <= {
            "cancelled_waiting",
            "cancelled_running",
            "completed",
        }
        assert sum(v["complete"] for v in seen.values()) > REQUESTS // 2

        # dispatched_total equals the dispatched records.
        dispatched = sum(1 for r in records if r["dispatched_at"] is not None)
        assert dispatched_total(server) == dispatched

        # No model process is left once the server has stopped.
        pids = server.children() | server.model_pids
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(timeout=20)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.05)
        assert not [pid for pid in pids if alive(pid)]
    finally:
        server.stop()
        if os.environ.get("SOAK_LOG"):
            print(server.log())
