"""Overload without collapse (issue 13), measured in the simulator: the targets on three
generated traces, the estimated wait's error, and the what-if page's replay of 100,000
recorded requests.

Everything but the last part is deterministic (virtual clock, fixed seeds): the figures
are the same on any machine. The what-if timing is wall-clock on this one.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench import machine, markdown_table
from scheduler.core.policy import SchedulerSettings
from scheduler.core.priority import BANDS
from scheduler.core.simulate import (
    GENERATED_LOAD_SECONDS,
    RECOMMENDED,
    TRACE_SHAPES,
    format_duration,
    generate_trace,
    parse_overrides,
    simulate,
)
from scheduler.core.targets import check_targets, format_targets

REQUESTS = 1000
SEED = 0
WHATIF_RECORDS = 100_000
WHATIF_CANDIDATES = (RECOMMENDED, "agingDivisor=600", "use=fifo")


def _targets() -> str:
    candidate = parse_overrides([RECOMMENDED])
    checks = [
        check_targets(
            shape, generate_trace(REQUESTS, SEED, shape), candidate, GENERATED_LOAD_SECONDS
        )
        for shape in TRACE_SHAPES
    ]
    return format_targets(checks)


def _estimates() -> str:
    rows = []
    for shape in TRACE_SHAPES:
        trace = generate_trace(REQUESTS, SEED, shape)
        for label, settings in (
            ("defaults", SchedulerSettings()),
            ("recommended", parse_overrides([RECOMMENDED])),
        ):
            result = simulate(trace, settings, GENERATED_LOAD_SECONDS, estimate=True)
            assert result.estimate_errors is not None
            for band in BANDS:
                e = result.estimate_errors[band]
                rows.append(
                    [
                        f"{shape}, {label}",
                        band.value,
                        f"{e.samples:,}",
                        format_duration(e.abs_p50),
                        format_duration(e.abs_p90),
                        f"{e.within_factor_2:.0%}",
                    ]
                )
    return markdown_table(
        ["trace, settings", "band", "estimates", "abs error p50", "abs error p90", "within 2x"],
        rows,
    )


def _setup_django(db_path: Path) -> None:
    import django
    from django.apps import apps

    if not apps.ready:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")
        os.environ["DATABASE_URL"] = f"sqlite:///{db_path}"
        django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _whatif() -> tuple[str, float, float, int]:
    """Record 100,000 requests (the steady trace, simulated under the defaults), then
    time reading them and the what-if computation with three candidates."""
    from activity.history import history_rows
    from activity.models import RequestRecord
    from dashboard.whatif import compute

    trace = generate_trace(WHATIF_RECORDS, SEED, "steady")
    result = simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS)
    service = {r.request_id: r for r in trace}
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    rows = []
    for d in result.dispatches:
        r = service[d.request_id]
        load = GENERATED_LOAD_SECONDS[d.model] if d.swap else None
        start = t0 + timedelta(seconds=d.start)
        ready = start + timedelta(seconds=load or 0.0)
        rows.append(
            RequestRecord(
                request_id=d.request_id,
                model=d.model,
                path="/v1/chat/completions",
                priority=r.priority,
                band=d.band.value,
                policy="serial",
                arrived_at=t0 + timedelta(seconds=d.arrival),
                dispatched_at=start,
                ready_at=ready,
                finished_at=ready + timedelta(seconds=r.service),
                outcome="completed",
                duration_ms=(d.finish - d.arrival) * 1000,
                queue_wait_ms=d.wait * 1000,
                load_ms=None if load is None else load * 1000,
                run_ms=r.service * 1000,
                needs_swap=d.swap,
                reordered_by=sorted(t.value for t in d.reordered_by),
            )
        )
    RequestRecord.objects.bulk_create(rows, batch_size=5000)
    started = time.perf_counter()
    history_rows()
    read = time.perf_counter() - started
    candidates = [(text, parse_overrides([text])) for text in WHATIF_CANDIDATES]
    started = time.perf_counter()
    page = compute(None, None, candidates, SchedulerSettings())
    total = time.perf_counter() - started
    error = page.error
    note = (
        f"replay error of the settings in effect: p50 {format_duration(error.abs_p50)}, "
        f"max {format_duration(error.abs_max)}, {error.same_order:.0%} of picks in the same order"
    )
    return note, read, total, page.requests


def main() -> str:
    print("== overload: targets, estimated wait, what-if at 100,000 records ==")
    started = time.perf_counter()
    targets = _targets()
    estimates = _estimates()
    with tempfile.TemporaryDirectory() as tmp:
        _setup_django(Path(tmp) / "bench.sqlite3")
        note, read, total, replayed = _whatif()
    took = time.perf_counter() - started
    return "\n".join(
        [
            f"`.venv/bin/python -m bench overload` (or `llamaswap simulate --targets` for the "
            f"first table). Machine: {machine()}. One run, {took:.0f} s.",
            "",
            f"Targets, candidate `{RECOMMENDED}`; {REQUESTS} requests per trace, seed {SEED}, "
            "cold loads qwen3 15 s, llama3 30 s, flux 45 s. Ratios are candidate / fifo on the "
            "same trace. The bound row: batch run before everything else (arrival order), the "
            "least any order of the same jobs gives the batch band's last job. Forced swaps: "
            "picks with nothing waiting for the loaded model (they depend on the order, so "
            "they indicate rather than bound).",
            "",
            targets,
            "",
            "Estimated wait (time to the pick) of every waiting request at every pick, against "
            "the wait that followed; means of the jobs finished so far, the load of the bands "
            "above measured over the last hour:",
            "",
            estimates,
            "",
            f"What-if page at {WHATIF_RECORDS:,} recorded requests (the steady trace, recorded "
            f"under the defaults, SQLite): reading them {read:.1f} s; reading, replaying the "
            f"settings in effect and {len(WHATIF_CANDIDATES)} candidates "
            f"({', '.join(f'`{c}`' for c in WHATIF_CANDIDATES)}), and the advisor's check: "
            f"{total:.1f} s in one worker thread ({replayed:,} requests); {note}.",
        ]
    )


if __name__ == "__main__":
    print(main())
