"""A finished request's record, from ticket to row to database (Django's sync thread).

* :func:`snapshot`: the raw facts of a finished ticket as plain values (what the journal
  writes on the event loop's thread); :func:`snapshot_fields` the row made of them, and
  :func:`record_fields` both at once, so a live write and a replayed one give the same row.
* :func:`write_records` (the :class:`activity.recorder.Recorder`'s batches) and
  :func:`write_rows` (``activity.journal``'s replay): one prepared INSERT for a whole
  batch, its rows built in short chunks straight into the database's values (no
  ``datetime`` or dict per row: ~13 µs a row instead of ~30), rows already saved
  skipped, rows the database refuses dropped one by one.
* :func:`prune`: retention by age and by count.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.db.backends.base.operations import BaseDatabaseOperations
from django.utils import timezone

from scheduler.core.policy import Policy, SchedulerSettings
from scheduler.dispatcher import Outcome, Ticket

log = logging.getLogger("llamaswap.recorder")

PRUNE_CHUNK = 5_000
SQLITE_BUSY_MS = 1_000
"""The writer's SQLite busy timeout: a locked database fails the batch fast (it is
retried) instead of holding Django's sync thread for the default 5 s."""

Item = (
    tuple[Ticket, SchedulerSettings, float]
    | tuple[Ticket, SchedulerSettings, float, tuple[Any, ...]]
)
"""A finished ticket, the settings it was scheduled under, its finish time and, when the
journal took it already, its :func:`snapshot` (the writer makes the row of that one)."""


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


FIELDS = (
    "request_id",
    "model",
    "requested_model",
    "peer",
    "placement",
    "path",
    "priority",
    "api_key",
    "requested_priority",
    "band",
    "policy",
    "lane",
    "arrived_at",
    "dispatched_at",
    "ready_at",
    "finished_at",
    "outcome",
    "status",
    "error",
    "duration_ms",
    "load_ms",
    "run_ms",
    "queue_wait_ms",
    "score",
    "affinity",
    "aging",
    "reordered_by",
    "runner_up_id",
    "runner_up_score",
    "needs_swap",
    "fifo_priority",
    "waiting_after",
    "aging_divisor",
    "swap_affinity_bonus",
    "usage",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "timings",
    "prompt_per_second",
    "tokens_per_second",
)
"""The :class:`~activity.models.RequestRecord` fields a snapshot gives, in the order of
:func:`_values` (``node`` is not among them: the server's, its column's default)."""
TIMES = frozenset(("arrived_at", "dispatched_at", "ready_at", "finished_at"))
"""Fields :func:`_values` gives as wall-clock seconds since the epoch (None: never)."""


def record_fields(ticket: Ticket, settings: SchedulerSettings, finished: float) -> dict[str, Any]:
    """The :class:`~activity.models.RequestRecord` fields for one finished ticket."""
    return snapshot_fields(snapshot(ticket, settings, finished))


def snapshot_fields(snap: tuple[Any, ...]) -> dict[str, Any]:
    """The :class:`~activity.models.RequestRecord` fields of a :func:`snapshot` (every
    field but ``node``; what the row holds where the record knows nothing)."""
    fields = dict(zip(FIELDS, _values(snap), strict=True))
    for name in TIMES:
        at = fields[name]
        fields[name] = None if at is None else datetime.fromtimestamp(at, tz=UTC)
    return fields


