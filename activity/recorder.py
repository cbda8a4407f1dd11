"""The activity log's writer: a dispatcher observer that saves one row per request.

On the dispatch path :meth:`Recorder.on_finish` writes the record as one line to the
journal (:mod:`activity.journal`: it survives a killed server; a few microseconds) and
appends the finished ticket to a bounded deque (tickets are done changing by then: the
decision was set at dispatch, usage and timings before the finish). A background task
takes batches off the deque every ``interval`` seconds, or sooner once ``batch_size`` are
waiting, and saves each batch in one transaction in Django's sync thread
(:func:`write_records`); the conversion from tickets to rows happens in that thread too,
so the event loop does nothing per record but the journal's line and the append. A
committed batch marks the journal done up to it. When the server stops with records
unsaved (the database away), the journal keeps them for the next start instead.

When the database is unavailable the batch stays at the head of the deque and is retried
with exponential backoff, while proxying goes on. The deque is bounded: beyond
``capacity`` new records are dropped, counted in
``llamaswap_activity_records_dropped_total`` and logged. A batch the database refuses for
good (no such table: not migrated; a bad value) is retried row by row and the rows that
still fail are dropped the same way, so one bad record never blocks the others.

Retention (:func:`prune`) runs in the same task every ``prune_every`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from activity import metrics
from activity.journal import Journal
from scheduler.core.policy import Policy, SchedulerSettings
from scheduler.dispatcher import Outcome, Ticket
from scheduler.process import ModelState

log = logging.getLogger("llamaswap.recorder")

DEFAULT_CAPACITY = 10_000
DEFAULT_BATCH = 500
DEFAULT_INTERVAL = 0.5
MAX_BACKOFF = 10.0
PRUNE_CHUNK = 5_000
SQLITE_BUSY_MS = 1_000
"""The recorder's SQLite busy timeout: a locked database fails the batch fast (it is
retried) instead of holding Django's sync thread for the default 5 s."""
REPLAY_RETRY = 30.0
"""Seconds between two replays of dead servers' journals that the database refused."""

_Item = tuple[Ticket, SchedulerSettings, float]
"""A finished ticket, the settings it was scheduled under, and its finish time."""


