"""The activity journal (activity/journal.py): lines, torn lines, replay, bounds, faults.

Journals in a tmp directory; replay into the real database where the test says so
(pytest-django), otherwise into a writer that keeps what it was given. The end-to-end
test (a SIGKILLed server) is tests/test_e2e_journal.py.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError, connection

from activity.journal import Journal, decode, encode, replay
from activity.models import RequestRecord
from activity.recorder import Recorder
from activity.rows import snapshot, write_records
from scheduler.core.policy import SchedulerSettings
from scheduler.dispatcher import Dispatcher, Outcome, Ticket
from scheduler.testing import FakeProcessFactory
from tests.helpers import FakeClock, granted, make_config, until

pytestmark = pytest.mark.timeout(20)

OWNER = "4242:77"
SETTINGS = SchedulerSettings()


def record(request_id: str, **changes) -> tuple:
    """A finished ticket's snapshot, as the recorder journals it."""
    ticket = Ticket(
        request_id=request_id,
        model=make_config("m").models["m"],
        priority=0,
        path="/v1/chat/completions",
        arrival=10.0,
        arrival_wall=1_790_000_000.0,
        granted=None,  # type: ignore[arg-type]
        outcome=Outcome.COMPLETED,
        status=200,
        extra={"usage": {"prompt_tokens": 3, "completion_tokens": 5}},
    )
    for name, value in changes.items():
        setattr(ticket, name, value)
    return snapshot(ticket, SETTINGS, 11.5)


def journal(directory: Path, owner: str = OWNER, **options) -> Journal:
    opened = Journal(directory, owner, "db", **options)
    opened.open()
    return opened


class Saved:
    """A replay writer that keeps the request ids it was given."""

    def __init__(self, fail: int | None = None) -> None:
        self.ids: list[str] = []
        self.calls = 0
        self.fail = fail

    def __call__(self, rows) -> int:
        self.calls += 1
        if self.fail is not None and self.calls >= self.fail:
            raise OperationalError("database is locked")
        self.ids += [row[1] for row in rows]
        return 0


def dead(owner: str) -> bool:
    return False


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.journal"))


# -- lines ---------------------------------------------------------------------------------


