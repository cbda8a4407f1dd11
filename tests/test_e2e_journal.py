"""A request's record survives the server being killed (activity/journal.py), end to end.

The real server with a fakellm model and a migrated SQLite file: requests are answered,
the server is SIGKILLed right after the last answer arrives (before the recorder's next
batch, every 0.5 s, could save them), and a new server on the same database and state
directory replays the journal before it serves: every request has exactly one record,
with the status and outcome its client saw.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
from pathlib import Path

import httpx
import pytest

from tests.server import Server, chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(90)

REQUEST_ID = "X-LlamaSwap-Request-Id"


def sqlite_url(tmp_path: Path) -> dict:
    return {"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}


def records(tmp_path: Path) -> list[tuple[str, str, int | None, int | None]]:
    """(request_id, outcome, status, completion_tokens) of every row, read directly."""
    with sqlite3.connect(tmp_path / "db.sqlite3", timeout=10) as db:
        return db.execute(
            "SELECT request_id, outcome, status, completion_tokens FROM scheduler_requestrecord"
        ).fetchall()


async def burst(server: Server, count: int) -> dict[str, tuple[int, int | None]]:
    """``count`` chat requests at once, every fifth answered 503 by the model; returns
    {request id: (status, completion tokens)} as the clients saw them."""
    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> httpx.Response:
            body = chat("m", f"r{i}", **({"fake_status": 503} if i % 5 == 4 else {}))
            return await client.post(server.url + "/v1/chat/completions", json=body)

        answers = await asyncio.gather(*(one(i) for i in range(count)))
    seen = {}
    for answer in answers:
        usage = answer.json().get("usage") if answer.status_code == 200 else None
        seen[answer.headers[REQUEST_ID]] = (
            answer.status_code,
            usage["completion_tokens"] if usage else None,
        )
    return seen


def kill(server: Server) -> None:
    """SIGKILL the server process alone (its models are swept by the next start)."""
    server.children()  # remembered, so the test's teardown kills them in any case
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)


def check_every_record(tmp_path: Path, seen: dict[str, tuple[int, int | None]]) -> None:
    rows = records(tmp_path)
    ids = [row[0] for row in rows]
    assert len(ids) == len(set(ids)), "a record was saved twice"
    missing = set(seen) - set(ids)
    assert not missing, f"{len(missing)} of {len(seen)} records lost"
    by_id = {row[0]: row for row in rows}
    for request_id, (status, tokens) in seen.items():
        _, outcome, saved_status, saved_tokens = by_id[request_id]
        assert (outcome, saved_status) == ("completed", status), by_id[request_id]
        assert saved_tokens == tokens


def restart_and_check(tmp_path: Path, models: dict, seen: dict) -> None:
    """A new server on the same database and state directory: the records are there
    before it serves, once each, and its clean stop leaves no journal behind."""
    with serve(tmp_path, models, environ=sqlite_url(tmp_path)) as again:
        check_every_record(tmp_path, seen)
        # The whole file: the killed server's guard may still write its last line into
        # it at its old offset (log() reads only the tail).
        assert "replayed the journal" in again.log_path.read_text(errors="replace")
    assert list((tmp_path / "state" / "activity").glob("*.journal")) == []


def test_records_of_the_last_answers_survive_sigkill(tmp_path):
    """A burst is answered and recorded as usual; then another connection takes the
    database's write lock, so the second burst's records cannot be saved by a batch, and
    the server is SIGKILLed right after its last answer: without the journal those
    records are lost (every time, not only when the kill beats the 0.5 s batch)."""
    port = free_port_block(1)
    models = {"m": fake_model(port)}
    server = Server(tmp_path, models, migrate=True, environ=sqlite_url(tmp_path))
    lock = sqlite3.connect(tmp_path / "db.sqlite3", isolation_level=None, timeout=5)
    try:
        server.wait_ready()
        seen = asyncio.run(burst(server, 20))
        lock.execute("BEGIN EXCLUSIVE")
        locked = asyncio.run(burst(server, 10))
        kill(server)
    finally:
        if lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()
        server.stop()
    assert not {row[0] for row in records(tmp_path)} & set(locked)
    seen |= locked
    assert sorted(status for status, _ in seen.values()).count(503) == 6
    restart_and_check(tmp_path, models, seen)
