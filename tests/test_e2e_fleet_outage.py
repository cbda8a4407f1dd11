"""A fleet through short outages of its Redis and its PostgreSQL, end to end.

Two ``llamaswap serve`` nodes share a fresh PostgreSQL database and one Redis (a key prefix
of their own), each through loopback forwarders this test owns (tests/tcp_cut.py), so one
node's link can be cut without stopping the machine's services. What a user would notice:

* Redis cut on box-a: box-a keeps answering requests for its own models (no slower than
  :data:`WAITED_ON_REDIS`: none waits on Redis), keeps every request here (no
  placement on a node it cannot see), and says so: ``llamaswap_fleet_degraded 1`` on
  ``/metrics``, ``degraded: ...`` in the models feed's and the dashboard's fleet section.
  box-b shows box-a down. Once Redis is back box-a reconnects by itself and the two see
  each other again within :data:`RECONNECT_SECONDS`.
* PostgreSQL cut on box-a: box-a keeps answering; the records of what it answered meanwhile
  are in its journal, not yet in the database (``llamaswap_activity_records_buffered``
  counts them on ``/metrics``); once PostgreSQL is back each arrives exactly once, with
  the status and outcome its client saw, within :data:`ARRIVE_SECONDS`. Meanwhile the fleet
  says so: ``llamaswap_fleet_records_delayed{node="box-a"}`` on every node's ``/metrics``,
  ``records_delayed`` in the fleet section.

Skipped when PostgreSQL (127.0.0.1:5432, user postgres) or Redis (127.0.0.1:6379) is not
reachable, or with ``LLAMASWAP_SKIP_FLEET_E2E=1``.
"""

from __future__ import annotations

import os
import statistics
import time
import uuid
from pathlib import Path

import httpx
import pytest

from activity import journal
from tests.server import Server, chat, fake_model, free_port_block, migrate_database
from tests.tcp_cut import Cut
from tests.test_e2e_fleet import (
    REDIS_URL,
    fresh_database,
    metric,
    records,
    wait_metrics,
)

pytestmark = [pytest.mark.timeout(90), pytest.mark.services]  # make test-services

NODES = ("box-a", "box-b")
WAITED_ON_REDIS = 1.0
"""A request that waited on Redis would take at least its client's connect timeout
(``fleet.node.CONNECT_TIMEOUT``, 1 s); none does (the fleet view is read from memory)."""
RECONNECT_SECONDS = 5.0
"""Redis back: the subscriber's backoff is at most 2 s, then one heartbeat."""
ARRIVE_SECONDS = 15.0
"""PostgreSQL back: the recorder's backoff is at most 10 s, then one batch."""
OUTAGE_SECONDS = 4.0


@pytest.fixture(scope="module")
def database():
    with fresh_database("llamaswap_outage") as url:
        yield url


@pytest.fixture(scope="module")
def fleet(database, tmp_path_factory):
    """Both nodes, each with its own cuttable links: ``(servers, {node: {"redis": Cut,
    "pg": Cut}})``. Both serve qwen, llama, gemma and phi (one loaded at a time)."""
    prefix = f"llamaswap-e2e:{uuid.uuid4().hex}"
    migrate_database({**os.environ, "DATABASE_URL": database})
    servers: dict[str, Server] = {}
    links: dict[str, dict[str, Cut]] = {}
    try:
        for name in NODES:
            links[name] = {"redis": Cut("127.0.0.1", 6379), "pg": Cut("127.0.0.1", 5432)}
            env = {
                "DATABASE_URL": links[name]["pg"].url(database),
                "REDIS_URL": links[name]["redis"].url(REDIS_URL),
                "LLAMASWAP_FLEET_PREFIX": prefix,
            }
            tmp = tmp_path_factory.mktemp(name)
            port = free_port_block(4)
            models = {
                "qwen": fake_model(port, load_seconds=0.2),
                "llama": fake_model(port + 1, load_seconds=0.2),
                "gemma": fake_model(port + 2, load_seconds=0.2),
                "phi": fake_model(port + 3, load_seconds=0.2),
            }
            servers[name] = Server(tmp, models, environ=env, args=("--node", name), grace=2)
        for server in servers.values():
            server.wait_ready(timeout=30)
        yield servers, links
    finally:
        for server in servers.values():
            server.stop()
        for node in links.values():
            for cut in node.values():
                cut.close()
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)


def ask(server: Server, model: str, **extra) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", json=chat(model, **extra), timeout=20)
    return r, time.monotonic() - start


def fleet_section(server: Server) -> dict:
    return httpx.get(server.url + "/models/feed/", timeout=5).json()["fleet"]


