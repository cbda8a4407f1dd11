"""A fleet end to end: three ``llamaswap serve`` nodes on loopback sharing a fresh PostgreSQL
database and one Redis (a key prefix of their own), with fakellm models.

What a user would notice: a model loaded on one node shows on the others within a second;
a request for a model cold here and warm elsewhere is sent there (and says so); a few
hundred requests at mixed priorities sent to all three while one node is killed with
SIGKILL each have exactly one record, naming the node the client talked to, with the
outcome the client saw; requests placed on the killed node and waiting there behind a long
stream are placed again (they are answered, and their record says so) while the stream
itself ends broken, recorded as such; the survivors show the dead node down within ~3 s;
and the fleet metrics add up to the records.

Skipped when PostgreSQL (127.0.0.1:5432, user postgres) or Redis (127.0.0.1:6379) is not
reachable, or with ``LLAMASWAP_SKIP_FLEET_E2E=1`` (deselect it from a quick run).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.server import Server, chat, fake_model, free_port_block, migrate_database

pytestmark = [pytest.mark.timeout(90), pytest.mark.services]  # make test-services

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/0"
NODES = ("box-a", "box-b", "box-c")
REQUESTS = 240
PRIORITIES = (100, 0, -100)


def reachable() -> str | None:
    if os.getenv("LLAMASWAP_SKIP_FLEET_E2E"):
        return "LLAMASWAP_SKIP_FLEET_E2E is set"
    try:
        import psycopg

        psycopg.connect(PG_ADMIN, connect_timeout=2).close()
    except Exception as exc:
        return f"no PostgreSQL at 127.0.0.1:5432: {exc}"
    try:
        import redis

        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except Exception as exc:
        return f"no Redis at 127.0.0.1:6379: {exc}"
    return None


@contextlib.contextmanager
def fresh_database(stem: str) -> Iterator[str]:
    """A database of its own on the machine's PostgreSQL for one module's nodes, dropped
    after; the module is skipped, saying why, when PostgreSQL or Redis is not there."""
    why = reachable()
    if why:
        pytest.skip(why)
    import psycopg

    name = f"{stem}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgres://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def database():
    with fresh_database("llamaswap_fleet") as url:
        yield url


@pytest.fixture(scope="module")
def fleet(database, tmp_path_factory):
    prefix = f"llamaswap-e2e:{uuid.uuid4().hex}"
    env = {
        "DATABASE_URL": database,
        "REDIS_URL": REDIS_URL,
        "LLAMASWAP_FLEET_PREFIX": prefix,
    }
    migrate_database({**os.environ, **env})
    servers: dict[str, Server] = {}
    try:
        for name in NODES:
            tmp = tmp_path_factory.mktemp(name)
            port = free_port_block(2)
            models = {
                "qwen": fake_model(port, load_seconds=0.2),
                "llama": fake_model(port + 1, load_seconds=0.2),
            }
            servers[name] = Server(tmp, models, environ=env, args=("--node", name), grace=2)
        for server in servers.values():
            server.wait_ready(timeout=30)
        yield servers
    finally:
        for server in servers.values():
            server.stop()
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)


_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} ([0-9.e+-]+)$")


def fleet_metrics(server: Server) -> dict[tuple[str, frozenset], float]:
    """The ``llamaswap_fleet_*`` samples of a node's /metrics: (name, labels) -> value."""
    text = httpx.get(server.url + "/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1).startswith("llamaswap_fleet_"):
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            out[(match.group(1), labels)] = float(match.group(3))
    return out


def metric(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_metrics(server: Server, check, timeout: float) -> float:
    """Seconds until ``check(samples)`` holds on ``server``'s /metrics."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check(fleet_metrics(server)):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"never held within {timeout}s: {fleet_metrics(server)}")


def records(database: str) -> list[dict]:
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(database, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT request_id, node, peer, model, outcome, status, error, placement"
            " FROM scheduler_requestrecord"
        ).fetchall()


def test_a_fleet_places_records_once_and_notices_a_dead_node(fleet, database):
    a, b, c = (fleet[n] for n in NODES)
    # Everyone sees everyone.
    for server in fleet.values():
        wait_metrics(server, lambda s: metric(s, "llamaswap_fleet_nodes", state="up") == 3, 5)

    # A model loaded on box-b shows on box-a within a second of the change.
    r = httpx.post(b.url + "/v1/chat/completions", json=chat("qwen"), timeout=20)
    assert r.status_code == 200
    warm_up = {
        r.headers["X-LlamaSwap-Request-Id"]: {"node": "box-b", "status": 200, "placed": None}
    }
    seen = wait_metrics(
        a, lambda s: metric(s, "llamaswap_fleet_model_loaded", node="box-b", model="qwen"), 3
    )
    assert seen < 1.0, f"box-a saw box-b's load after {seen:.2f}s"
    wait_metrics(a, lambda s: metric(s, "llamaswap_fleet_running", node="box-b") == 0, 2)

    # A request for qwen at box-a (cold there) goes to box-b, warm: no cold load here.
    r = httpx.post(a.url + "/v1/chat/completions", json=chat("qwen"), timeout=20)
    assert r.status_code == 200, r.text
    assert r.headers["X-LlamaSwap-Placement"].startswith("sent to box-b: model loaded there")
    warm_up[r.headers["X-LlamaSwap-Request-Id"]] = {
        "node": "box-a",
        "status": 200,
        "placed": r.headers["X-LlamaSwap-Placement"],
    }
    running_a = httpx.get(a.url + "/running", timeout=5).json()
    assert not running_a.get("running"), running_a

    # A client's forged "already placed" header only keeps the request here: it runs (a
    # cold load) and is recorded as usual, since the token is not box-b's.
    r = httpx.post(
        a.url + "/v1/chat/completions",
        json=chat("qwen"),
        headers={"X-LlamaSwap-Placed": "box-b forged"},
        timeout=20,
    )
    assert r.status_code == 200 and "X-LlamaSwap-Placement" not in r.headers
    warm_up[r.headers["X-LlamaSwap-Request-Id"]] = {"node": "box-a", "status": 200, "placed": None}

    # llama is loaded on box-c only: a long stream sent to box-a goes there, and requests
    # sent to box-a and box-b after it wait there behind it (until box-c dies).
    r = httpx.post(c.url + "/v1/chat/completions", json=chat("llama"), timeout=20)
    assert r.status_code == 200
    wait_metrics(
        a, lambda s: metric(s, "llamaswap_fleet_model_loaded", node="box-c", model="llama"), 3
    )
    wait_metrics(b, lambda s: metric(s, "llamaswap_fleet_running", node="box-c") == 0, 3)

    # A few hundred requests at mixed priorities to all three; box-c dies a third in.
    rng = random.Random(24)
    plan = [
        (NODES[i % 3], rng.choice(("qwen", "llama")), rng.choice(PRIORITIES))
        for i in range(REQUESTS)
    ]
    results: list[dict] = []
    stream: dict = {}
    behind: list[dict] = []
    killed_at: list[float] = []
    down_after: dict[str, float] = {}

    async def run() -> None:
        limit = asyncio.Semaphore(24)
        done = 0
        watchers: list[asyncio.Task] = []

        async with httpx.AsyncClient(timeout=45) as client:

            async def watch(name: str) -> None:
                """Seconds from the kill until ``name`` shows box-c down."""
                while True:
                    text = (await client.get(fleet[name].url + "/metrics")).text
                    if 'llamaswap_fleet_node_up{node="box-c"} 0.0' in text:
                        down_after[name] = time.monotonic() - killed_at[0]
                        return
                    await asyncio.sleep(0.05)

            async def post(node: str, model: str, priority: int, into: list[dict]) -> None:
                result = {"node": node, "status": None, "id": None, "placed": None}
                try:
                    r = await client.post(
                        fleet[node].url + "/v1/chat/completions",
                        json=chat(model, max_tokens=4),
                        headers={"X-LlamaSwap-Priority": str(priority)},
                    )
                    result.update(
                        status=r.status_code,
                        id=r.headers.get("X-LlamaSwap-Request-Id"),
                        placed=r.headers.get("X-LlamaSwap-Placement"),
                    )
                except httpx.HTTPError as exc:
                    result["error"] = repr(exc)
                into.append(result)

            third = asyncio.Event()

            async def one(node: str, model: str, priority: int) -> None:
                nonlocal done
                async with limit:
                    await post(node, model, priority, results)
                    done += 1
                    if done == REQUESTS // 3:
                        third.set()

            async def kill() -> None:
                """box-c dies a third into the run (or after 3 s: llama requests placed
                there wait behind the stream and may hold every client slot)."""
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(third.wait(), 3)
                os.killpg(c.proc.pid, signal.SIGKILL)
                killed_at.append(time.monotonic())
                watchers.extend(asyncio.create_task(watch(n)) for n in ("box-a", "box-b"))

            async def long_stream() -> None:
                body = chat("llama", stream=True, fake_tokens=400, fake_tokens_per_second=4)
                url = a.url + "/v1/chat/completions"
                async with client.stream("POST", url, json=body) as r:
                    stream.update(
                        status=r.status_code,
                        id=r.headers.get("X-LlamaSwap-Request-Id"),
                        placed=r.headers.get("X-LlamaSwap-Placement"),
                    )
                    text = b""
                    with contextlib.suppress(httpx.HTTPError):
                        async for chunk in r.aiter_raw():
                            text += chunk
                    stream["body"] = text.decode()

            streaming = asyncio.create_task(long_stream())
            async with asyncio.timeout(10):
                while "placed" not in stream:
                    await asyncio.sleep(0.02)
            assert (stream["placed"] or "").startswith("sent to box-c: model loaded there")
            waiting = [
                asyncio.create_task(post(("box-a", "box-b")[i % 2], "llama", 0, behind))
                for i in range(6)
            ]
            deadline = time.monotonic() + 10
            while True:  # all six wait on box-c, behind the stream
                text = (await client.get(a.url + "/metrics")).text
                depth = sum(
                    float(m.group(1))
                    for m in re.finditer(
                        r'llamaswap_fleet_queue_depth\{band="\w+",node="box-c"\} (\S+)', text
                    )
                )
                if depth >= 6:
                    break
                assert time.monotonic() < deadline, [
                    line for line in text.splitlines() if "fleet" in line and "{" in line
                ] + behind
                await asyncio.sleep(0.05)
            assert not behind, behind  # none answered while box-c lives

            await asyncio.gather(kill(), *(one(*p) for p in plan))
            await asyncio.gather(streaming, *waiting)
            async with asyncio.timeout(10):
                await asyncio.gather(*watchers)

    asyncio.run(run())
    assert killed_at, "box-c was never killed"

    # The survivors showed box-c down within ~3 s of the kill (its heartbeat lapsed, or a
    # refused connection took it out at once), not after a long timeout.
    assert set(down_after) == {"box-a", "box-b"}
    assert all(seconds < 4.5 for seconds in down_after.values()), down_after

    # The stream placed on box-c was cut mid-way: its client saw it end without [DONE].
    assert stream["status"] == 200 and "data: " in stream["body"], stream
    assert "[DONE]" not in stream["body"]
    # The requests waiting on box-c were placed again and answered.
    assert len(behind) == 6 and all(r["status"] == 200 for r in behind), behind

    answered = {
        r["id"]: r for r in results + behind if r["status"] is not None and r["node"] != "box-c"
    }
    lost = [r for r in results if r["status"] is None and r["node"] != "box-c"]
    assert not lost, [r.get("error") for r in lost]  # box-a and box-b answered every one
    bad = [r for r in answered.values() if r["status"] != 200]
    assert len(bad) < len(answered) * 0.1, bad
    placed = [r for r in answered.values() if r["placed"]]
    assert placed, "no request was placed on another node"

    # Every request box-a and box-b answered has exactly one record (written in batches:
    # give them a few seconds), naming the node its client talked to, with its outcome.
    deadline = time.monotonic() + 15
    while True:
        rows = [row for row in records(database) if row["node"] in ("box-a", "box-b")]
        if len(rows) >= len(answered) + len(warm_up) + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    by_id: dict[str, list[dict]] = {}
    for row in rows:
        by_id.setdefault(row["request_id"], []).append(row)
    assert all(len(v) == 1 for v in by_id.values())
    for request_id, result in {**answered, **warm_up}.items():
        assert request_id in by_id, f"no record of {result}"
        row = by_id[request_id][0]
        assert row["node"] == result["node"]
        assert row["status"] == result["status"]
        assert (row["outcome"] == "completed") == (result["status"] == 200)
        if result["placed"]:  # the last node it was sent to ran it
            assert re.findall(r"sent to ([\w-]+):", result["placed"])[-1] == row["peer"]
            assert row["placement"] == result["placed"]
            assert row["model"] in ("qwen", "llama")
        else:
            assert row["peer"] == ""
    for result in behind:  # placed on box-c, placed again when it died (here or box-b)
        row = by_id[result["id"]][0]
        assert "box-c went away before answering" in row["placement"], row
    # The stream: one record, on box-a, for box-c, broken as its client saw it.
    row = by_id[stream["id"]][0]
    assert (row["node"], row["peer"], row["status"]) == ("box-a", "box-c", 200)
    assert row["outcome"] == "failed" and "stream broken" in row["error"], row
    # Nothing else: a placed request is recorded by the node its client talked to only.
    known = answered.keys() | warm_up.keys() | {stream["id"]}
    others = [row for row in rows if row["request_id"] not in known]
    assert not others, others

    # The fleet metrics add up: placements counted on each node are its placed records.
    for name, server in (("box-a", a), ("box-b", b)):
        samples = fleet_metrics(server)
        counted = sum(v for (n, _), v in samples.items() if n == "llamaswap_fleet_placed_total")
        assert counted == sum(1 for row in rows if row["node"] == name and row["peer"])
        assert metric(samples, "llamaswap_fleet_nodes", state="up") == 2
        assert metric(samples, "llamaswap_fleet_nodes", state="down") == 1
        depth = sum(v for (n, _), v in samples.items() if n == "llamaswap_fleet_queue_depth")
        assert depth == 0  # every request answered: nothing waits anywhere
