"""Why did my request wait? The jobs that went before it, and what made each one win.

Pure: works on plain values (activity-log rows or anything with the same attributes);
no database, no clock.

For each job picked while the request waited, the request's own score at that moment
is rebuilt from the settings recorded with the job's decision (priority + swap affinity
+ aging), and the term where the job was furthest ahead is named as the one that decided
it. A job already running when the request arrived went first because dispatch is
non-preemptive.

The opt-in bounds (docs/scheduling.md): a job whose pick was made by ``bandShare`` (its
band was behind its guaranteed share of GPU time; ``band_share`` in its
``reordered_by``) is named "band share", whatever the scores. With ``agingCap``, the
request's aging is capped as the job's was (the cap is the job's own row's
``aging_cap`` when recorded, else read off a job whose aging stopped short of its wait);
a job that won only because the request's aging was capped is named "aging cap", with
the points the cap withheld as the margin.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from scheduler.core.policy import aging_points, serial_score


class Job(Protocol):
    request_id: str
    model: str
    priority: int
    arrived_at: datetime
    dispatched_at: datetime | None
    finished_at: datetime
    score: float | None
    affinity: float | None
    aging: float | None
    needs_swap: bool | None
    aging_divisor: float | None
    swap_affinity_bonus: int | None
    reordered_by: Any


@dataclass(frozen=True)
class Ahead:
    job: Any
    """The row itself, for the template."""
    already_running: bool
    your_score: float | None
    """The waiting request's score when this job was picked (estimated)."""
    deciding_term: str
    """priority, swap affinity, aging, arrival order, or already running."""
    margin: float | None
    """How far ahead the job was on that term."""
    ran_seconds: float = 0.0
    """How long it held the GPU (its pick to its finish)."""
    note: str = ""
    """One sentence on what the deciding term means, for the opt-in bounds."""


NOTES = {
    "band share": (
        "its band was behind its guaranteed share of GPU time (bandShare), so it went "
        "next whatever the scores"
    ),
    "aging cap": ("this request had waited long enough to win, but aging stops at agingCap points"),
}


EPS = 1e-6
LEAD_SLACK = 0.01
"""Scores rebuilt from stored wall times are off by clock jitter (0.01 = 0.6 s of aging at 60)."""


def _seconds(a: datetime, b: datetime) -> float:
    return (a - b).total_seconds()


def explain(mine: Job, ahead: Sequence[Job]) -> list[Ahead]:
    """``ahead``: the jobs dispatched before ``mine`` that finished after it arrived,
    in dispatch order."""
    out = []
    loaded: str | None = None
    for job in ahead:
        assert job.dispatched_at is not None
        before_pick = loaded
        loaded = job.model
        ran = max(0.0, _seconds(job.finished_at, job.dispatched_at))
        if job.dispatched_at <= mine.arrived_at:
            out.append(Ahead(job, True, None, "already running", None, ran))
            continue
        if job.score is None:
            out.append(Ahead(job, False, None, "unknown", None, ran))
            continue
        divisor = job.aging_divisor or 0.0
        bonus = job.swap_affinity_bonus or 0
        # The model loaded when the job was picked: the job's own when it needed no swap.
        loaded_then = job.model if job.needs_swap is False else before_pick
        # The request's own score at the job's pick, by the core's formula (policy.py).
        waited = _seconds(job.dispatched_at, mine.arrived_at)
        my_uncapped = aging_points(waited, divisor, None)
        cap = _aging_cap(job, divisor)
        my_aging = aging_points(waited, divisor, cap)
        my_affinity = float(bonus) if loaded_then is not None and mine.model == loaded_then else 0.0
        my_score = serial_score(mine.priority, my_affinity, my_aging)
        priority_gap = job.score - (job.affinity or 0.0) - (job.aging or 0.0) - mine.priority
        affinity_gap = (job.affinity or 0.0) - my_affinity
        static_gap = priority_gap + affinity_gap
        lead = job.score - my_score
        margin: float | None
        terms = set(job.reordered_by or ())
        if "band_share" in terms:
            term, margin = "band share", None
        elif cap is not None and my_score + (my_uncapped - my_aging) > job.score + LEAD_SLACK:
            term, margin = "aging cap", my_uncapped - my_aging
        elif lead < -LEAD_SLACK:
            term, margin = "unclear (settings changed?)", None
        elif abs(static_gap) <= EPS:
            # Same priority and affinity: it had waited longer (arrival order).
            term, margin = "arrival order", None
        elif static_gap < 0:
            term, margin = (
                "aging",
                lead,
            )  # it was behind on priority + affinity; waiting made up for it
        elif priority_gap > EPS and priority_gap >= affinity_gap:
            term, margin = "priority", priority_gap
        else:
            term, margin = "swap affinity", affinity_gap
        out.append(
            Ahead(
                job,
                False,
                round(my_score, 3),
                term,
                None if margin is None else round(margin, 3),
                ran,
                NOTES.get(term, ""),
            )
        )
    return out


def _aging_cap(job: Job, divisor: float) -> float | None:
    """The agingCap in effect when ``job`` was picked: recorded on the row, or read off
    the job itself when its aging stopped short of its wait (None: no cap seen)."""
    recorded = getattr(job, "aging_cap", None)
    if recorded is not None:
        return float(recorded)
    if not divisor or job.aging is None or job.dispatched_at is None:
        return None
    uncapped = aging_points(_seconds(job.dispatched_at, job.arrived_at), divisor, None)
    if uncapped - job.aging > LEAD_SLACK:
        return float(job.aging)
    return None
