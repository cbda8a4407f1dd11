"""The activity log's writer: a dispatcher observer that saves one row per request.

On the dispatch path :meth:`Recorder.on_finish` writes the record as one line to the
journal (:mod:`activity.journal`: it survives a killed server; a few microseconds) and
appends the finished ticket to a bounded deque (tickets are done changing by then: the
decision was set at dispatch, usage and timings before the finish). A background task
takes batches off the deque every ``interval`` seconds, or sooner once ``batch_size`` are
waiting, and saves each batch in one transaction in Django's sync thread
(:func:`activity.rows.write_records`); the rows are made in that thread too (of the
snapshot the journal's line was made of, not a second one), so the event loop does
nothing per record but the journal's line and the append. A committed batch marks the
journal done up to it. When the server stops with records
unsaved (the database away), the journal keeps them for the next start instead.

When the database is unavailable the batch stays at the head of the deque and is retried
with exponential backoff, while proxying goes on. The deque is bounded: beyond
``capacity`` new records are dropped, counted in
``llamaswap_activity_records_dropped_total`` and logged. A batch the database refuses for
good (no such table: not migrated; a bad value) is retried row by row and the rows that
still fail are dropped the same way, so one bad record never blocks the others.

Retention (:func:`activity.rows.prune`) runs in the same task every ``prune_every`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from asgiref.sync import sync_to_async
from django.db import connection

from activity import metrics
from activity.journal import Journal
from activity.rows import Item, prune, snapshot, write_records
from scheduler.core.policy import SchedulerSettings
from scheduler.dispatcher import Ticket
from scheduler.process import ModelState

log = logging.getLogger("llamaswap.recorder")

DEFAULT_CAPACITY = 10_000
DEFAULT_BATCH = 500
DEFAULT_INTERVAL = 0.5
MAX_BACKOFF = 10.0
DELAYED_AFTER = 2.0
"""Seconds a record may wait in the buffer before it counts as delayed (four batch
intervals: a write that hangs, not one that fails)."""
REPLAY_RETRY = 30.0
"""Seconds between two replays of dead servers' journals that the database refused."""


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
        writer: Callable[[Sequence[Item]], int] | None = None,
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
        self._buffer: deque[Item] = deque()
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
        if ticket.extra.get("recorded_elsewhere"):  # fleet: another ticket holds its record
            return
        buffer = self._buffer
        if len(buffer) >= self.capacity:
            self._drop(1, "the buffer is full (is the database unavailable?)")
            return
        settings = self._settings
        finished = ticket.finished_at if ticket.finished_at is not None else self._clock()
        item: Item = (ticket, settings, finished)
        seq = 0
        if self._journal is not None:
            # The record on disk (the page cache) before anything else: from here on a
            # killed server loses nothing (activity/journal.py). One line, one write.
            try:
                snap = snapshot(ticket, settings, finished)
                seq = self._journal.append(snap)
            except Exception:  # a record that cannot be built: the writer drops it
                log.exception("activity log: cannot journal a record", extra={"action": "record_refused"})
            else:
                item = (ticket, settings, finished, snap)  # the writer's row is made of it
        buffer.append(item)
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

    @property
    def delayed(self) -> int:
        """Records held because the database is away: its last write failed, or the
        oldest record has waited :data:`DELAYED_AFTER` seconds (a write that hangs). 0
        while it keeps pace. The fleet shows it (``fleet.node``)."""
        buffer = self._buffer
        if buffer and (self._failures or self._clock() - buffer[0][2] >= DELAYED_AFTER):
            return len(buffer)
        return 0

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
    return min(MAX_BACKOFF, 0.25 * 2.0 ** min(failures, 10))