class Recorder:
    """Saves every finished inference request to :class:`activity.models.RequestRecord`.

    ``await start()`` on the server's loop, ``await stop()`` at shutdown (flushes what
    it can). ``writer`` (for tests) replaces the database write: it gets the items of a
    batch in Django's sync thread and returns how many it dropped.

    ``journal`` makes each record durable against a killed server as it finishes
    (:mod:`activity.journal`); ``replay`` (run in Django's sync thread once the database
    answers, and again every :data:`REPLAY_RETRY` s while it returns a count of journals
    still kept) saves what dead servers' journals hold.
    """

    def __init__(
        self,
        settings: SchedulerSettings | None = None,
        *,
        capacity: int = DEFAULT_CAPACITY,
        batch_size: int = DEFAULT_BATCH,
        interval: float = DEFAULT_INTERVAL,
        retention_days: int = 30,
        retention_rows: int = 100_000,
        prune_every: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        writer: Callable[[Sequence[_Item]], int] | None = None,
        journal: Journal | None = None,
        replay: Callable[[], int] | None = None,
    ) -> None:
        self.capacity = capacity
        self.batch_size = batch_size
        self.interval = interval
        self.retention_days = retention_days
        self.retention_rows = retention_rows
        self.prune_every = prune_every
        self._settings = settings or SchedulerSettings()
        self._clock = clock
        self._writer = writer or write_records
        self._buffer: deque[_Item] = deque()
        self._journal = journal
        self._seqs: deque[int] = deque()
        """Each buffered record's journal sequence number (0: not journaled), in step with
        the buffer: a committed batch marks the journal done up to its last one."""
        self._replay = replay
        self._replay_due = replay is not None
        """Dead servers' journals may wait for a replay (the database was away at start)."""
        self._replay_at = 0.0
        self._upkeep: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._failures = 0
        self.written = 0
        self.dropped = 0
        self._drop_logged_at = float("-inf")
        self._drops_unlogged = 0
        self._drop_reason = ""

    # -- the observer (dispatcher task: append only) ---------------------------------------

    def on_enqueue(self, ticket: Ticket) -> None:
        pass

    def on_dispatch(self, ticket: Ticket) -> None:
        pass

    def on_finish(self, ticket: Ticket) -> None:
        if ticket.outcome is None or ticket.extra.get("preload"):
            return
        buffer = self._buffer
        if len(buffer) >= self.capacity:
            self._drop(1, "the buffer is full (is the database unavailable?)")
            return
        finished = ticket.finished_at if ticket.finished_at is not None else self._clock()
        seq = 0
        if self._journal is not None:
            # The record on disk (the page cache) before anything else: from here on a
            # killed server loses nothing (activity/journal.py). One line, one write.
            try:
                seq = self._journal.append(snapshot(ticket, self._settings, finished))
            except Exception:  # a record that cannot be built: the writer drops it
                log.exception("activity log: cannot journal a record", extra={"action": "record_refused"})
        buffer.append((ticket, self._settings, finished))
        self._seqs.append(seq)
        if len(buffer) == self.batch_size and self._wake is not None:
            self._wake.set()

    def on_model_state(self, model: str, state: ModelState) -> None:
        pass

    def on_settings(self, settings: SchedulerSettings, source: str) -> None:
        self._settings = settings

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Records waiting to be saved."""
        return len(self._buffer)

    async def start(self) -> None:
        if self._task is not None:
            return
        self._stopping = False
        self._wake = asyncio.Event()
        metrics.RECORDS_BUFFERED.set_function(lambda: len(self._buffer))
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="recorder")
        if self._journal is not None:
            self._upkeep = loop.create_task(self._keep_journal(), name="recorder-journal")

    async def stop(self, timeout: float = 5.0) -> None:
        """Save what is buffered (for up to ``timeout`` seconds), then stop."""
        task, self._task = self._task, None
        if task is None:
            await _close_connection()
            return
        self._stopping = True
        assert self._wake is not None
        self._wake.set()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(task)
        except TimeoutError:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._upkeep is not None:
            self._upkeep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._upkeep
            self._upkeep = None
        if self._buffer:
            unjournaled = self._seqs.count(0)
            if unjournaled:
                self._drop(unjournaled, "the server stopped before they were saved")
            if len(self._buffer) > unjournaled:
                log.warning(
                    "activity log: %d records kept in the journal for the next start",
                    len(self._buffer) - unjournaled,
                    extra={"action": "journal_kept", "records": len(self._buffer) - unjournaled},
                )
            self._buffer.clear()
            self._seqs.clear()
        if self._journal is not None:
            self._journal.seal()
            await asyncio.to_thread(self._journal.close)
        self._flush_drop_log()
        await _close_connection()

    async def flush(self) -> None:
        """Save everything buffered now (tests, shutdown). Stops at the first failure."""
        while self._buffer:
            if not await self._write_batch():
                return

    # -- the background task ---------------------------------------------------------------

    async def _run(self) -> None:
        assert self._wake is not None
        loop = asyncio.get_running_loop()
        next_prune = loop.time() + min(self.prune_every, 10.0)
        while True:
            delay = self.interval if not self._failures else _backoff(self._failures)
            if not self._stopping or self._failures:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
            self._wake.clear()
            while self._buffer:
                if not await self._write_batch():
                    break
                if len(self._buffer) < self.batch_size and not self._stopping:
                    break  # the rest goes with the next batch
            if self._stopping and not self._buffer:
                return  # stop() bounds the retries of a last, failing batch
            if self._replay_due and not self._failures and loop.time() >= self._replay_at:
                self._replay_due = await self._replay_journals()
                self._replay_at = loop.time() + REPLAY_RETRY
            if loop.time() >= next_prune and not self._failures:
                next_prune = loop.time() + self.prune_every
                await self._prune()
            self._flush_drop_log()

    async def _write_batch(self) -> bool:
        batch = list(itertools.islice(self._buffer, self.batch_size))
        try:
            dropped = await sync_to_async(self._writer, thread_sensitive=True)(batch)
        except Exception as exc:
            self._failures += 1
            if self._failures == 1 or self._failures % 10 == 0:
                log.warning(
                    "activity log: database unavailable, %d records buffered; retrying",
                    len(self._buffer),
                    extra={
                        "action": "record_retry",
                        "buffered": len(self._buffer),
                        "attempt": self._failures,
                        "cause": f"{type(exc).__name__}: {exc}",
                    },
                )
            return False
        if self._failures:
            log.info(
                "activity log: database back, saving %d buffered records",
                len(self._buffer),
                extra={"action": "record_recovered", "buffered": len(self._buffer)},
            )
            self._replay_due = True  # journals a start could not replay: try them now
        self._failures = 0
        done = 0
        for _ in range(len(batch)):
            self._buffer.popleft()
            done = self._seqs.popleft() or done
        if done and self._journal is not None:
            self._journal.mark_done(done)
        saved = len(batch) - dropped
        self.written += saved
        metrics.RECORDS_WRITTEN.inc(saved)
        if dropped:
            self._drop(dropped, "the database refused them")
        return True

    async def _keep_journal(self) -> None:
        """The journal's fsync (at most once per ``sync_interval``), rotation and deletion
        of what the database has (activity/journal.py)."""
        journal = self._journal
        assert journal is not None
        while True:
            await asyncio.sleep(journal.sync_interval)
            try:
                await journal.upkeep()
            except Exception:
                log.exception("activity log: journal upkeep failed", extra={"action": "journal_failed"})

    async def _replay_journals(self) -> bool:
        """Journals of dead servers that the start could not replay (the database was
        away), replayed once it answers again. True: some are still kept (try later)."""
        if self._replay is None:
            return False
        try:
            return bool(await sync_to_async(self._replay, thread_sensitive=True)())
        except Exception:
            log.exception("activity log: journal replay failed", extra={"action": "journal_failed"})
            return True

    async def _prune(self) -> None:
        try:
            deleted = await sync_to_async(prune, thread_sensitive=True)(
                self.retention_days, self.retention_rows
            )
        except Exception as exc:
            log.warning(
                "activity log: pruning failed",
                extra={"action": "record_prune", "cause": f"{type(exc).__name__}: {exc}"},
            )
            return
        if deleted:
            log.info(
                "activity log: pruned %d rows",
                deleted,
                extra={"action": "record_prune", "deleted": deleted},
            )

    def _drop(self, count: int, reason: str) -> None:
        self.dropped += count
        metrics.RECORDS_DROPPED.inc(count)
        self._drops_unlogged += count
        self._drop_reason = reason
        if self._clock() - self._drop_logged_at >= 10.0:
            self._flush_drop_log()

    def _flush_drop_log(self) -> None:
        if not self._drops_unlogged:
            return
        log.warning(
            "activity log: dropped %d records: %s",
            self._drops_unlogged,
            self._drop_reason,
            extra={
                "action": "record_drop",
                "dropped": self._drops_unlogged,
                "dropped_total": self.dropped,
                "cause": self._drop_reason,
            },
        )
        self._drops_unlogged = 0
        self._drop_logged_at = self._clock()


async def _close_connection() -> None:
    """Close the writer thread's database connection (it would outlive the server)."""

    def close() -> None:
        connection.close()  # resolved in the writer thread: connections are per thread

    with contextlib.suppress(Exception):
        await sync_to_async(close, thread_sensitive=True)()


