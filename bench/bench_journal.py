"""The activity log's CPU per finished request: ``python -m bench.bench_journal``.

:meth:`Recorder.on_finish` runs on the event loop's thread for every finished request.
With the journal it also takes the record's snapshot (plain values), marshals it into
one line and writes that with one ``os.write`` (activity/journal.py). Timed here per call, on a ticket
shaped like a real chat completion's (a decision, llama-server's ``usage`` and
``timings``), against the recorder without a journal; and, for the power-cut question,
the same write followed by an ``fsync`` (what a per-request fsync would cost) in a
journal under the state directory's file system (``$LLAMASWAP_STATE_DIR`` or ``var/``).

Then the CPU (thread time, not wall time: the machine is shared) of each part a request
costs: on the loop's thread the snapshot, the journal's line, its ``os.write`` and the
metrics observer; in the writer's thread a row saved by ``write_records`` in 500-row
batches into a throwaway SQLite file (WAL, migrated; ``DATABASE_URL`` chooses another),
without and with the pauses that hand the GIL to the loop.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import fmt_us, machine, markdown_table, quantile_us

CALLS = 20_000
FSYNC_CALLS = 300


def _ticket() -> Any:
    from scheduler.core.policy import Decision, Policy, Term
    from scheduler.core.priority import Band
    from scheduler.dispatcher import Outcome, Ticket

    model = SimpleNamespace(id="m")  # all a record reads of the model
    loop = asyncio.new_event_loop()
    ticket = Ticket(
        request_id="0123456789abcdef0123456789abcdef",
        model=model,  # type: ignore[arg-type]
        priority=0,
        path="/v1/chat/completions",
        arrival=1000.0,
        arrival_wall=time.time(),
        granted=loop.create_future(),
    )
    loop.close()
    ticket.decision = Decision(
        request_id=ticket.request_id,
        model="m",
        priority=0,
        band=Band.NORMAL,
        policy=Policy.SERIAL,
        score=12.5,
        affinity=10.0,
        aging=2.5,
        queue_wait=0.2,
        reordered_by=frozenset({Term.AGING}),
        runner_up_id="fedcba9876543210fedcba9876543210",
        runner_up_score=11.0,
        needs_swap=False,
        waiting_after=3,
    )
    ticket.dispatched_at, ticket.ready_at, ticket.finished_at = 1000.2, 1000.21, 1002.0
    ticket.outcome, ticket.status = Outcome.COMPLETED, 200
    ticket.extra["usage"] = {
        "prompt_tokens": 512,
        "completion_tokens": 256,
        "total_tokens": 768,
        "prompt_tokens_details": {"cached_tokens": 128},
    }
    ticket.extra["timings"] = {
        "prompt_n": 512,
        "prompt_ms": 120.5,
        "prompt_per_token_ms": 0.235,
        "prompt_per_second": 4249.0,
        "predicted_n": 256,
        "predicted_ms": 1700.2,
        "predicted_per_token_ms": 6.64,
        "predicted_per_second": 150.6,
        "cache_n": 128,
    }
    return ticket


def _write_and_fsync(fd: int, data: bytes) -> int:
    written = os.write(fd, data)
    os.fsync(fd)
    return written


def _time(recorder, ticket, calls: int) -> list[int]:  # type: ignore[no-untyped-def]
    samples = []
    on_finish = recorder.on_finish
    clock = time.perf_counter_ns
    for _ in range(calls):
        start = clock()
        on_finish(ticket)
        samples.append(clock() - start)
    recorder._buffer.clear()
    recorder._seqs.clear()
    return samples


PART_CALLS = 5_000
"""Calls per block when timing a part on the loop's thread."""
BLOCKS = 9
BATCH = 500
BATCHES = 8
"""Writer batches per mode (pauses or not), the modes alternated."""


