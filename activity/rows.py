"""A finished request's record, from ticket to row to database (Django's sync thread).

* :func:`snapshot`: the raw facts of a finished ticket as plain values (what the journal
  writes on the event loop's thread); :func:`snapshot_fields` the row made of them, and
  :func:`record_fields` both at once, so a live write and a replayed one give the same row.
* :func:`write_records` (the :class:`activity.recorder.Recorder`'s batches) and
  :func:`write_rows` (``activity.journal``'s replay): one prepared multi-row INSERT in
  short chunks, rows already saved skipped, rows the database refuses dropped one by one.
* :func:`prune`: retention by age and by count.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from scheduler.core.policy import Policy, SchedulerSettings
from scheduler.dispatcher import Outcome, Ticket

log = logging.getLogger("llamaswap.recorder")

PRUNE_CHUNK = 5_000
SQLITE_BUSY_MS = 1_000
"""The writer's SQLite busy timeout: a locked database fails the batch fast (it is
retried) instead of holding Django's sync thread for the default 5 s."""

Item = tuple[Ticket, SchedulerSettings, float]
"""A finished ticket, the settings it was scheduled under, and its finish time."""


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


SNAPSHOT_VERSION = 2
"""Version 2 added the fleet's placement decision (the last value); a journal of version 1
written before an upgrade is still replayed (no placement)."""


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
        str(extra.get("placement") or ""),
    )


def record_fields(ticket: Ticket, settings: SchedulerSettings, finished: float) -> dict[str, Any]:
    """The :class:`~activity.models.RequestRecord` fields for one finished ticket."""
    return snapshot_fields(snapshot(ticket, settings, finished))


def snapshot_fields(snap: tuple[Any, ...]) -> dict[str, Any]:
    """The :class:`~activity.models.RequestRecord` fields of a :func:`snapshot`."""
    if snap[0] == 1:  # journaled before placement was recorded
        snap = (*snap, "")
    elif snap[0] != SNAPSHOT_VERSION:
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
        placement,
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
        "placement": placement[:500],
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


class _Columns:
    """The INSERT's columns, prepared once a batch: each one's default, a getter of all
    their values in order (``operator.itemgetter``: one C call instead of a Python loop
    over ~40 columns), and the adapters of the few that need one (datetimes, JSON), by
    position."""

    __slots__ = ("defaults", "values", "adapters")

    def __init__(self, columns: list[tuple[str, Callable[[Any], Any] | None, Any]]) -> None:
        self.defaults = {name: default for name, _, default in columns}
        self.values = operator.itemgetter(*(name for name, _, _ in columns))
        self.adapters = [
            (index, adapter) for index, (_, adapter, _) in enumerate(columns) if adapter is not None
        ]


def _statement() -> tuple[str, _Columns]:
    """``INSERT ... ON CONFLICT (request_id) DO NOTHING`` for the current connection, and
    its columns (field name, adapter to a driver value or None, default)."""
    from activity.models import RequestRecord

    ops = connection.ops
    qn: Callable[[Any], str] = ops.quote_name
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
    request_id: Any = RequestRecord._meta.get_field("request_id")
    sql = "INSERT INTO {} ({}) VALUES ({}) ON CONFLICT ({}) DO NOTHING".format(
        qn(RequestRecord._meta.db_table),
        ", ".join(qn(f.column) for f in fields),
        ", ".join(["%s"] * len(fields)),
        qn(request_id.column),
    )
    return sql, _Columns(columns)


def _params(fields: dict[str, Any], columns: _Columns) -> tuple[Any, ...]:
    """The row's values in column order: a field's value, else the column's default."""
    row = list(columns.values({**columns.defaults, **fields}))
    for index, adapter in columns.adapters:
        row[index] = adapter(row[index])
    return tuple(row)


def write_records(items: Sequence[Item], pause: float = WRITE_PAUSE) -> int:
    """Save a batch in one transaction; returns how many were dropped.

    Raises on a transient database error (the caller retries the whole batch). Rows
    already saved by an earlier, interrupted attempt are skipped (``request_id`` is
    unique), so a retry never duplicates. One multi-row INSERT statement prepared once
    (not ``bulk_create``, which spends ~70 µs of Python per row compiling SQL), run in
    chunks with short pauses so the event loop's thread gets the GIL (see WRITE_PAUSE).
    """
    return _save(items, _item_fields, pause)


def _item_fields(item: Item) -> dict[str, Any]:
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