def _backoff(failures: int) -> float:
    return min(MAX_BACKOFF, 0.25 * 2 ** min(failures, 10))


# -- the database side (Django's sync thread) ------------------------------------------------


def _ms(seconds: float | None) -> float | None:
    return max(0.0, seconds) * 1000.0 if seconds is not None else None


def _int64(value: int | None) -> int | None:
    """Clamped to the column (model priority + header priority can leave 64 bits)."""
    return None if value is None else min(max(value, -(2**63)), 2**63 - 1)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


SNAPSHOT_VERSION = 1


def snapshot(ticket: Ticket, settings: SchedulerSettings, finished: float) -> tuple[Any, ...]:
    """The raw facts a finished ticket's record is made of, as plain values (str, int,
    float, None, bool and the upstream's parsed JSON), so the journal can ``marshal`` them in
    a few microseconds on the event loop's thread. :func:`snapshot_fields` makes the
    record of it, here or after a replay, so both give the same row."""
    d = ticket.decision
    extra = ticket.extra
    usage = extra.get("usage")
    timings = extra.get("timings")
    return (
        SNAPSHOT_VERSION,
        ticket.request_id,
        ticket.model.id,
        str(extra.get("requested_model") or ""),
        str(extra.get("peer") or ""),
        ticket.path,
        ticket.priority,
        ticket.api_key,
        ticket.requested_priority,
        ticket.lane,
        ticket.arrival,
        ticket.arrival_wall,
        ticket.dispatched_at,
        ticket.ready_at,
        finished,
        (ticket.outcome or Outcome.FAILED).value,
        ticket.status,
        ticket.error,
        ticket.load_seconds,
        None
        if d is None
        else (
            d.band.value,
            d.policy.value,
            d.queue_wait,
            d.score,
            d.affinity,
            d.aging,
            sorted(term.value for term in d.reordered_by) if d.reordered_by else [],
            d.runner_up_id,
            d.runner_up_score,
            d.needs_swap,
            d.fifo_priority,
            d.waiting_after,
        ),
        settings.use.value,
        settings.aging_divisor,
        settings.swap_affinity_bonus,
        usage if isinstance(usage, dict) else None,
        timings if isinstance(timings, dict) else None,
    )