def sample(server: Server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on {server.url}/metrics")


def both_up(servers: dict[str, Server], timeout: float) -> float:
    """Seconds until every node sees both up and none is degraded."""
    start = time.monotonic()
    for server in servers.values():
        left = timeout - (time.monotonic() - start)
        wait_metrics(
            server, lambda s: metric(s, "llamaswap_fleet_nodes", state="up") == 2, max(left, 0.1)
        )
        while sample(server, "llamaswap_fleet_degraded") != 0:
            assert time.monotonic() - start < timeout, fleet_section(server)
            time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize(
    ("outage", "warm"),
    [("cut", "qwen"), ("stall", "gemma"), ("drop", "phi")],
    ids=["connections-closed", "packets-held", "connections-forgotten"],
)
def test_redis_away_the_node_serves_its_own_models_and_says_so(fleet, outage, warm):
    """``cut``: every connection to Redis closed and new ones refused (Redis restarting);
    ``stall``: every byte held, connections open (a network dropping packets); ``drop``:
    a stall after which the connections open during it stay silent for ever (Redis
    forgot them during a partition, and no reset reached this node)."""
    servers, links = fleet
    a, b = servers["box-a"], servers["box-b"]
    both_up(servers, 10)

    # ``warm`` (never loaded before) loaded on box-b only, llama on box-a only: a request
    # for ``warm`` at box-a goes to box-b while the fleet is whole.
    r, _ = ask(b, warm)
    assert r.status_code == 200 and "X-LlamaSwap-Placement" not in r.headers, r.headers
    assert ask(a, "llama")[0].status_code == 200
    wait_metrics(
        a, lambda s: metric(s, "llamaswap_fleet_model_loaded", node="box-b", model=warm), 3
    )
    wait_metrics(a, lambda s: metric(s, "llamaswap_fleet_running", node="box-b") == 0, 3)
    r, _ = ask(a, warm)
    assert r.status_code == 200
    assert r.headers["X-LlamaSwap-Placement"].startswith("sent to box-b"), r.headers
    before = statistics.median(ask(a, "llama")[1] for _ in range(5))

    getattr(links["box-a"]["redis"], outage)()
    cut_at = time.monotonic()
    # box-a keeps answering for its own models, at once, during the whole outage.
    during = []
    while time.monotonic() - cut_at < OUTAGE_SECONDS:
        r, seconds = ask(a, "llama")
        assert r.status_code == 200, r.text
        during.append(seconds)
        time.sleep(0.1)
    assert max(during) < WAITED_ON_REDIS, (before, during)
    # It says it is degraded: /metrics, the models feed, the dashboard's fleet section.
    assert sample(a, "llamaswap_fleet_degraded") == 1
    section = fleet_section(a)
    assert section["degraded"] and section["status"].startswith("degraded: "), section
    # Placement stays here: ``warm`` (loaded on box-b) is loaded and run on box-a.
    r, _ = ask(a, warm)
    assert r.status_code == 200, r.text
    assert "X-LlamaSwap-Placement" not in r.headers, r.headers
    # box-b no longer hears box-a: shown down (its heartbeat lapsed).
    wait_metrics(b, lambda s: metric(s, "llamaswap_fleet_node_up", node="box-a") == 0, 3)

    links["box-a"]["redis"].restore()
    back = both_up(servers, RECONNECT_SECONDS)
    print(
        f"reconnected {back:.2f}s after Redis came back; during the outage: median "
        f"{statistics.median(during) * 1000:.0f} ms, slowest {max(during) * 1000:.0f} ms "
        f"(median before: {before * 1000:.0f} ms)"
    )
    section = fleet_section(a)
    assert section["status"] == "ok", (section, a.log())


@pytest.mark.parametrize("outage", ["cut", "stall"], ids=["connections-closed", "packets-held"])
def test_postgres_away_records_arrive_afterwards_once_each(fleet, database, outage):
    """``cut``: the recorder's writes fail (and back off); ``stall``: its write hangs
    (PostgreSQL's link holds every byte) and the records wait behind it."""
    servers, links = fleet
    a, b = servers["box-a"], servers["box-b"]
    while sample(a, "llamaswap_activity_records_buffered"):  # earlier tests' records saved
        time.sleep(0.05)
    getattr(links["box-a"]["pg"], outage)()
    sent: dict[str, dict] = {}
    try:
        for i in range(8):
            extra = {"fake_status": 400} if i == 3 else {}
            r, _ = ask(a, ("qwen", "llama")[i % 2], **extra)
            assert r.status_code == (400 if i == 3 else 200), r.text
            sent[r.headers["X-LlamaSwap-Request-Id"]] = {"status": r.status_code}
        # Nothing of it is in the database yet; box-a holds the records (journaled on
        # disk, counted on /metrics as waiting to be saved).
        time.sleep(1.0)  # a few of the recorder's batch intervals (0.5 s): none can land
        assert not [row for row in records(database) if row["request_id"] in sent]
        assert sample(a, "llamaswap_activity_records_buffered") == len(sent)
        state = a.config_path.parent / "state"
        journaled = {
            value
            for path in Path(state).rglob("*.journal")
            for line in path.read_bytes().splitlines()
            if (entry := journal.decode(line)) is not None
            for value in entry[1]
            if isinstance(value, str) and value in sent
        }
        assert journaled == sent.keys()
        # The fleet says box-a's records are delayed: box-b's /metrics and box-a's feed.
        wait_metrics(
            b,
            lambda s: metric(s, "llamaswap_fleet_records_delayed", node="box-a") == len(sent),
            5,
        )
        assert fleet_section(a)["records_delayed"] == len(sent)
    finally:
        links["box-a"]["pg"].restore()
    back = time.monotonic()
    while True:
        rows = [row for row in records(database) if row["request_id"] in sent]
        if len(rows) >= len(sent) or time.monotonic() - back > ARRIVE_SECONDS:
            break
        time.sleep(0.1)
    print(f"records arrived {time.monotonic() - back:.2f}s after PostgreSQL came back")
    ids = [row["request_id"] for row in rows]
    assert sorted(ids) == sorted(sent), (ids, a.log())
    for row in rows:
        seen = sent[row["request_id"]]
        assert row["node"] == "box-a"
        assert row["status"] == seen["status"]
        assert row["outcome"] == "completed", row  # the upstream answered (its 400 too)
    assert sample(a, "llamaswap_activity_records_buffered") == 0
    wait_metrics(b, lambda s: metric(s, "llamaswap_fleet_records_delayed", node="box-a") == 0, 3)
