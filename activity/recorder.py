"""The activity log's writer: a dispatcher observer that saves one row per request.

On the dispatch path :meth:`Recorder.on_finish` only appends the finished ticket to a
bounded deque (tickets are done changing by then: the decision was set at dispatch, usage
and timings before the finish). A background task takes batches off the deque every
``interval`` seconds, or sooner once ``batch_size`` are waiting, and saves each batch in
one transaction in Django's sync thread (:func:`write_records`); the conversion from
tickets to rows happens in that thread too, so the event loop does nothing per record but
the append.

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

_Item = tuple[Ticket, SchedulerSettings, float]
"""A finished ticket, the settings it was scheduled under, and its finish time."""


class Recorder:
    """Saves every finished inference request to :class:`activity.models.RequestRecord`.

    ``await start()`` on the server's loop, ``await stop()`` at shutdown (flushes what
    it can). ``writer`` (for tests) replaces the database write: it gets the items of a
    batch in Django's sync thread and returns how many it dropped.
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
        buffer.append((ticket, self._settings, finished))
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
        self._task = asyncio.get_running_loop().create_task(self._run(), name="recorder")

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
        if self._buffer:
            self._drop(len(self._buffer), "the server stopped before they were saved")
            self._buffer.clear()
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
        self._failures = 0
        for _ in range(len(batch)):
            self._buffer.popleft()
        saved = len(batch) - dropped
        self.written += saved
        metrics.RECORDS_WRITTEN.inc(saved)
        if dropped:
            self._drop(dropped, "the database refused them")
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


def _wall(ticket: Ticket, at: float | None) -> datetime | None:
    if at is None:
        return None
    return datetime.fromtimestamp(ticket.arrival_wall + (at - ticket.arrival), tz=UTC)


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


def record_fields(ticket: Ticket, settings: SchedulerSettings, finished: float) -> dict[str, Any]:
    """The :class:`~activity.models.RequestRecord` fields for one finished ticket."""
    d = ticket.decision
    outcome = ticket.outcome or Outcome.FAILED
    fields: dict[str, Any] = {
        "request_id": ticket.request_id[:64],
        "model": ticket.model.id[:255],
        "requested_model": str(ticket.extra.get("requested_model") or "")[:255],
        "peer": str(ticket.extra.get("peer") or "")[:255],
        "path": ticket.path[:255],
        "priority": _int64(ticket.priority),
        "api_key": ticket.api_key[:64],
        "requested_priority": _int64(ticket.requested_priority),
        "band": d.band.value if d else _band(ticket.priority),
        "policy": "peer" if ticket.extra.get("peer") else d.policy.value if d else settings.use.value,
        "lane": ticket.lane[:64],
        "arrived_at": _wall(ticket, ticket.arrival),
        "dispatched_at": _wall(ticket, ticket.dispatched_at),
        "ready_at": _wall(ticket, ticket.ready_at),
        "finished_at": _wall(ticket, finished),
        "outcome": outcome.value,
        "status": ticket.status,
        "error": (ticket.error or "")[:2000],
        "duration_ms": max(0.0, finished - ticket.arrival) * 1000.0,
        "load_ms": _ms(ticket.load_seconds),
        "run_ms": _ms(finished - ticket.ready_at) if ticket.ready_at is not None else None,
    }
    if d is not None:
        fields.update(
            queue_wait_ms=d.queue_wait * 1000.0,
            score=d.score,
            affinity=d.affinity,
            aging=d.aging,
            reordered_by=sorted(term.value for term in d.reordered_by),
            runner_up_id=(d.runner_up_id or "")[:64],
            runner_up_score=d.runner_up_score,
            needs_swap=d.needs_swap,
            fifo_priority=_int64(d.fifo_priority),
            waiting_after=d.waiting_after,
        )
        if d.policy is Policy.SERIAL:
            fields.update(
                aging_divisor=float(settings.aging_divisor),
                swap_affinity_bonus=settings.swap_affinity_bonus,
            )
    usage = ticket.extra.get("usage")
    if isinstance(usage, dict):
        fields["usage"] = usage
        fields["prompt_tokens"] = _int(usage.get("prompt_tokens"))
        fields["completion_tokens"] = _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            fields["cached_tokens"] = _int(details.get("cached_tokens"))
    timings = ticket.extra.get("timings")
    if isinstance(timings, dict):
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


def _params(item: _Item, columns: list[tuple[str, Callable[[Any], Any] | None, Any]]) -> tuple:
    fields = record_fields(*item)
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
            params.append(_params(item, columns))
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
        if _transient(exc):
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