def record_fields(ticket: Ticket, settings: SchedulerSettings, finished: float) -> dict[str, Any]:
    """The :class:`~activity.models.RequestRecord` fields for one finished ticket."""
    return snapshot_fields(snapshot(ticket, settings, finished))


def snapshot_fields(snap: tuple[Any, ...]) -> dict[str, Any]:
    """The :class:`~activity.models.RequestRecord` fields of a :func:`snapshot`."""
    if snap[0] != SNAPSHOT_VERSION:
        raise ValueError(f"a record snapshot of version {snap[0]!r}")
    (
        _,
        request_id,
        model,
        requested_model,
        peer,
        path,
        priority,
        api_key,
        requested_priority,
        lane,
        arrival,
        arrival_wall,
        dispatched_at,
        ready_at,
        finished,
        outcome,
        status,
        error,
        load_seconds,
        d,
        use,
        aging_divisor,
        swap_affinity_bonus,
        usage,
        timings,
    ) = snap

    def wall(at: float | None) -> datetime | None:
        if at is None:
            return None
        return datetime.fromtimestamp(arrival_wall + (at - arrival), tz=UTC)

    fields: dict[str, Any] = {
        "request_id": request_id[:64],
        "model": model[:255],
        "requested_model": requested_model[:255],
        "peer": peer[:255],
        "path": path[:255],
        "priority": _int64(priority),
        "api_key": api_key[:64],
        "requested_priority": _int64(requested_priority),
        "band": d[0] if d else _band(priority),
        "policy": "peer" if peer else d[1] if d else use,
        "lane": lane[:64],
        "arrived_at": wall(arrival),
        "dispatched_at": wall(dispatched_at),
        "ready_at": wall(ready_at),
        "finished_at": wall(finished),
        "outcome": outcome,
        "status": status,
        "error": (error or "")[:2000],
        "duration_ms": max(0.0, finished - arrival) * 1000.0,
        "load_ms": _ms(load_seconds),
        "run_ms": _ms(finished - ready_at) if ready_at is not None else None,
    }
    if d is not None:
        (
            _,
            policy,
            queue_wait,
            score,
            affinity,
            aging,
            reordered_by,
            runner_up_id,
            runner_up_score,
            needs_swap,
            fifo_priority,
            waiting_after,
        ) = d
        fields.update(
            queue_wait_ms=queue_wait * 1000.0,
            score=score,
            affinity=affinity,
            aging=aging,
            reordered_by=list(reordered_by),
            runner_up_id=(runner_up_id or "")[:64],
            runner_up_score=runner_up_score,
            needs_swap=needs_swap,
            fifo_priority=_int64(fifo_priority),
            waiting_after=waiting_after,
        )
        if policy == Policy.SERIAL.value:
            fields.update(
                aging_divisor=float(aging_divisor),
                swap_affinity_bonus=swap_affinity_bonus,
            )
    if usage is not None:
        fields["usage"] = usage
        fields["prompt_tokens"] = _int(usage.get("prompt_tokens"))
        fields["completion_tokens"] = _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            fields["cached_tokens"] = _int(details.get("cached_tokens"))
    if timings is not None:
        fields["timings"] = timings
        fields["prompt_per_second"] = _number(timings.get("prompt_per_second"))
        fields["tokens_per_second"] = _number(timings.get("predicted_per_second"))
        if fields.get("prompt_tokens") is None:
            fields["prompt_tokens"] = _int(timings.get("prompt_n"))
        if fields.get("completion_tokens") is None:
            fields["completion_tokens"] = _int(timings.get("predicted_n"))
        if fields.get("cached_tokens") is None:
            fields["cached_tokens"] = _int(timings.get("cache_n"))
    return fields


