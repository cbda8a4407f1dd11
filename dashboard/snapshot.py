"""The dashboard's picture of the scheduler at one moment, as a JSON-ready dict.

Pure: everything comes in as arguments (the dispatcher's state read by the caller, the
time), nothing is read from a clock, the database or the network. The same dict is what
the server renders for the first paint and what the websocket sends.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fleet.node import section as fleet_section
from scheduler.core.lanes import DEFAULT_LANE
from scheduler.core.policy import Decision, Ranked, SchedulerSettings, Term
from scheduler.core.priority import BANDS, Band, band_of
from scheduler.core.queue import BandStats
from scheduler.core.settings import shown

WAITING_CAP = 50
"""Waiting requests sent on the wire; the rest are only counted."""

TERMS: tuple[Term, ...] = tuple(Term)


class TicketLike(Protocol):
    """What the snapshot reads of a :class:`scheduler.dispatcher.Ticket`."""

    request_id: str
    priority: int
    arrival: float
    arrival_wall: float
    dispatched_at: float | None
    decision: Decision | None

    @property
    def model(self) -> Any: ...

    @property
    def state(self) -> Any: ...


@dataclass(frozen=True, slots=True)
class Sample:
    """One point of the charts: depth and oldest wait per band, at a wall time."""

    at: float
    depth: tuple[int, int, int]
    """interactive, normal, batch."""
    oldest_wait: tuple[float, float, float]

    def row(self) -> list[float]:
        return [round(self.at, 3), *self.depth, *(round(w, 1) for w in self.oldest_wait)]


def sample(at: float, bands: Mapping[Band, BandStats]) -> Sample:
    return Sample(
        at=at,
        depth=tuple(bands[b].depth for b in BANDS),  # type: ignore[arg-type]
        oldest_wait=tuple(bands[b].oldest_wait for b in BANDS),  # type: ignore[arg-type]
    )


def _r(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def decision_record(ticket: TicketLike) -> dict[str, Any]:
    """A dispatched ticket as a row of the decision stream (it needs ``ticket.decision``)."""
    d = ticket.decision
    assert d is not None
    dispatched_at = ticket.dispatched_at if ticket.dispatched_at is not None else ticket.arrival
    return {
        "at": round(ticket.arrival_wall + (dispatched_at - ticket.arrival), 3),
        "request_id": d.request_id,
        "model": d.model,
        "band": d.band.value,
        "priority": d.priority,
        "policy": d.policy.value,
        "score": _r(d.score),
        "affinity": _r(d.affinity),
        "aging": _r(d.aging),
        "wait": _r(d.queue_wait),
        "swap": d.needs_swap,
        "reordered_by": sorted(t.value for t in d.reordered_by),
        "runner_up_id": d.runner_up_id,
        "runner_up_score": _r(d.runner_up_score),
        "waiting_after": d.waiting_after,
    }


def settings_block(settings: SchedulerSettings, source: str, since: float | None) -> dict[str, Any]:
    values = settings.as_dict()  # every setting of the table, by name
    return {
        **values,
        "shown": shown(values),
        "source": source,
        "since": _r(since),
    }


def build_snapshot(
    *,
    now: float,
    wall: float,
    bands: Mapping[Band, BandStats],
    waiting: Sequence[Ranked],
    depth: int,
    running: Iterable[TicketLike],
    model: str | None,
    model_state: str,
    decisions: Sequence[Mapping[str, Any]],
    dispatched: Mapping[Band, int],
    reorders: Mapping[Band, Mapping[Term, int]],
    settings: SchedulerSettings,
    settings_source: str,
    settings_since: float | None,
    samples: Sequence[Sample] = (),
    waiting_cap: int = WAITING_CAP,
    kind: str = "snapshot",
    lanes: Sequence[Mapping[str, Any]] = (),
    lane_of: Callable[[str], str] | None = None,
    config_status: Mapping[str, Any] | None = None,
    estimates: Mapping[str, float] | None = None,
    advice: Mapping[str, Any] | None = None,
    started_at: float | None = None,
    access: Mapping[str, Any] | None = None,
    fleet: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The dashboard's state.

    ``now`` is on the dispatcher's monotonic clock (ticket times are), ``wall`` is Unix
    seconds for display. ``waiting`` is the head of the queue in dispatch order (at most
    ``waiting_cap`` are kept), ``depth`` the whole queue's length. ``decisions`` are
    oldest first; the snapshot lists them newest first. ``samples`` are chart points,
    oldest first (all of them on connect, the newest one in an update). ``lanes`` are
    the dispatcher's lanes (one per GPU; :func:`lane_rows`), ``lane_of`` a model's lane.
    ``started_at`` (Unix seconds) is when the counters (dispatched, reordered) started:
    they count since the server started, the history keeps every request. ``access`` is
    :func:`access_block`: whether the API is open or keyed. ``fleet``: the fleet's
    section (fleet mode), else the running fleet's, read from memory (``fleet.node.section``).
    """
    lane_name = lane_of or (lambda _model: DEFAULT_LANE)
    band_rows = []
    for band in BANDS:
        stats = bands.get(band) or BandStats(depth=0, oldest_wait=0.0)
        by_term = reorders.get(band, {})
        band_rows.append(
            {
                "band": band.value,
                "depth": stats.depth,
                "oldest_wait": round(stats.oldest_wait, 1),
                "dispatched": dispatched.get(band, 0),
                "reorders": {term.value: by_term.get(term, 0) for term in TERMS},
            }
        )
    waiting_rows = [
        {
            "rank": rank,
            "request_id": r.request.request_id,
            "model": r.request.model,
            "lane": lane_name(r.request.model),
            "eta": round(estimates[r.request.request_id], 1)
            if estimates and r.request.request_id in estimates
            else None,
            "band": r.request.band.value,
            "priority": r.request.priority,
            "score": round(r.score, 3),
            "affinity": round(r.affinity, 3),
            "aging": round(r.aging, 3),
            "wait": round(r.wait, 1),
        }
        for rank, r in enumerate(waiting[:waiting_cap], start=1)
    ]
    running_rows = []
    for ticket in running:
        started = ticket.dispatched_at if ticket.dispatched_at is not None else now
        d = ticket.decision
        running_rows.append(
            {
                "request_id": ticket.request_id,
                "model": ticket.model.id,
                "lane": lane_name(ticket.model.id),
                "band": band_of(ticket.priority).value,
                "priority": ticket.priority,
                "state": ticket.state.value,
                "elapsed": round(max(0.0, now - started), 1),
                "score": _r(d.score) if d is not None else None,
            }
        )
    running_rows.sort(key=lambda row: -row["elapsed"])
    return {
        "type": kind,
        "at": round(wall, 3),
        "bands": band_rows,
        "depth": depth,
        "model": {"id": model, "state": model_state},
        "lanes": [dict(lane) for lane in lanes],
        "config": dict(config_status or {}),
        "advice": dict(advice) if advice else None,
        "running": running_rows,
        "waiting": waiting_rows,
        "waiting_shown": len(waiting_rows),
        "decisions": [dict(d) for d in reversed(decisions)],
        "settings": settings_block(settings, settings_source, settings_since),
        "samples": [s.row() for s in samples],
        "started_at": _r(started_at),
        "access": dict(access) if access else None,
        # Fleet mode: every node, up or down, its models and queue (fleet/; None on one box).
        "fleet": dict(fleet) if fleet is not None else fleet_section(),
    }