def _cpu_us(call: Any, calls: int = PART_CALLS) -> float:
    """Median over :data:`BLOCKS` blocks of this thread's CPU µs per ``call()``."""
    blocks = []
    for _ in range(BLOCKS):
        start = time.thread_time_ns()
        for _ in range(calls):
            call()
        blocks.append((time.thread_time_ns() - start) / calls / 1000)
    return sorted(blocks)[BLOCKS // 2]


def _loop_parts(ticket: Any, directory: Path) -> list[tuple[str, float]]:
    """CPU µs per request of each part the loop's thread runs."""
    from activity import metrics
    from activity.journal import Journal, encode
    from activity.recorder import Recorder
    from activity.rows import snapshot
    from scheduler.core.policy import SchedulerSettings

    settings = SchedulerSettings()
    snap = snapshot(ticket, settings, 1002.0)
    line = encode(1, snap)
    fd = os.open(directory / "writes", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    journal = Journal(directory / "parts", "1:3", max_bytes=1 << 34)
    journal.open()
    recorder = Recorder(capacity=1 << 30, journal=journal)
    observer = metrics.MetricsObserver()

    def finish() -> None:
        recorder.on_finish(ticket)

    try:
        parts = [
            ("snapshot (`rows.snapshot`)", _cpu_us(lambda: snapshot(ticket, settings, 1002.0))),
            ("journal line (`journal.encode`)", _cpu_us(lambda: encode(1, snap))),
            ("its `os.write`", _cpu_us(lambda: os.write(fd, line))),
            ("`Recorder.on_finish` with the journal (all three)", _cpu_us(finish)),
            ("metrics observer: `on_dispatch`", _cpu_us(lambda: observer.on_dispatch(ticket))),
            ("metrics observer: `on_finish`", _cpu_us(lambda: observer.on_finish(ticket))),
        ]
    finally:
        os.close(fd)
        journal.close()
    return parts


def _writer_parts(ticket: Any) -> list[tuple[str, float]]:
    """The writer thread's CPU µs per row saved (``write_records``, 500-row batches),
    without and with its pauses, the two alternated."""
    import copy

    from django.core.management import call_command

    from activity.rows import write_records
    from scheduler.core.policy import SchedulerSettings

    call_command("migrate", verbosity=0)
    settings = SchedulerSettings()
    made = 0

    def batch() -> list[Any]:
        nonlocal made
        items = []
        for _ in range(BATCH):
            one = copy.copy(ticket)
            one.request_id = f"bench-{made}"
            made += 1
            items.append((one, settings, 1002.0))
        return items

    write_records(batch(), pause=0)  # warm up: the connection, the statement
    samples: dict[str, list[float]] = {"no pauses": [], "with its pauses (as served)": []}
    for round_ in range(BATCHES):
        for mode in ("no pauses", "with its pauses (as served)")[:: 1 if round_ % 2 else -1]:
            items = batch()
            start = time.thread_time_ns()
            if mode == "no pauses":
                write_records(items, pause=0)
            else:
                write_records(items)
            samples[mode].append((time.thread_time_ns() - start) / BATCH / 1000)
    return [
        (f"writer: a row saved, {mode}", sorted(values)[len(values) // 2])
        for mode, values in samples.items()
    ]


def main() -> str:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")
    database = tempfile.mkdtemp(prefix="bench-journal-")
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{database}/records.db")
    import django

    django.setup()
    from activity.journal import Journal
    from activity.recorder import Recorder
    from scheduler.sweep import state_dir

    print("== journal: Recorder.on_finish per finished request ==")
    ticket = _ticket()
    root = state_dir()
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            bare = Recorder(capacity=CALLS + 1)
            journal = Journal(Path(tmp) / "a", "1:1", max_bytes=1 << 30)
            journal.open()
            journaled = Recorder(capacity=CALLS + 1, journal=journal)
            for recorder in (bare, journaled):
                _time(recorder, ticket, 1000)  # warm up
            without = _time(bare, ticket, CALLS)
            with_journal = _time(journaled, ticket, CALLS)
            line = journal.size / max(1, journal.seq)
            journal.close()
            synced = Journal(
                Path(tmp) / "b",
                "1:2",
                max_bytes=1 << 30,
                write=_write_and_fsync,
            )
            synced.open()
            per_fsync = Recorder(capacity=FSYNC_CALLS + 1, journal=synced)
            fsynced = _time(per_fsync, ticket, FSYNC_CALLS)
            synced.close()
            print("== the activity log's parts: CPU µs per request ==")
            parts = _loop_parts(ticket, Path(tmp))
    finally:
        if gc_was_enabled:
            gc.enable()
    parts += _writer_parts(ticket)
    for name, samples in (
        ("no journal (before)", without),
        ("journal: one os.write per record", with_journal),
        ("journal + fsync per record (not done)", fsynced),
    ):
        rows.append(
            [
                name,
                f"{len(samples):,}",
                fmt_us(quantile_us(samples, 0.5)),
                fmt_us(quantile_us(samples, 0.99)),
            ]
        )
        print(f"  {name}: {fmt_us(quantile_us(samples, 0.5))} µs median")
    for name, cpu in parts:
        print(f"  {name}: {cpu:.1f} µs")
    added = quantile_us(with_journal, 0.5) - quantile_us(without, 0.5)
    table = markdown_table(["on_finish", "calls", "p50 µs", "p99 µs"], rows)
    parts_table = markdown_table(
        ["part (thread CPU, median of blocks)", "µs per request"],
        [[name, f"{cpu:.1f}"] for name, cpu in parts],
    )
    return (
        f"{machine()}; state directory on {root}.\n\n{table}\n\n"
        f"The journal adds {added:.1f} µs a finished request (p50; a line of {line:.0f} "
        "bytes); an fsync per request would cost "
        f"{quantile_us(fsynced, 0.5):,.0f} µs, so the journal is synced once a second "
        f"in a worker thread instead.\n\n{parts_table}\n\n"
        f"The writer's rows: {BATCHES} batches of {BATCH} per mode into a throwaway SQLite "
        "file (WAL), the modes alternated."
    )


if __name__ == "__main__":
    print(main())
