"""The activity log's journal: a finished request's record on disk before it is in the database.

The recorder saves records in batches (every 0.5 s, or later while the database is away),
so a server killed between two batches would lose the records of the requests it answered
last. :meth:`Journal.append` writes each record first as one line (:func:`encode`: the
record's plain values marshalled, a CRC-32, base64) with one ``os.write`` on an
``O_APPEND`` descriptor, on the dispatcher's thread when the ticket finishes: once it
returns, the line is in the kernel's page cache and survives the process, whatever kills
it (~10-20 µs a record: ``python -m bench.bench_journal``). After each batch is committed
the recorder appends a marker (``{"done": seq}``) so a replay skips what the database
already has. The first line of a segment is a JSON header naming the owner and database.

Power cuts: the page cache is lost with the machine. An ``fsync`` per request costs a
disk flush each (~0.4-4 ms on ext4, the same bench), far too slow for the hot path, so
:meth:`Journal.upkeep` (the recorder's background task, every :data:`SYNC_INTERVAL`
seconds while lines were written) calls ``fsync`` in a worker thread. A power cut loses
at most the records of the last second that had not reached the database yet (and those
the database itself loses: its own commit durability).

Files: ``<state dir>/activity/activity-<pid>-<start>-<n>.journal`` (the owner id of
:func:`scheduler.sweep.owner_id`, so servers sharing a state directory never write to
or replay each other's while they run), segments of about :data:`SEGMENT_BYTES`. A new
segment starts once the current one is that big; a segment is deleted once every record
in it is in the database. At most :data:`MAX_BYTES` are kept: beyond that (the database
has been away long enough for the memory buffer to hold that much) a record is still
buffered in memory but not journaled, and a warning says so. A clean stop with
everything saved deletes the journal.

At the next start (``llamaswap serve``, before serving) :func:`replay` inserts the
records of dead servers' journals that are not marked done, keyed by ``request_id``
(``ON CONFLICT DO NOTHING``: a replay run twice, or a record saved just before the kill
and not yet marked, is never duplicated), then deletes those journals. A database error
keeps them for the next attempt (the recorder tries again once its database answers). A
line cut short (a full disk; a power cut) or damaged fails its CRC and is skipped.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import marshal
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("llamaswap.recorder")

VERSION = 1
SEGMENT_BYTES = 1 << 20
"""A segment's size before the next one starts (~1,000 records of ~1 KB)."""
MAX_BYTES = 64 << 20
"""The journal's bound on disk: beyond it new records are buffered in memory only."""
SYNC_INTERVAL = 1.0
"""Seconds between two ``fsync`` of a journal that was written: what a power cut may lose."""
MAX_LINE = 1 << 20
"""A record's line beyond this (an upstream's enormous ``usage``) is not journaled."""
REPLAY_BATCH = 500
SUBDIRECTORY = "activity"
_NAME = re.compile(r"^activity-(\d+)-(\d+)-(\d+)\.journal$")