def lane_rows(lanes: Iterable[Any]) -> list[dict[str, Any]]:
    """The dashboard's card per lane, from :meth:`Dispatcher.lanes`."""
    return [
        {
            "lane": lane.name,
            "loaded": [{"model": m, "state": s.value} for m, s in lane.loaded.items()],
            "running": len(lane.running),
            "waiting": lane.waiting,
            "models": list(lane.models),
        }
        for lane in lanes
    ]


def empty_snapshot(wall: float, settings: SchedulerSettings | None = None) -> dict[str, Any]:
    """What the dashboard shows when no scheduler runs in this process."""
    snap = build_snapshot(
        now=0.0,
        wall=wall,
        bands={},
        waiting=(),
        depth=0,
        running=(),
        model=None,
        model_state="stopped",
        decisions=(),
        dispatched={},
        reorders={},
        settings=settings or SchedulerSettings(),
        settings_source="not running",
        settings_since=None,
    )
    snap["offline"] = True
    return snap


def access_block(
    *, keyed: bool, keys: int | None, since: float | None = None, by: str = ""
) -> dict[str, Any]:
    """Who may call the API, for the dashboard: ``keyed`` (every API path needs a key or a
    staff login) or open; the keys in force (None: not known here); since when and by
    whom access control was turned on or off (the admin's access control row)."""
    if keyed:
        count = "" if keys is None else f" ({keys} key{'' if keys == 1 else 's'} in force)"
        text = f"API keyed: every API call needs a key{count}"
    else:
        text = "API open: no key needed"
    return {"keyed": keyed, "keys": keys, "since": _r(since), "by": by, "text": text}
