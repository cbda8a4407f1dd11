"""/metrics and the activity log end to end: the real server, real model processes.

Known traffic goes in (including one reorder made by affinity and one made by aging),
then /metrics is parsed with prometheus_client's own parser and the activity API is read.
Each test has its own server and a migrated SQLite file in its tmp dir.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server import chat, fake_model, fake_requests, free_port_block, serve

pytestmark = pytest.mark.timeout(90)

BANDS = ("interactive", "normal", "batch")
TERMS = ("aging", "swap_affinity", "aging_cap", "band_share")
SPEC_METRICS = {
    # family name (the parser strips a counter's _total) -> type, sample names
    "llamaswap_scheduler_queue_depth": ("gauge", {"llamaswap_scheduler_queue_depth"}),
    "llamaswap_scheduler_queue_oldest_wait_seconds": (
        "gauge",
        {"llamaswap_scheduler_queue_oldest_wait_seconds"},
    ),
    "llamaswap_scheduler_dispatched": ("counter", {"llamaswap_scheduler_dispatched_total"}),
    "llamaswap_scheduler_reorders": ("counter", {"llamaswap_scheduler_reorders_total"}),
}


def sqlite_url(tmp_path) -> dict:
    # Explicit, so a DATABASE_URL in the environment (the PostgreSQL pass) is not used.
    return {"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}


def scrape(server) -> dict:
    r = httpx.get(server.url + "/metrics", timeout=5)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def values(family, name: str | None = None) -> dict[tuple, float]:
    """{label values: value} of a family's samples named ``name`` (default: the family's)."""
    out = {}
    for s in family.samples:
        if name is None or s.name == name:
            out[tuple(sorted(s.labels.items()))] = s.value
    return out


def activity(server, **params) -> dict:
    r = httpx.get(server.url + "/api/metrics/activity", params=params, timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def wait_rows(server, count: int, timeout: float = 15, **params) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = activity(server, **params)["data"]
        if len(rows) >= count:
            return rows
        time.sleep(0.1)
    raise AssertionError(f"never {count} activity rows: {activity(server, **params)}")


async def post(client, server, body, priority=None):
    headers = {"X-LlamaSwap-Priority": priority} if priority is not None else {}
    return await client.post(server.url + "/v1/chat/completions", json=body, headers=headers)


def tag(record: dict) -> str:
    return record["body"]["messages"][0]["content"]


def test_metrics_and_activity_after_known_traffic(tmp_path):
    port = free_port_block(2)
    models = {"a": fake_model(port), "b": fake_model(port + 1)}
    # 1 point of aging per 5 ms: a batch job that waited 0.7 s longer (140 points) beats
    # normal work; the affinity bonus of 90 outweighs up to 0.45 s of arrival difference.
    scheduler = {
        "routing": {
            "scheduler": {
                "use": "serial",
                "settings": {"serial": {"agingDivisor": 0.005, "swapAffinityBonus": 90}},
            }
        }
    }
    with serve(tmp_path, models, scheduler, migrate=True, environ=sqlite_url(tmp_path)) as server:
        families = scrape(server)  # before any traffic: every series present, at zero
        for name, (_, samples) in SPEC_METRICS.items():
            [sample_name] = samples
            series = values(families[name], sample_name)
            assert len(series) == (3 * len(TERMS) if "reorders" in name else 3)
            assert set(series.values()) == {0.0}

        async def traffic():
            async with httpx.AsyncClient(timeout=30) as client:
                # Affinity: 'a' is loaded; 'b' arrives first, then 'a' (same priority).
                blocker = asyncio.create_task(
                    post(client, server, chat("a", "blocker-1", fake_delay=1.0))
                )
                await asyncio.to_thread(server.wait_running)
                first_b = asyncio.create_task(post(client, server, chat("b", "b-first")))
                await asyncio.to_thread(server.wait_queue, 1)
                then_a = asyncio.create_task(post(client, server, chat("a", "a-then")))
                await asyncio.to_thread(server.wait_queue, 2)
                await asyncio.gather(blocker, first_b, then_a)
                # Aging: a batch job waits 0.7 s longer than a normal one, same model.
                blocker = asyncio.create_task(
                    post(client, server, chat("a", "blocker-2", fake_delay=1.6), "interactive")
                )
                await asyncio.to_thread(server.wait_running)
                batch = asyncio.create_task(post(client, server, chat("a", "batch-old"), "batch"))
                await asyncio.to_thread(server.wait_queue, 1)
                await asyncio.sleep(0.7)
                normal = asyncio.create_task(post(client, server, chat("a", "normal-new")))
                await asyncio.to_thread(server.wait_queue, 2)
                # And a stream that reports usage and timings at its end.
                responses = await asyncio.gather(blocker, batch, normal)
                stream = await post(
                    client,
                    server,
                    chat("a", "stream", stream=True, stream_options={"include_usage": True}),
                    "interactive",
                )
                return [*responses, stream]

        responses = asyncio.run(traffic())
        assert all(r.status_code == 200 for r in responses)
        # Model 'a' was restarted after 'b' ran: its server saw the second scenario only.
        assert [tag(r) for r in fake_requests(port)] == [
            "blocker-2",
            "batch-old",
            "normal-new",
            "stream",
        ]

        families = scrape(server)
        for name, (kind, samples) in SPEC_METRICS.items():
            family = families[name]
            assert family.type == kind
            assert family.documentation  # HELP
            assert samples <= {s.name for s in family.samples}
        # Every band, and every band x term, always present.
        for name in (
            "llamaswap_scheduler_queue_depth",
            "llamaswap_scheduler_queue_oldest_wait_seconds",
        ):
            assert values(families[name]) == {(("band", b),): 0.0 for b in BANDS}
        dispatched = values(
            families["llamaswap_scheduler_dispatched"], "llamaswap_scheduler_dispatched_total"
        )
        assert dispatched == {
            (("band", "interactive"),): 2.0,  # blocker-2, stream
            (("band", "normal"),): 4.0,  # blocker-1, a-then, b-first, normal-new
            (("band", "batch"),): 1.0,  # batch-old
        }
        reorders = values(
            families["llamaswap_scheduler_reorders"], "llamaswap_scheduler_reorders_total"
        )
        expected = {(("band", b), ("term", t)): 0.0 for b in BANDS for t in TERMS}
        expected[(("band", "normal"), ("term", "swap_affinity"))] = 1.0  # a-then over b-first
        expected[(("band", "batch"), ("term", "aging"))] = 1.0  # batch-old over normal-new
        assert reorders == expected
        # The rest: swaps and loads per model, durations by band, dropped records, and
        # django-prometheus' own families.
        swaps = values(families["llamaswap_model_swaps"], "llamaswap_model_swaps_total")
        assert swaps == {(("model", "a"),): 2.0, (("model", "b"),): 1.0}  # a, b, a again
        loads = values(
            families["llamaswap_model_load_duration_seconds"],
            "llamaswap_model_load_duration_seconds_count",
        )
        assert loads == {(("model", "a"),): 2.0, (("model", "b"),): 1.0}
        durations = families["llamaswap_request_duration_seconds"]
        counts = values(durations, "llamaswap_request_duration_seconds_count")
        assert counts[(("band", "interactive"), ("outcome", "completed"))] == 2.0
        assert counts[(("band", "normal"), ("outcome", "completed"))] == 4.0
        sums = values(durations, "llamaswap_request_duration_seconds_sum")
        blocker_hold = 1.6
        assert sums[(("band", "interactive"), ("outcome", "completed"))] > blocker_hold
        assert families["llamaswap_activity_records_dropped"].type == "counter"
        assert any(name.startswith("django_") for name in families)

        # The activity log: every request, with the spec's keys.
        rows = wait_rows(server, 7)
        # Scenario one by dispatch order: the later 'a' request went before the earlier 'b'.
        first_three = sorted(rows, key=lambda r: r["dispatched_at"])[:3]
        assert [r["model"] for r in first_three] == ["a", "a", "b"]
        assert first_three[2]["arrived_at"] < first_three[1]["arrived_at"]
        batch_row = next(r for r in rows if r["band"] == "batch")
        meta = batch_row["metadata"]
        assert set(meta) == {
            "serial_priority",
            "serial_band",
            "serial_score",
            "serial_queue_wait_ms",
        }
        assert meta["serial_priority"] == -100 and meta["serial_band"] == "batch"
        assert isinstance(meta["serial_priority"], int) and isinstance(meta["serial_band"], str)
        assert isinstance(meta["serial_score"], float) and isinstance(
            meta["serial_queue_wait_ms"], float
        )
        # Waited from its arrival until blocker-2 finished (~1.6 s after that started);
        # score = priority + affinity (its model was loaded) + wait / agingDivisor.
        assert 1000 < meta["serial_queue_wait_ms"] < 10_000
        assert meta["serial_score"] == pytest.approx(
            -100 + 90 + meta["serial_queue_wait_ms"] / 1000 / 0.005, abs=0.5
        )
        # The normal request that lost to it: its wait is explained by the batch job's score.
        normal_row = next(
            r for r in rows if r["band"] == "normal" and r["arrived_at"] > batch_row["arrived_at"]
        )
        detail = httpx.get(
            server.url + f"/api/requests/{normal_row['request_id']}", timeout=5
        ).json()
        assert [w["request_id"] for w in detail["dispatched_while_waiting"]] == [
            batch_row["request_id"]
        ]
        assert detail["dispatched_while_waiting"][0]["score"] == meta["serial_score"]
        assert detail["dispatched_while_waiting"][0]["reordered_by"] == ["aging"]
        assert [w["band"] for w in detail["running_at_arrival"]] == ["interactive"]
        # The stream's usage and timings were read from its last events.
        stream_row = rows[0]
        assert stream_row["band"] == "interactive" and stream_row["output_tokens"] > 0
        assert stream_row["tokens_per_second"] > 0
        assert activity(server, band="batch")["total"] == 1
        assert activity(server, model="b")["total"] == 1


def test_cancelled_while_waiting_is_recorded(tmp_path):
    port = free_port_block(1)
    with serve(
        tmp_path, {"m": fake_model(port)}, migrate=True, environ=sqlite_url(tmp_path)
    ) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                blocker = asyncio.create_task(
                    post(client, server, chat("m", "blocker", fake_delay=1.0))
                )
                await asyncio.to_thread(server.wait_running)
                async with httpx.AsyncClient(timeout=30) as leaver:
                    gone = asyncio.create_task(post(leaver, server, chat("m", "gone"), "batch"))
                    await asyncio.to_thread(server.wait_queue, 1)
                    gone.cancel()
                await asyncio.to_thread(server.wait_depth, 0)
                return await blocker

        assert asyncio.run(scenario()).status_code == 200
        rows = wait_rows(server, 2)
        gone = next(r for r in rows if r["outcome"] == "cancelled_waiting")
        assert gone["band"] == "batch" and gone["dispatched_at"] is None and gone["status"] is None
        assert gone["metadata"] == {"serial_priority": -100, "serial_band": "batch"}
        detail = httpx.get(server.url + f"/api/requests/{gone['request_id']}", timeout=5).json()
        assert detail["outcome"] == "cancelled_waiting" and detail["decision"] is None
        families = scrape(server)
        counts = values(
            families["llamaswap_request_duration_seconds"],
            "llamaswap_request_duration_seconds_count",
        )
        assert counts[(("band", "batch"), ("outcome", "cancelled_waiting"))] == 1.0
        dispatched = values(
            families["llamaswap_scheduler_dispatched"], "llamaswap_scheduler_dispatched_total"
        )
        assert dispatched[(("band", "batch"),)] == 0.0


def test_serving_goes_on_while_the_database_is_locked(tmp_path):
    port = free_port_block(1)
    env = sqlite_url(tmp_path)
    with serve(tmp_path, {"m": fake_model(port)}, migrate=True, environ=env) as server:
        assert (
            httpx.post(server.url + "/v1/chat/completions", json=chat("m"), timeout=20).status_code
            == 200
        )
        wait_rows(server, 1)
        # Another connection takes the write lock and keeps it: every write fails.
        lock = sqlite3.connect(tmp_path / "db.sqlite3", isolation_level=None, timeout=5)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            for i in range(3):
                r = httpx.post(
                    server.url + "/v1/chat/completions", json=chat("m", f"locked-{i}"), timeout=20
                )
                assert r.status_code == 200
            deadline = time.monotonic() + 10
            while "database unavailable" not in server.log():
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.05)
            buffered = values(scrape(server)["llamaswap_activity_records_buffered"])
            assert buffered == {(): 3.0}
            # Readers are not blocked (WAL): the API still answers, without the new rows.
            assert activity(server)["total"] == 1
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        rows = wait_rows(server, 4, timeout=20)
        assert len({r["request_id"] for r in rows}) == 4
        families = scrape(server)
        assert values(
            families["llamaswap_activity_records_dropped"],
            "llamaswap_activity_records_dropped_total",
        ) == {(): 0.0}
        assert values(families["llamaswap_activity_records_buffered"]) == {(): 0.0}


def test_without_migrations_records_are_dropped_and_serving_goes_on(tmp_path):
    port = free_port_block(1)
    with serve(tmp_path, {"m": fake_model(port)}, environ=sqlite_url(tmp_path)) as server:
        for _ in range(2):
            r = httpx.post(server.url + "/v1/chat/completions", json=chat("m"), timeout=20)
            assert r.status_code == 200
        deadline = time.monotonic() + 10
        while True:
            families = scrape(server)
            dropped = values(
                families["llamaswap_activity_records_dropped"],
                "llamaswap_activity_records_dropped_total",
            )
            if dropped == {(): 2.0}:
                break
            assert time.monotonic() < deadline, (dropped, server.log())
            time.sleep(0.1)
        assert "activity log: the database refused" in server.log()
        assert "(run `llamaswap migrate`)" in server.log()
