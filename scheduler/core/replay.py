"""Replay the recorded history: the activity log as a trace, and how close a replay of
the settings that ran comes to what happened.

Pure: rows come in as plain values (``activity.history`` reads them from the database).
A row that was dispatched becomes a trace request: its arrival, model and priority as
recorded, its service the measured upstream time (ready to finish), and each model's
cold-load time the median of its measured loads. Requests that never reached the GPU
(cancelled or expired while waiting, refused) are left out: in a replay they would be
served. What happened becomes a :class:`~scheduler.core.simulate.SimResult` too, so it
sits in the same table as the replays.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.core.policy import SchedulerSettings, Term
from scheduler.core.priority import BANDS, Band, band_of
from scheduler.core.simulate import (
    DEFAULT_LOAD_SECONDS,
    Dispatch,
    SimResult,
    TraceRequest,
    percentile,
    summarize,
)

RECORDED_LABEL = "recorded"


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One activity-log row, times in seconds on any common scale."""

    request_id: str
    model: str
    priority: int
    arrival: float
    start: float | None
    """The pick (None: never dispatched)."""
    finish: float
    ready: float | None = None
    """When the model was ready and the request went upstream."""
    load: float | None = None
    """Seconds of the model load it waited for (None: no swap)."""
    swapped: bool | None = None
    reordered_by: frozenset[Term] = frozenset()


@dataclass(frozen=True)
class History:
    trace: list[TraceRequest]
    loads: dict[str, float]
    """Median measured cold-load seconds per model."""
    recorded: SimResult
    """What happened, as a column of the table."""
    skipped: int
    """Rows never dispatched (not replayed)."""


def _service(row: HistoryRow) -> float:
    assert row.start is not None
    if row.ready is not None:
        return max(0.0, row.finish - row.ready)
    return max(0.0, row.finish - row.start - (row.load or 0.0))


def from_history(
    rows: Iterable[HistoryRow],
    settings: SchedulerSettings,
    default_load: float = DEFAULT_LOAD_SECONDS,
) -> History:
    """The trace and the recorded run of some rows (any order)."""
    rows = list(rows)
    dispatched = sorted(
        (r for r in rows if r.start is not None), key=lambda r: (r.arrival, r.request_id)
    )
    skipped = len(rows) - len(dispatched)
    loads_seen: dict[str, list[float]] = {}
    for r in dispatched:
        if r.load is not None and r.load > 0:
            loads_seen.setdefault(r.model, []).append(r.load)
    loads = {model: statistics.median(values) for model, values in loads_seen.items()}
    trace = [
        TraceRequest(r.request_id, r.arrival, r.model, r.priority, _service(r)) for r in dispatched
    ]
    jobs = sorted(dispatched, key=lambda r: (r.start, r.arrival))
    dispatches = [
        Dispatch(
            r.request_id,
            r.model,
            band_of(r.priority),
            r.arrival,
            r.start,  # type: ignore[arg-type]  # dispatched rows only
            r.finish,
            bool(r.swapped if r.swapped is not None else r.load is not None),
            r.reordered_by,
        )
        for r in jobs
    ]
    busy = sum(d.finish - d.start for d in dispatches)
    recorded = summarize(trace, dispatches, settings, label=RECORDED_LABEL, busy=busy)
    for model in {r.model for r in dispatched} - loads.keys():
        loads[model] = default_load
    return History(trace=trace, loads=loads, recorded=recorded, skipped=skipped)


@dataclass(frozen=True)
class ReplayError:
    """How far a replay's waits are from the recorded ones (seconds)."""

    requests: int
    abs_p50: float
    abs_p90: float
    abs_max: float
    band_p95: Mapping[Band, tuple[float, float]]
    """Per band: (recorded p95 wait, replayed p95 wait)."""
    same_order: float
    """Share of picks that were the same request in the same position."""

    def as_dict(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "abs_error_p50_seconds": self.abs_p50,
            "abs_error_p90_seconds": self.abs_p90,
            "abs_error_max_seconds": self.abs_max,
            "same_order": self.same_order,
            "band_p95_seconds": {
                band.value: {"recorded": rec, "replayed": rep}
                for band, (rec, rep) in self.band_p95.items()
            },
        }


def replay_error(recorded: SimResult, replayed: SimResult) -> ReplayError:
    mine = {d.request_id: d.wait for d in replayed.dispatches}
    errors = sorted(
        abs(mine[d.request_id] - d.wait) for d in recorded.dispatches if d.request_id in mine
    )
    same = sum(
        1
        for a, b in zip(recorded.dispatches, replayed.dispatches, strict=False)
        if a.request_id == b.request_id
    )
    return ReplayError(
        requests=len(errors),
        abs_p50=percentile(errors, 50),
        abs_p90=percentile(errors, 90),
        abs_max=errors[-1] if errors else 0.0,
        band_p95={
            band: (recorded.bands[band].wait_p95, replayed.bands[band].wait_p95) for band in BANDS
        },
        same_order=same / len(recorded.dispatches) if recorded.dispatches else 1.0,
    )