def _band(priority: int) -> str:
    from scheduler.core.priority import band_of

    return band_of(priority).value


def _prepare_connection() -> None:
    """Connect if needed (a failed attempt closed the connection); keep SQLite fail-fast."""
    if connection.vendor == "sqlite":
        connection.ensure_connection()
        with connection.cursor() as cursor:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_MS}")


def _transient(exc: DatabaseError) -> bool:
    """A database that is down, locked or unreachable (retry) rather than one that refuses
    the rows (missing table, bad value: drop them)."""
    if not isinstance(exc, OperationalError | InterfaceError):
        return False
    text = str(exc).lower()
    return not ("no such table" in text or "no such column" in text or "has no column" in text)


WRITE_CHUNK = 4
"""Rows converted or inserted between two pauses of the writer thread (~0.1 ms of work)."""
WRITE_PAUSE = 0.0001
"""The writer thread's pause between chunks. Building rows is Python code that holds the
GIL: without pauses the event loop's thread would wait up to the interpreter's switch
interval (5 ms) for it at every loop iteration during a flush, and that shows in the
dispatch gap (bench/bench_dispatch_gap.py). A real sleep (not ``sleep(0)``, which the
writer would win back at once) hands the GIL over; the loop then waits at most one
chunk's worth. The writer still saves several thousand rows a second."""


def _statement() -> tuple[str, list[tuple[str, Callable[[Any], Any] | None, Any]]]:
    """``INSERT ... ON CONFLICT (request_id) DO NOTHING`` for the current connection, and
    per column (field name, adapter to a driver value or None, default)."""
    from activity.models import RequestRecord

    ops = connection.ops
    qn = ops.quote_name
    fields = [f for f in RequestRecord._meta.concrete_fields if not f.primary_key]
    columns: list[tuple[str, Callable[[Any], Any] | None, Any]] = []
    for field in fields:
        kind = field.get_internal_type()
        adapter: Callable[[Any], Any] | None = None
        if kind == "DateTimeField":
            adapter = ops.adapt_datetimefield_value
            if connection.vendor == "sqlite" and connection.timezone_name == "UTC":
                # What Django's adapter makes of our UTC datetimes, without its zoneinfo
                # round trip (4 us a value): the naive UTC time as text.
                def adapter(value: Any) -> Any:
                    return None if value is None else str(value.replace(tzinfo=None))
        elif kind == "JSONField":
            encoder = getattr(field, "encoder", None)

            def adapter(value: Any, encoder: Any = encoder) -> Any:
                return None if value is None else ops.adapt_json_value(value, encoder)

        default = field.get_default() if field.has_default() else None
        columns.append((field.name, adapter, default))
    sql = "INSERT INTO {} ({}) VALUES ({}) ON CONFLICT ({}) DO NOTHING".format(
        qn(RequestRecord._meta.db_table),
        ", ".join(qn(f.column) for f in fields),
        ", ".join(["%s"] * len(fields)),
        qn(RequestRecord._meta.get_field("request_id").column),
    )
    return sql, columns


def _params(fields: dict[str, Any], columns: list[tuple[str, Callable[[Any], Any] | None, Any]]) -> tuple:
    return tuple(
        adapter(fields.get(name, default)) if adapter else fields.get(name, default)
        for name, adapter, default in columns
    )