def _values(snap: tuple[Any, ...]) -> tuple[Any, ...]:
    """The record of a :func:`snapshot`: the values of :data:`FIELDS` in order, times as
    wall-clock seconds (the writer turns them into the database's values without a
    ``datetime`` each, see :class:`_Columns`). A tuple, not a dict: this runs for every
    request in the writer's thread, which holds the GIL while it does."""
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
    if d is None:
        band = _band(priority)
        policy = "peer" if peer else use
        # Its columns' defaults: queue_wait_ms, score, affinity, aging, reordered_by,
        # runner_up_id, runner_up_score, needs_swap, fifo_priority, waiting_after,
        # aging_divisor, swap_affinity_bonus.
        decision: tuple[Any, ...] = (None, None, None, None, [], "", *(None,) * 6)
    else:
        (
            band,
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
        serial = policy == Policy.SERIAL.value
        if peer:
            policy = "peer"
        decision = (
            queue_wait * 1000.0,
            score,
            affinity,
            aging,
            list(reordered_by),
            (runner_up_id or "")[:64],
            runner_up_score,
            needs_swap,
            _int64(fifo_priority),
            waiting_after,
            float(aging_divisor) if serial else None,
            swap_affinity_bonus if serial else None,
        )
    prompt_tokens = completion_tokens = cached_tokens = None
    prompt_rate = token_rate = None
    if usage is not None:
        prompt_tokens = _int(usage.get("prompt_tokens"))
        completion_tokens = _int(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached_tokens = _int(details.get("cached_tokens"))
    if timings is not None:
        prompt_rate = _number(timings.get("prompt_per_second"))
        token_rate = _number(timings.get("predicted_per_second"))
        if prompt_tokens is None:
            prompt_tokens = _int(timings.get("prompt_n"))
        if completion_tokens is None:
            completion_tokens = _int(timings.get("predicted_n"))
        if cached_tokens is None:
            cached_tokens = _int(timings.get("cache_n"))
    return (
        request_id[:64],
        model[:255],
        requested_model[:255],
        peer[:255],
        placement[:500],
        path[:255],
        _int64(priority),
        api_key[:64],
        _int64(requested_priority),
        band,
        policy,
        lane[:64],
        # Wall-clock times as the record always made them (monotonic -> wall).
        arrival_wall + (arrival - arrival),
        None if dispatched_at is None else arrival_wall + (dispatched_at - arrival),
        None if ready_at is None else arrival_wall + (ready_at - arrival),
        arrival_wall + (finished - arrival),
        outcome,
        status,
        (error or "")[:2000],
        max(0.0, finished - arrival) * 1000.0,
        _ms(load_seconds),
        _ms(finished - ready_at) if ready_at is not None else None,
        *decision,
        usage,
        prompt_tokens,
        completion_tokens,
        cached_tokens,
        timings,
        prompt_rate,
        token_rate,
    )


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


WRITE_CHUNK = 8
"""Rows built between two pauses of the writer thread (~0.1 ms of work)."""
WRITE_PAUSE = 0.0001
"""The writer thread's pause between chunks. Building rows is Python code that holds the
GIL: without pauses the event loop's thread would wait up to the interpreter's switch
interval (5 ms) for it at every loop iteration during a flush, and that shows in the
dispatch gap (bench/bench_dispatch_gap.py). A real sleep (not ``sleep(0)``, which the
writer would win back at once) hands the GIL over; the loop then waits at most one
chunk's worth. The INSERT needs no pauses: ``sqlite3`` lets go of the GIL while SQLite
stores each row, and holds it only to bind the row's values. The writer still saves
several thousand rows a second."""


def _utc_text(at: float) -> str:
    """``str(datetime.fromtimestamp(at, UTC).replace(tzinfo=None))`` (what Django's SQLite
    backend stores for a UTC datetime) at a fifth of its cost: the microseconds rounded as
    ``fromtimestamp`` rounds them (``modf``, then half to even), the rest of the text
    made once a second."""
    fraction, whole = math.modf(at)
    micro = round(fraction * 1e6)
    if micro >= 1_000_000:
        micro -= 1_000_000
        whole += 1.0
    elif micro < 0:
        micro += 1_000_000
        whole -= 1.0
    second = int(whole)
    text = _SECONDS.get(second)
    if text is None:
        if len(_SECONDS) >= 4096:
            _SECONDS.clear()
        text = _SECONDS[second] = str(datetime.fromtimestamp(second, UTC).replace(tzinfo=None))
    return f"{text}.{micro:06d}" if micro else text


_SECONDS: dict[int, str] = {}


def _json_text() -> Callable[[Any], str]:
    """``json.dumps`` without building its C encoder anew on every call (~1.5 µs of a
    record's three JSON values): the same text. No check for circular references: the
    values are parsed JSON or lists of strings."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return json.dumps
    encode = make(
        None,
        json.JSONEncoder().default,
        json.encoder.encode_basestring_ascii,
        None,
        ": ",
        ", ",
        False,
        False,
        True,
    )

    def dumps(value: Any) -> str:
        return "".join(encode(value, 0))

    return dumps


_dumps = _json_text()


class _Columns:
    """The INSERT's columns, prepared once a batch: a getter of their values in order
    from a record's :func:`_values` followed by :attr:`extras` (the defaults of the
    columns a record does not give, ``node``), as one C call (``operator.itemgetter``)
    instead of a Python loop over ~40 columns, and the adapters of the few that need one
    (times, JSON), by position."""

    __slots__ = ("extras", "values", "adapters")

    def __init__(self, columns: list[tuple[str, Callable[[Any], Any] | None, Any]]) -> None:
        given = {name: index for index, name in enumerate(FIELDS)}
        extras = [default for name, _, default in columns if name not in given]
        self.extras = tuple(extras)
        positions = []
        extra = len(FIELDS)  # the extras follow the record's values
        for name, _, _ in columns:
            if name in given:
                positions.append(given[name])
            else:
                positions.append(extra)
                extra += 1
        self.values = operator.itemgetter(*positions)
        self.adapters = [
            (index, adapter) for index, (_, adapter, _) in enumerate(columns) if adapter is not None
        ]


def _statement() -> tuple[str, _Columns]:
    """``INSERT ... ON CONFLICT (request_id) DO NOTHING`` for the current connection, and
    its columns (field name, adapter of a non-null value to a driver value or None,
    default)."""
    from activity.models import RequestRecord

    ops = connection.ops
    qn: Callable[[Any], str] = ops.quote_name
    fields = [f for f in RequestRecord._meta.concrete_fields if not f.primary_key]
    columns: list[tuple[str, Callable[[Any], Any] | None, Any]] = []
    for field in fields:
        adapter: Callable[[Any], Any] | None = None
        if field.name in TIMES:  # wall-clock seconds (see _values)
            if connection.vendor == "sqlite" and connection.timezone_name == "UTC":
                adapter = _utc_text  # Django's text for it, without a datetime
            else:

                def adapter(at: float) -> Any:
                    return ops.adapt_datetimefield_value(datetime.fromtimestamp(at, tz=UTC))
        elif field.get_internal_type() == "JSONField":
            encoder = getattr(field, "encoder", None)
            django_json = type(ops).adapt_json_value is BaseDatabaseOperations.adapt_json_value
            if encoder is None and django_json:
                adapter = _dumps  # what Django's adapter gives: json.dumps(value)
            else:

                def adapter(value: Any, encoder: Any = encoder) -> Any:
                    return ops.adapt_json_value(value, encoder)

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


def _params(values: tuple[Any, ...], columns: _Columns) -> tuple[Any, ...]:
    """A record's :func:`_values` as the INSERT's parameters, in column order."""
    row = list(columns.values(values + columns.extras))
    for index, adapter in columns.adapters:
        value = row[index]
        if value is not None:
            row[index] = adapter(value)
    return tuple(row)


def write_records(items: Sequence[Item], pause: float = WRITE_PAUSE) -> int:
    """Save a batch in one transaction; returns how many were dropped.

    Raises on a transient database error (the caller retries the whole batch). Rows
    already saved by an earlier, interrupted attempt are skipped (``request_id`` is
    unique), so a retry never duplicates. One INSERT statement prepared once (not
    ``bulk_create``, which spends ~70 µs of Python per row compiling SQL), its rows built
    in chunks with short pauses so the event loop's thread gets the GIL (see WRITE_PAUSE).
    """
    return _save(items, _item_values, pause)


def _item_values(item: Item) -> tuple[Any, ...]:
    if len(item) == 4:
        return _values(item[3])
    return _values(snapshot(item[0], item[1], item[2]))


def write_rows(rows: Sequence[tuple[Any, ...]], pause: float = WRITE_PAUSE) -> int:
    """Save journaled records (:func:`snapshot` tuples, ``activity.journal``'s replay)
    like :func:`write_records`; returns how many were dropped. Records already saved are
    skipped (``request_id``).

    Unlike the live writer it raises, rather than drops the rows, when the table or a
    column is missing: the journal is then kept for a start after ``llamaswap migrate``.
    """
    return _save(rows, _values, pause, keep_on_schema_error=True)


def _schema_error(exc: DatabaseError) -> bool:
    """The database lacks the table or a column (not migrated), rather than refusing a row."""
    text = str(exc).lower()
    return any(
        marker in text
        for marker in ("no such table", "no such column", "has no column", "does not exist")
    )


def _save(
    items: Sequence[Any],
    build: Callable[[Any], tuple[Any, ...]],
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
            cursor.executemany(sql, params)  # the GIL let go at each row (WRITE_PAUSE)
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
