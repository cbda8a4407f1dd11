"""Replay the recorded history: the activity log as a trace, and how close a replay of
the settings that ran comes to what happened.

Pure: rows come in as plain values (``activity.history`` reads them from the database).
A row that was dispatched becomes a trace request: its arrival, model and priority as
recorded, its service the measured upstream time (ready to finish), and each model's
cold-load time the median of its measured loads. Requests that never reached the GPU are
replayed too: one refused (``maxWait``, ``maxQueueDepth``, ``concurrencyLimit``) arrives
and the replay decides again (served, its service is its model's median); one whose
client left while it waited leaves at the same time. What happened becomes a
:class:`~scheduler.core.simulate.SimResult` too (with its refusals), so it sits in the
same table as the replays.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from scheduler.core.admission import Refusal
from scheduler.core.lanes import DEFAULT_LANE
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
    outcome: str = "completed"
    """The dispatcher's ``Outcome`` value."""
    lane: str = DEFAULT_LANE


REPLAYED_REFUSALS: dict[str, Refusal] = {
    "expired": Refusal.EXPIRED,
    "queue_full": Refusal.QUEUE_FULL,
    "rejected": Refusal.OVERLOADED,
}
"""Outcomes of requests refused without a turn, which a replay decides again."""
GONE = "cancelled_waiting"
"""The outcome of a request whose client left while it waited."""


@dataclass(frozen=True)
class History:
    trace: list[TraceRequest]
    loads: dict[str, float]
    """Median measured cold-load seconds per model."""
    recorded: SimResult
    """What happened, as a column of the table."""
    skipped: int
    """Rows not replayed: never dispatched, and neither refused nor left while waiting
    (a failed start, a shutdown)."""


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
    dispatched = [r for r in rows if r.start is not None]
    waited = [
        r for r in rows if r.start is None and (r.outcome in REPLAYED_REFUSALS or r.outcome == GONE)
    ]
    replayed = sorted([*dispatched, *waited], key=lambda r: (r.arrival, r.request_id))
    skipped = len(rows) - len(replayed)
    loads_seen: dict[str, list[float]] = {}
    services: dict[str, list[float]] = {}
    for r in dispatched:
        if r.load is not None and r.load > 0:
            loads_seen.setdefault(r.model, []).append(r.load)
        services.setdefault(r.model, []).append(_service(r))
    loads = {model: statistics.median(values) for model, values in loads_seen.items()}
    typical = {model: statistics.median(values) for model, values in services.items()}
    trace = [
        TraceRequest(
            r.request_id,
            r.arrival,
            r.model,
            r.priority,
            _service(r) if r.start is not None else typical.get(r.model, 0.0),
            gone=r.finish if r.outcome == GONE else None,
        )
        for r in replayed
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
            r.lane,
        )
        for r in jobs
    ]
    busy = sum(d.finish - d.start for d in dispatches)
    recorded = summarize(trace, dispatches, settings, label=RECORDED_LABEL, busy=busy)
    refusals = tuple(
        (r.request_id, REPLAYED_REFUSALS[r.outcome])
        for r in sorted(waited, key=lambda r: (r.finish, r.arrival))
        if r.outcome in REPLAYED_REFUSALS
    )
    recorded = dataclasses.replace(
        recorded, refusals=refusals, lanes=len({d.lane for d in dispatches}) or 1
    )
    for model in {r.model for r in replayed} - loads.keys():
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
    """Share of picks that were the same request in the same position of its lane's
    order (lanes dispatch side by side: their interleaving is not an order)."""

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
        for lane, picks in lane_orders(recorded).items()
        for a, b in zip(picks, lane_orders(replayed).get(lane, []), strict=False)
        if a == b
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


def lane_orders(result: SimResult) -> dict[str, list[str]]:
    """Each lane's dispatch order (request ids)."""
    orders: dict[str, list[str]] = {}
    for d in result.dispatches:
        orders.setdefault(d.lane, []).append(d.request_id)
    return orders