def write_records(items: Sequence[_Item], pause: float = WRITE_PAUSE) -> int:
    """Save a batch in one transaction; returns how many were dropped.

    Raises on a transient database error (the caller retries the whole batch). Rows
    already saved by an earlier, interrupted attempt are skipped (``request_id`` is
    unique), so a retry never duplicates. One multi-row INSERT statement prepared once
    (not ``bulk_create``, which spends ~70 µs of Python per row compiling SQL), run in
    chunks with short pauses so the event loop's thread gets the GIL (see WRITE_PAUSE).
    """
    return _save(items, _item_fields, pause)


def _item_fields(item: _Item) -> dict[str, Any]:
    return record_fields(*item)


def write_rows(rows: Sequence[tuple[Any, ...]], pause: float = WRITE_PAUSE) -> int:
    """Save journaled records (:func:`snapshot` tuples, ``activity.journal``'s replay)
    like :func:`write_records`; returns how many were dropped. Records already saved are
    skipped (``request_id``).

    Unlike the live writer it raises, rather than drops the rows, when the table or a
    column is missing: the journal is then kept for a start after ``llamaswap migrate``.
    """
    return _save(rows, snapshot_fields, pause, keep_on_schema_error=True)


def _schema_error(exc: DatabaseError) -> bool:
    """The database lacks the table or a column (not migrated), rather than refusing a row."""
    text = str(exc).lower()
    return any(
        marker in text
        for marker in ("no such table", "no such column", "has no column", "does not exist")
    )


def _save(
    items: Sequence[Any],
    build: Callable[[Any], dict[str, Any]],
    pause: float,
    keep_on_schema_error: bool = False,
) -> int:
    try:
        _prepare_connection()
        sql, columns = _statement()
    except DatabaseError:
        with contextlib.suppress(Exception):
            connection.close()
        raise
    params = []
    dropped = 0
    for index, item in enumerate(items, 1):
        try:
            params.append(_params(build(item), columns))
        except Exception:  # a bug must cost one record, not the log
            log.exception("activity log: cannot build a record", extra={"action": "record_refused"})
            dropped += 1
        if pause and index % WRITE_CHUNK == 0:
            time.sleep(pause)
    if not params:
        return dropped
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            for start in range(0, len(params), WRITE_CHUNK):
                cursor.executemany(sql, params[start : start + WRITE_CHUNK])
                if pause:
                    time.sleep(pause)
        return dropped
    except DatabaseError as exc:
        with contextlib.suppress(Exception):
            connection.close()
        if _transient(exc) or (keep_on_schema_error and _schema_error(exc)):
            raise
        first_error = exc
    # The database refuses the batch for good: save what it accepts, one by one.
    refused = 0
    for row in params:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(sql, row)
        except DatabaseError as exc:
            if _transient(exc):
                raise
            refused += 1
    if refused:
        hint = " (run `llamaswap migrate`)" if "no such table" in str(first_error).lower() else ""
        log.error(
            "activity log: the database refused %d records: %s%s",
            refused,
            first_error,
            hint,
            extra={"action": "record_refused", "dropped": refused, "cause": str(first_error)},
        )
    return dropped + refused


def prune(days: int, rows: int, now: datetime | None = None, chunk: int = PRUNE_CHUNK) -> int:
    """Delete rows older than ``days`` and beyond the newest ``rows`` (0 keeps all).

    Deletes in chunks of ``chunk`` rows so that no single statement holds the database
    for long. Returns how many rows were deleted.
    """
    from activity.models import RequestRecord

    objects = RequestRecord.objects
    deleted = 0
    if days > 0:
        cutoff = (now or timezone.now()) - timedelta(days=days)
        while True:
            ids = list(
                objects.filter(arrived_at__lt=cutoff)
                .order_by("id")
                .values_list("id", flat=True)[:chunk]
            )
            if not ids:
                break
            deleted += objects.filter(id__in=ids).delete()[0]
    if rows > 0:
        boundary = list(objects.order_by("-id").values_list("id", flat=True)[rows : rows + 1])
        if boundary:
            while True:
                ids = list(
                    objects.filter(id__lte=boundary[0])
                    .order_by("id")
                    .values_list("id", flat=True)[:chunk]
                )
                if not ids:
                    break
                deleted += objects.filter(id__in=ids).delete()[0]
    return deleted