def directory_for(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / SUBDIRECTORY


def database_identity() -> str:
    """Which database a journal's records belong to: a journal is replayed only into it
    (two servers on one state directory may use different databases)."""
    from django.db import connection

    settings = connection.settings_dict
    return "|".join(
        str(settings.get(key) or "") for key in ("ENGINE", "HOST", "PORT", "NAME")
    )


def encode(seq: int, record: tuple[Any, ...]) -> bytes:
    """A record's line: the CRC-32 of its payload (8 hex digits), then the payload (the
    ``marshal`` of ``(seq, record)``: ~5x faster than JSON for a record's many floats) in
    base64, so the line holds no newline and a torn or damaged one is recognised.
    (``b2a_base64`` ends it with the newline: one copy of the line fewer.)"""
    payload = marshal.dumps((seq, record))
    return b"%08x" % zlib.crc32(payload) + binascii.b2a_base64(payload)


def decode(line: bytes) -> tuple[int, tuple[Any, ...]] | None:
    """``(seq, record)`` of a whole record line (without its newline); None otherwise."""
    try:
        payload = base64.b64decode(line[8:], validate=True)
        if zlib.crc32(payload) != int(line[:8], 16):
            return None
        seq, record = marshal.loads(payload)
    except (ValueError, TypeError, EOFError):
        return None
    if not isinstance(seq, int) or not isinstance(record, tuple):
        return None
    return seq, record


@dataclass
class _Segment:
    path: Path
    index: int
    fd: int | None
    size: int
    last_seq: int
    """The newest record in it (the seq before it, if it has none)."""


class Journal:
    """One server's journal (see the module's docstring).

    :meth:`append` and :meth:`mark_done` run on the event loop's thread (the dispatcher's
    observers); :meth:`upkeep` is awaited by the recorder's background task and does its
    ``fsync``, closing and deleting in a worker thread. ``write`` and ``fsync`` (tests:
    fault injection) replace ``os.write`` and ``os.fsync``.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        owner: str,
        database: str = "",
        *,
        segment_bytes: int = SEGMENT_BYTES,
        max_bytes: int = MAX_BYTES,
        sync_interval: float = SYNC_INTERVAL,
        write: Callable[[int, bytes], int] = os.write,
        fsync: Callable[[int], None] = os.fsync,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.owner = owner
        self.database = database
        self.segment_bytes = segment_bytes
        self.max_bytes = max_bytes
        self.sync_interval = sync_interval
        self._write = write
        self._fsync = fsync
        self._clock = clock
        self._prefix = "activity-{}-{}-".format(*owner.split(":", 1))
        self._segments: list[_Segment] = []
        self._bytes = 0
        self._seq = 0
        self._done = 0
        self._dirty = False
        self._sealed = False
        self._lock = threading.Lock()
        """Held while a worker thread uses a descriptor, so none is closed under it."""
        self.refused = 0
        """Records not journaled (full, or a write failed): in memory only."""
        self._refusals_unlogged = 0
        self._refusal_reason = ""
        self._refusal_logged_at = float("-inf")

    # -- the hot path (the event loop's thread) ---------------------------------------------

    def open(self) -> None:
        """Create the directory and the first segment. Raises ``OSError``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._start_segment()
        _sync_directory(self.directory)  # the file itself survives a power cut

    @property
    def seq(self) -> int:
        """The newest record's sequence number (0: none yet)."""
        return self._seq

    @property
    def done(self) -> int:
        return self._done

    @property
    def size(self) -> int:
        """Bytes in the journal's segments."""
        return self._bytes

    def append(self, record: tuple[Any, ...]) -> int:
        """Write one record (``activity.rows.snapshot``: plain values); its sequence
        number, or 0 if it was not journaled."""
        segment = self._segments[-1] if self._segments else None
        if segment is None or segment.fd is None or self._sealed:
            self._refuse("the journal is closed")
            return 0
        seq = self._seq + 1
        try:
            line = encode(seq, record)
        except ValueError as exc:  # not a plain value: cannot happen with parsed JSON
            self._refuse(f"cannot encode the record: {exc}")
            return 0
        if len(line) > MAX_LINE:
            self._refuse(f"a record of {len(line)} bytes (the journal takes {MAX_LINE})")
            return 0
        if self._bytes + len(line) > self.max_bytes:
            self._refuse(
                f"the journal holds {self._bytes} bytes (its bound: {self.max_bytes}); "
                "is the database unavailable?"
            )
            return 0
        if not self._put(segment, line):
            return 0
        self._seq = segment.last_seq = seq
        return seq

    def mark_done(self, seq: int) -> None:
        """Every record up to ``seq`` is in the database (or was refused by it for good)."""
        if seq <= self._done:
            return
        self._done = seq
        segment = self._segments[-1] if self._segments else None
        if segment is not None and segment.fd is not None and not self._sealed:
            self._put(segment, b'{"done":%d}\n' % seq)

    def _put(self, segment: _Segment, line: bytes) -> bool:
        assert segment.fd is not None
        try:
            written = self._write(segment.fd, line)
        except OSError as exc:
            self._refuse(f"cannot write {segment.path}: {exc}")
            return False
        if written:
            segment.size += written
            self._bytes += written
            self._dirty = True
        if written != len(line):
            # Disk full mid-line: end the torn line so the next one starts whole (replay
            # skips the torn one).
            with contextlib.suppress(OSError):
                ended = self._write(segment.fd, b"\n")
                segment.size += ended
                self._bytes += ended
            self._refuse(f"short write to {segment.path} ({written} of {len(line)} bytes)")
            return False
        return True

    def _refuse(self, reason: str) -> None:
        self.refused += 1
        self._refusals_unlogged += 1
        self._refusal_reason = reason
        if self._clock() - self._refusal_logged_at >= 10.0:
            self.flush_log()

    def flush_log(self) -> None:
        if not self._refusals_unlogged:
            return
        log.warning(
            "activity log: %d records not journaled (kept in memory only, lost if the "
            "server is killed before they are saved): %s",
            self._refusals_unlogged,
            self._refusal_reason,
            extra={
                "action": "journal_refused",
                "records": self._refusals_unlogged,
                "cause": self._refusal_reason,
            },
        )
        self._refusals_unlogged = 0
        self._refusal_logged_at = self._clock()

    # -- upkeep (the recorder's background task) --------------------------------------------

    async def upkeep(self) -> None:
        """``fsync`` what was written, start a new segment when the current one is full,
        delete the segments whose records are all in the database."""
        if self._dirty:
            self._dirty = False
            await asyncio.to_thread(self._sync_current)
        current = self._segments[-1] if self._segments else None
        if current is not None and current.size >= self.segment_bytes:
            try:
                self._start_segment()
            except OSError as exc:
                log.warning(
                    "activity log: cannot start a journal segment: %s",
                    exc,
                    extra={"action": "journal_failed", "cause": str(exc)},
                )
            else:
                await asyncio.to_thread(self._retire, current)
        finished = [s for s in self._segments[:-1] if s.last_seq <= self._done and s.fd is None]
        if finished:
            for segment in finished:
                self._segments.remove(segment)
                self._bytes -= segment.size
            await asyncio.to_thread(_unlink, [s.path for s in finished])
        self.flush_log()

    def _start_segment(self) -> None:
        index = self._segments[-1].index + 1 if self._segments else 0
        path = self.directory / f"{self._prefix}{index:06d}.journal"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        header = json.dumps(
            {"journal": VERSION, "owner": self.owner, "database": self.database},
            separators=(",", ":"),
        ).encode() + b"\n"
        try:
            os.write(fd, header)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        self._segments.append(_Segment(path, index, fd, len(header), self._seq))
        self._bytes += len(header)

    def _sync_current(self) -> None:
        with self._lock:
            segment = self._segments[-1] if self._segments else None
            if segment is not None and segment.fd is not None:
                try:
                    self._fsync(segment.fd)
                except OSError as exc:
                    log.warning(
                        "activity log: cannot fsync the journal: %s",
                        exc,
                        extra={"action": "journal_failed", "cause": str(exc)},
                    )

    def _retire(self, segment: _Segment) -> None:
        """A full segment: its last lines to disk, its descriptor closed, and the new
        segment's directory entry to disk (a power cut must not lose the file)."""
        with self._lock:
            fd, segment.fd = segment.fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    self._fsync(fd)
                os.close(fd)
        _sync_directory(self.directory)

    def seal(self) -> None:
        """No more lines (on the loop's thread, before :meth:`close` runs in a worker
        thread: no write may race the closing of its descriptor)."""
        self._sealed = True

    def close(self) -> bool:
        """Stop journaling (the server stops). When every record is in the database the
        journal is deleted; otherwise it is synced and kept for the next start. Returns
        whether it was kept. Blocking."""
        self._sealed = True
        with self._lock:
            for segment in self._segments:
                if segment.fd is not None:
                    with contextlib.suppress(OSError):
                        self._fsync(segment.fd)
                    os.close(segment.fd)
                    segment.fd = None
        self.flush_log()
        if self._done >= self._seq:
            _unlink([s.path for s in self._segments])
            self._segments.clear()
            self._bytes = 0
            return False
        _sync_directory(self.directory)
        return True


def _unlink(paths: Sequence[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _sync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- replay (before serving; the recorder's writer thread) -----------------------------------


@dataclass
class Replayed:
    """What :func:`replay` did."""

    saved: int = 0
    """Records inserted (or found already there: skipped by ``request_id``)."""
    dropped: int = 0
    """Records the database refused for good (a bad value)."""
    skipped: int = 0
    """Lines that were not a whole record (torn by the kill) and records marked done."""
    kept: int = 0
    """Journals kept for a later attempt: the database failed."""
    foreign: int = 0
    """Journals of another database, left alone."""
    journals: int = 0
    """Journals replayed and deleted."""


@dataclass
class _Read:
    rows: list[tuple[Any, ...]]
    torn: int
    marked: int
    database: str | None


def _owner_alive(owner: str) -> bool:
    """The server ``<pid>:<start time>`` (:func:`scheduler.sweep.owner_id`) still runs:
    its journal is its own business. The start time tells a reused pid apart."""
    pid, _, start = owner.partition(":")
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[-1].split()
    except FileNotFoundError:
        return False
    except (OSError, ValueError):  # no /proc: the pid alone
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except (OSError, ValueError):
            return True
        return True
    if len(fields) < 20 or fields[0] in (b"Z", b"X", b"x"):
        return False  # a zombie: dead, its files closed
    return fields[19].decode() == start


def _journals(directory: Path) -> dict[str, list[Path]]:
    """``{owner: segment paths in order}`` in ``directory``."""
    found: dict[str, list[tuple[int, Path]]] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return {}
    for name in names:
        match = _NAME.match(name)
        if match:
            owner = f"{match[1]}:{match[2]}"
            found.setdefault(owner, []).append((int(match[3]), directory / name))
    return {owner: [path for _, path in sorted(paths)] for owner, paths in sorted(found.items())}


def _read(paths: Sequence[Path]) -> _Read:
    records: dict[int, tuple[Any, ...]] = {}
    done = 0
    torn = 0
    database: str | None = None
    for path in paths:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue  # replayed meanwhile by another server starting on this directory
        lines = data.split(b"\n")
        if lines[-1].strip(b"\0"):
            torn += 1  # no newline at the end: the write was cut short
        for line in lines[:-1]:
            if line.startswith(b"{"):  # the header, or a batch's done marker
                try:
                    entry = json.loads(line)
                except ValueError:
                    entry = None
                if isinstance(entry, dict) and "journal" in entry:
                    database = str(entry.get("database", ""))
                    continue
                if isinstance(entry, dict) and isinstance(entry.get("done"), int):
                    done = max(done, entry["done"])
                    continue
            else:
                decoded = decode(line)
                if decoded is not None:
                    records[decoded[0]] = decoded[1]
                    continue
            if line.strip(b"\0"):  # a power cut can leave zeros where lines were
                torn += 1
    rows = [row for seq, row in sorted(records.items()) if seq > done]
    return _Read(rows, torn, len(records) - len(rows), database)


def replay(
    directory: str | os.PathLike[str],
    database: str | None = None,
    *,
    alive: Callable[[str], bool] = _owner_alive,
    writer: Callable[[Sequence[tuple[Any, ...]]], int] | None = None,
    batch: int = REPLAY_BATCH,
) -> Replayed:
    """Save the records of dead servers' journals in ``directory`` into the database, then
    delete those journals (see the module's docstring). Blocking: Django's ORM, in a sync
    context (before serving, or the recorder's writer thread).

    ``database`` (default :func:`database_identity`) names the database: a journal written
    for another is left alone. ``alive`` says whether an owner still runs; ``writer``
    (default :func:`activity.rows.write_rows`) saves rows and raises on a database
    error, which keeps that journal.
    """
    if writer is None:
        from activity.rows import write_rows

        writer = write_rows
    if database is None:
        database = database_identity()
    root = Path(directory)
    result = Replayed()
    for owner, paths in _journals(root).items():
        if alive(owner):
            continue
        read = _read(paths)
        result.skipped += read.torn + read.marked
        if read.database is not None and read.database != database:
            result.foreign += 1
            log.info(
                "activity log: the journal of %s belongs to another database; left alone",
                owner,
                extra={"action": "journal_foreign", "owner": owner},
            )
            continue
        dropped = 0
        try:
            for start in range(0, len(read.rows), batch):
                dropped += writer(read.rows[start : start + batch])
        except Exception as exc:
            result.kept += 1
            log.warning(
                "activity log: cannot replay the journal of %s (%d records): %s; kept "
                "for the next attempt",
                owner,
                len(read.rows),
                exc,
                extra={
                    "action": "journal_kept",
                    "owner": owner,
                    "records": len(read.rows),
                    "cause": f"{type(exc).__name__}: {exc}",
                },
            )
            continue
        _unlink(paths)
        result.journals += 1
        result.saved += len(read.rows) - dropped
        result.dropped += dropped
        log.info(
            "activity log: replayed the journal of %s: %d records saved, %d refused, "
            "%d lines skipped",
            owner,
            len(read.rows) - dropped,
            dropped,
            read.torn + read.marked,
            extra={
                "action": "journal_replayed",
                "owner": owner,
                "saved": len(read.rows) - dropped,
                "dropped": dropped,
                "torn": read.torn,
                "marked": read.marked,
            },
        )
    return result


def replay_dead(directory: str | os.PathLike[str] | None = None) -> int:
    """:func:`replay` of the state directory's journals (``llamaswap serve`` before serving,
    and the recorder once its database answers). Returns how many journals were kept
    because the database failed. Blocking."""
    if directory is None:
        from scheduler.sweep import state_dir

        directory = directory_for(state_dir())
    return replay(directory).kept


def for_server(**options: Any) -> Journal:
    """This server's journal in the state directory, opened. Raises ``OSError``."""
    from scheduler.sweep import owner_id, state_dir

    journal = Journal(
        directory_for(state_dir()), owner_id(), database_identity(), **options
    )
    journal.open()
    return journal