def test_a_line_is_one_record_and_damage_is_recognised():
    line = encode(7, record("r7"))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    seq, decoded = decode(line[:-1])
    assert seq == 7 and decoded == record("r7")
    assert decode(line[: len(line) // 2]) is None  # torn
    flipped = bytearray(line[:-1])
    flipped[20] ^= 1
    assert decode(bytes(flipped)) is None  # a changed byte fails the CRC or the base64
    assert decode(b"\0" * 40) is None


def test_a_torn_last_line_is_skipped(tmp_path):
    j = journal(tmp_path)
    for i in range(3):
        assert j.append(record(f"r{i}")) == i + 1
    # Killed in the middle of the next write: half a line, no newline.
    with open(j._segments[-1].path, "ab") as f:
        f.write(encode(4, record("r3"))[:50])
    saved = Saved()
    result = replay(tmp_path, "db", alive=dead, writer=saved)
    assert saved.ids == ["r0", "r1", "r2"]
    assert (result.saved, result.skipped, result.journals) == (3, 1, 1)
    assert files(tmp_path) == []


def test_zeros_a_power_cut_left_are_skipped_silently(tmp_path):
    j = journal(tmp_path)
    j.append(record("r0"))
    with open(j._segments[-1].path, "ab") as f:
        f.write(b"\0" * 300)
    saved = Saved()
    result = replay(tmp_path, "db", alive=dead, writer=saved)
    assert saved.ids == ["r0"] and result.skipped == 0


def test_records_marked_done_are_not_replayed(tmp_path):
    j = journal(tmp_path)
    for i in range(5):
        j.append(record(f"r{i}"))
    j.mark_done(3)
    saved = Saved()
    result = replay(tmp_path, "db", alive=dead, writer=saved)
    assert saved.ids == ["r3", "r4"]
    assert result.skipped == 3


# -- replay into the database -----------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_replay_is_idempotent(tmp_path):
    j = journal(tmp_path)
    for i in range(4):
        j.append(record(f"r{i}"))
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("copy"))
    # r1 reached the database in a batch, but the server died before marking it done.
    write_records([(_ticket("r1"), SETTINGS, 11.5)])
    assert replay(tmp_path, "db", alive=dead).saved == 4
    for path in copy.glob("*.journal"):  # the same journal once more (a second start)
        shutil.copy(path, tmp_path / path.name)
    assert replay(tmp_path, "db", alive=dead).saved == 4
    ids = list(RequestRecord.objects.order_by("request_id").values_list("request_id", flat=True))
    assert ids == ["r0", "r1", "r2", "r3"]
    row = RequestRecord.objects.get(request_id="r2")
    assert (row.outcome, row.status, row.completion_tokens) == ("completed", 200, 5)
    assert row.duration_ms == pytest.approx(1500.0)
    assert row.arrived_at.timestamp() == pytest.approx(1_790_000_000.0)
    assert files(tmp_path) == []


def _ticket(request_id: str) -> Ticket:
    ticket = Ticket(
        request_id=request_id,
        model=make_config("m").models["m"],
        priority=0,
        path="/v1/chat/completions",
        arrival=10.0,
        arrival_wall=1_790_000_000.0,
        granted=None,  # type: ignore[arg-type]
        outcome=Outcome.COMPLETED,
        status=200,
    )
    return ticket


@pytest.mark.django_db(transaction=True)
def test_replay_keeps_the_journal_when_the_table_is_missing(tmp_path):
    """Not migrated: the rows are kept for a start after `llamaswap migrate` (the live
    writer drops them instead, so serving never waits on a database that cannot work)."""
    j = journal(tmp_path)
    j.append(record("r0"))
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE scheduler_requestrecord RENAME TO hidden_records")
    try:
        result = replay(tmp_path, "db", alive=dead)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE hidden_records RENAME TO scheduler_requestrecord")
    assert (result.kept, result.saved) == (1, 0)
    assert len(files(tmp_path)) == 1
    assert replay(tmp_path, "db", alive=dead).saved == 1
    assert RequestRecord.objects.filter(request_id="r0").count() == 1


def test_a_database_error_during_replay_keeps_the_journal(tmp_path, caplog):
    j = journal(tmp_path)
    for i in range(5):
        j.append(record(f"r{i}"))
    failing = Saved(fail=2)  # the first batch goes in, the second fails
    with caplog.at_level(logging.WARNING, logger="llamaswap.recorder"):
        result = replay(tmp_path, "db", alive=dead, writer=failing, batch=2)
    assert (result.kept, result.saved, failing.ids) == (1, 0, ["r0", "r1"])
    assert len(files(tmp_path)) == 1
    assert "kept for the next attempt" in caplog.text
    saved = Saved()
    result = replay(tmp_path, "db", alive=dead, writer=saved, batch=2)
    assert saved.ids == ["r0", "r1", "r2", "r3", "r4"]  # r0, r1 again: skipped by request_id
    assert result.saved == 5 and files(tmp_path) == []


def test_servers_sharing_a_state_directory_keep_their_journals_apart(tmp_path):
    mine, theirs, elsewhere = (
        journal(tmp_path, "111:1"),
        journal(tmp_path, "222:2"),
        Journal(tmp_path, "333:3", "another db"),
    )
    elsewhere.open()
    mine.append(record("mine"))
    theirs.append(record("theirs"))
    elsewhere.append(record("elsewhere"))
    saved = Saved()
    result = replay(tmp_path, "db", alive=lambda owner: owner == "111:1", writer=saved)
    assert saved.ids == ["theirs"]
    assert (result.journals, result.foreign) == (1, 1)
    assert files(tmp_path) == ["activity-111-1-000000.journal", "activity-333-3-000000.journal"]
    assert mine.append(record("mine again")) == 2  # the live one goes on, untouched


# -- bounds, faults, fsync ---------------------------------------------------------------------


async def test_rotation_keeps_the_journal_bounded(tmp_path, caplog):
    line = len(encode(1, record("r00000")))
    j = journal(tmp_path, segment_bytes=10 * line, max_bytes=40 * line)
    seq = 0
    for round_ in range(20):  # 200 records, saved as they come: a few segments at most
        for i in range(10):
            seq = j.append(record(f"r{round_:02d}{i:03d}"))
            assert seq
        j.mark_done(seq)
        await j.upkeep()
        assert len(files(tmp_path)) <= 2
        assert j.size <= 12 * line
    assert j.size == sum(p.stat().st_size for p in tmp_path.glob("*.journal"))
    # The database goes away: nothing is marked done; the journal stops at its bound.
    with caplog.at_level(logging.WARNING, logger="llamaswap.recorder"):
        taken = [j.append(record(f"x{i:05d}")) for i in range(60)]
        j.flush_log()
    refused = taken.count(0)
    assert refused > 0 and all(taken[: 60 - refused]) and j.refused == refused
    assert j.size <= 40 * line
    assert "not journaled" in caplog.text
    j.mark_done(j.seq)  # back: all saved, room again
    await j.upkeep()
    await j.upkeep()
    assert j.append(record("after")) and j.size <= 12 * line


def test_a_failed_write_costs_only_that_record(tmp_path):
    faults = {"raise": False, "short": False}

    def write(fd: int, data: bytes) -> int:
        if faults["raise"]:
            faults["raise"] = False
            raise OSError(28, "No space left on device")
        if faults["short"]:
            faults["short"] = False
            return os.write(fd, data[:30])
        return os.write(fd, data)

    j = journal(tmp_path, write=write)
    assert j.append(record("r0")) == 1
    faults["raise"] = True
    assert j.append(record("r1")) == 0
    faults["short"] = True
    assert j.append(record("r2")) == 0  # half written: the line is ended, then skipped
    assert j.append(record("r3")) == 2
    assert j.refused == 2
    saved = Saved()
    result = replay(tmp_path, "db", alive=dead, writer=saved)
    assert saved.ids == ["r0", "r3"] and result.skipped == 1


async def test_upkeep_fsyncs_what_was_written_once(tmp_path):
    synced: list[int] = []
    j = journal(tmp_path, fsync=lambda fd: synced.append(fd))
    await j.upkeep()
    assert synced == []  # nothing written since the start
    j.append(record("r0"))
    j.append(record("r1"))
    await j.upkeep()
    assert len(synced) == 1
    await j.upkeep()
    assert len(synced) == 1


# -- the recorder with its journal -------------------------------------------------------------


@pytest.fixture
async def world(tmp_path):
    """``await world(writer=...)`` -> (dispatcher, recorder, journal); all stopped after."""
    built = []

    async def build(**options):
        clock = FakeClock()
        config = make_config("a")
        j = journal(tmp_path / "journal", owner="9:9")
        recorder = Recorder(config.scheduler, clock=clock, journal=j, **options)
        dispatcher = Dispatcher(
            config,
            process_factory=FakeProcessFactory(),
            clock=clock,
            wall_clock=clock.wall,
            observers=[recorder],
        )
        await dispatcher.start()
        built.append((dispatcher, recorder))
        return dispatcher, recorder, j

    yield build
    for dispatcher, recorder in built:
        await dispatcher.stop(grace=0)
        await recorder.stop(timeout=2)


async def finish(dispatcher: Dispatcher, count: int) -> None:
    a = dispatcher.config.models["a"]
    for i in range(count):
        ticket = dispatcher.submit(a, 0, f"r{i}", "/v1/chat/completions")
        await granted(ticket)
        dispatcher.finish(ticket, Outcome.COMPLETED, 200)


@pytest.mark.django_db(transaction=True)
async def test_saved_records_are_marked_and_a_clean_stop_deletes_the_journal(world, tmp_path):
    dispatcher, recorder, j = await world(interval=60)
    await recorder.start()
    await finish(dispatcher, 3)
    await until(lambda: recorder.pending == 3)
    assert j.seq == 3 and j.done == 0  # on disk before anything reached the database
    await recorder.flush()
    assert j.done == 3
    await recorder.stop()
    assert files(tmp_path / "journal") == []
    count = sync_to_async(RequestRecord.objects.count, thread_sensitive=True)
    assert await count() == 3


@pytest.mark.django_db(transaction=True)
async def test_a_stop_with_the_database_away_keeps_the_journal_for_the_next_start(world, tmp_path):
    def down(items):
        raise OperationalError("could not connect to server")

    dispatcher, recorder, j = await world(writer=down, interval=0.02)
    await recorder.start()
    await finish(dispatcher, 4)
    await until(lambda: recorder.pending == 4)
    await recorder.stop(timeout=0.2)
    assert recorder.dropped == 0  # not lost: kept in the journal
    assert len(files(tmp_path / "journal")) == 1
    result = await sync_to_async(replay, thread_sensitive=True)(tmp_path / "journal", "db", alive=dead)
    assert result.saved == 4
    ids = sync_to_async(
        lambda: sorted(RequestRecord.objects.values_list("request_id", flat=True)),
        thread_sensitive=True,
    )
    assert await ids() == ["r0", "r1", "r2", "r3"]


@pytest.mark.django_db(transaction=True)
async def test_the_recorder_replays_dead_journals_once_the_database_answers(world, tmp_path):
    other = journal(tmp_path / "journal", owner="8:8")  # a server killed while the database was away
    other.append(record("orphan"))
    calls = []

    def replay_dead() -> int:
        calls.append(1)
        return replay(tmp_path / "journal", "db", alive=lambda owner: owner == "9:9").kept

    dispatcher, recorder, _ = await world(replay=replay_dead, interval=0.02)
    await recorder.start()
    await until(lambda: calls, timeout=5)
    exists = sync_to_async(
        lambda: RequestRecord.objects.filter(request_id="orphan").exists(), thread_sensitive=True
    )
    assert await exists()
    assert files(tmp_path / "journal") == ["activity-9-9-000000.journal"]


def test_write_records_and_the_journal_give_the_same_row():
    """Live batches and replays build rows from the same snapshot function."""
    from activity.rows import record_fields, snapshot_fields

    ticket = _ticket("same")
    ticket.extra["timings"] = {"predicted_per_second": 12.5, "prompt_n": 3, "cache_n": 1}
    direct = record_fields(ticket, SETTINGS, 11.5)
    seq, journaled = decode(encode(1, snapshot(ticket, SETTINGS, 11.5))[:-1])
    assert snapshot_fields(journaled) == direct
