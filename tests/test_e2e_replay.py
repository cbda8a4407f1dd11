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
