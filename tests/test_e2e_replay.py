"""Replay round trip on a run recorded by the real server: ``simulate --from-history``
replays what the activity log holds, and the replay of the settings in effect must
reproduce the recorded waits closely (the error it reports is what this asserts)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.server import ROOT, chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(120)


def test_a_recorded_run_replays_with_a_small_error(tmp_path):
    port = free_port_block(2)
    models = {"a": fake_model(port, load_seconds=0.3), "b": fake_model(port + 1, load_seconds=0.3)}
    with serve(tmp_path, models, migrate=True) as server:

        async def traffic():
            async with httpx.AsyncClient(timeout=30) as client:
                first = asyncio.create_task(
                    client.post(server.url + "/v1/chat/completions", json=chat("a", "first", fake_delay=0.6))
                )
                await asyncio.to_thread(server.wait_running)
                jobs = [first]
                for i, (model, priority) in enumerate(
                    [("b", "batch"), ("a", "normal"), ("b", "interactive"), ("a", "batch"), ("b", "normal")]
                ):
                    jobs.append(
                        asyncio.create_task(
                            client.post(
                                server.url + "/v1/chat/completions",
                                json=chat(model, f"job{i}", fake_delay=0.2),
                                headers={"X-LlamaSwap-Priority": priority},
                            )
                        )
                    )
                    await asyncio.to_thread(server.wait_queue, i + 1)
                return await asyncio.gather(*jobs)

        responses = asyncio.run(traffic())
        assert all(r.status_code == 200 for r in responses)
        deadline = time.monotonic() + 20
        while len(httpx.get(server.url + "/api/metrics/activity", timeout=5).json()["data"]) < 6:
            assert time.monotonic() < deadline, "records not written"
            time.sleep(0.1)
        database = server.database_url
    out = subprocess.run(
        [sys.executable, "manage.py", "simulate", "--from-history", "--json"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["requests"] == 6
    error = report["replay_error"]
    # The replay picks in the recorded order, and each wait is within a tenth of the
    # longest recorded ones. What the replay leaves out (the proxy's own time per job, each
    # load's difference from its model's median load) grows with the waits on a slower or
    # busier machine, so the bound is a share of them, not seconds.
    longest = max(b["recorded"] for b in error["band_p95_seconds"].values())
    assert error["same_order"] == 1.0, report
    assert error["abs_error_max_seconds"] < 0.1 * longest, report


def test_a_run_with_a_group_bounds_and_two_lanes_replays_in_the_same_order(tmp_path):
    # The acceptance of issue 20: the replay drives the dispatcher's own strategies, so a
    # recorded run with a `swap: false` group, maxWait refusals and two lanes comes back
    # pick for pick on each lane, with the same refusals.
    port = free_port_block(4)
    models = {m: fake_model(port + i, load_seconds=0.2) for i, m in enumerate("abcd")}
    extra = {
        "routing": {
            "scheduler": {
                "use": "serial",
                "settings": {
                    "serial": {"lanes": {"gpu0": ["a", "b"], "gpu1": ["c", "d"]}, "maxWait": {"batch": 2.5}}
                },
            },
            "router": {
                "use": "group",
                "settings": {
                    "groups": {
                        "pair": {"swap": False, "members": ["a", "b"]},
                        "solo": {"members": ["c", "d"]},
                    }
                },
            },
        }
    }
    priorities = ["interactive", "normal", "batch", "5", "-5"]
    # gpu0 has ~4 s of work queued behind its blocker: its batch requests expire (2.5 s);
    # gpu1 has ~1 s: its batch requests are served well before their deadline.
    jobs = [("a" if i % 2 else "b", priorities[i % 5], 0.15) for i in range(26)]
    jobs += [("c" if i % 3 else "d", priorities[(i + 2) % 5], 0.05) for i in range(16)]
    with serve(tmp_path, models, extra, migrate=True) as server:

        async def traffic():
            async with httpx.AsyncClient(timeout=60) as client:
                url = server.url + "/v1/chat/completions"
                blockers = [
                    asyncio.create_task(client.post(url, json=chat(m, f"block-{m}", fake_delay=1.2)))
                    for m in ("a", "c")
                ]
                await asyncio.to_thread(server.wait_running, 2)
                sent = []
                for i, (model, priority, delay) in enumerate(jobs):
                    body = chat(model, f"job{i}", fake_delay=delay)
                    headers = {"X-LlamaSwap-Priority": priority}
                    sent.append(asyncio.create_task(client.post(url, json=body, headers=headers)))
                await asyncio.to_thread(server.wait_queue, len(jobs))
                return await asyncio.gather(*blockers, *sent)

        responses = asyncio.run(traffic())
        statuses = [r.status_code for r in responses]
        assert statuses.count(503) >= 3 and set(statuses) == {200, 503}, statuses
        deadline = time.monotonic() + 20
        while len(httpx.get(server.url + "/api/metrics/activity", timeout=5).json()["data"]) < len(responses):
            assert time.monotonic() < deadline, "records not written"
            time.sleep(0.1)
        database = server.database_url
        config = str(server.config_path)
    out = subprocess.run(
        [sys.executable, "manage.py", "simulate", "--from-history", "--json", "--config", config],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout)
    orders = report["orders"]
    assert set(orders["recorded"]) == {"gpu0", "gpu1"}
    assert orders["replayed"] == orders["recorded"], report
    assert report["replay_error"]["same_order"] == 1.0
    refused = report["refused"]
    # Every maxWait expiry a client saw is recorded and replayed as one. (On a loaded machine
    # another 503 can reach a client too, a model slow to start, say: the replay is judged on
    # the refusals the server itself made, which is what its records hold.)
    codes = [r.json()["error"]["code"] for r in responses if r.status_code == 503]
    expired = codes.count("queue_wait_exceeded")
    assert expired >= 3, codes
    assert refused["recorded"] == refused["replayed"] == {"expired": expired}, (refused, codes)
    recorded, replayed = report["results"][0], report["results"][1]
    assert replayed["swaps"] == recorded["swaps"]  # the group kept a and b loaded together
