"""The advisor: when unbounded aging is deciding which band goes first and interactive
requests wait long, say so, with the replayed effect of the opt-in bounds.

Pure. Nothing changes by itself: the dashboard shows the advice and an admin applies it.
The advice holds when, in the recorded window:

* at least :data:`MIN_CROSS_BAND` picks went ahead of a waiting request of a higher band
  (a batch job while an interactive request waited, say), and aging decided more than
  half of them (``aging`` in the pick's ``reordered_by``); and
* the interactive p95 wait was over :data:`MIN_INTERACTIVE_P95` seconds and the replay
  of the suggested settings cuts it by at least a third; and
* the history is big enough to judge (:func:`too_small`): at least
  :data:`MIN_BAND_REQUESTS` replayed requests in each band that has any, and the
  suggestion's gain holds against the replay of the settings in effect too (not only
  against what happened, which the replay reproduces only approximately).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from scheduler.core.policy import SchedulerSettings, Term
from scheduler.core.priority import BANDS, Band
from scheduler.core.simulate import (
    RECOMMENDED,
    SimResult,
    describe_settings,
    format_duration,
    parse_overrides,
)

MIN_CROSS_BAND = 10
MIN_INTERACTIVE_P95 = 30.0
MIN_GAIN = 1.5
MIN_BAND_REQUESTS = 30
"""Fewer replayed requests than this in a band, and its percentiles are noise."""


@dataclass(frozen=True)
class CrossBand:
    picks: int
    """Picks that went while a request of a higher band was waiting."""
    by_aging: int
    """Of those, the picks aging decided."""

    @property
    def aging_share(self) -> float:
        return self.by_aging / self.picks if self.picks else 0.0


def cross_band(result: SimResult) -> CrossBand:
    """Count the picks made while a higher band had work waiting. O(n log n)."""
    arrivals: dict[Band, list[float]] = {band: [] for band in BANDS}
    starts: dict[Band, list[float]] = {band: [] for band in BANDS}
    for d in result.dispatches:
        arrivals[d.band].append(d.arrival)
        starts[d.band].append(d.start)
    for band in BANDS:
        arrivals[band].sort()
        starts[band].sort()
    picks = by_aging = 0
    for d in result.dispatches:
        higher = BANDS[: BANDS.index(d.band)]
        if any(
            bisect_right(arrivals[b], d.start) - bisect_right(starts[b], d.start) > 0
            for b in higher
        ):
            picks += 1
            by_aging += Term.AGING in d.reordered_by
    return CrossBand(picks, by_aging)


def aging_decides(crossing: CrossBand) -> bool:
    """The first half of the advice: aging decides most picks across bands (checked
    before replaying the suggestion, which is then needed)."""
    return crossing.picks >= MIN_CROSS_BAND and crossing.aging_share > 0.5


def suggestion(current: SchedulerSettings) -> SchedulerSettings:
    """The current settings with the recommended bounds added (what is set stays)."""
    recommended = parse_overrides([RECOMMENDED])
    changes: dict[str, object] = {}
    if current.aging_cap is None:
        changes["aging_cap"] = recommended.aging_cap
    if not current.band_share:
        changes["band_share"] = {b.value: s for b, s in recommended.band_share.items()}
    if current.swap_affinity_bonus < recommended.swap_affinity_bonus:
        changes["swap_affinity_bonus"] = recommended.swap_affinity_bonus
    return current.with_changes(**changes) if changes else current


@dataclass(frozen=True)
class Advice:
    message: str
    suggested: SchedulerSettings
    changes: str
    """The settings to set, as ``name=value`` pairs (the admin's fields)."""
    before: SimResult
    after: SimResult


def too_small(recorded: SimResult, minimum: int = MIN_BAND_REQUESTS) -> str | None:
    """Why the window cannot be judged (some band has requests, but fewer than
    ``minimum``), as a sentence for the page; None when every band with requests has
    enough."""
    thin = [
        f"{band.value} {recorded.bands[band].requests}"
        for band in BANDS
        if band in recorded.bands and 0 < recorded.bands[band].requests < minimum
    ]
    if not thin:
        return None
    return (
        f"The history is too small to judge: replayed requests per band {', '.join(thin)} "
        f"(fewer than {minimum}). Differences between the columns at this size are noise; record more "
        "traffic or widen the window before changing settings."
    )


def within_noise(replay_current: SimResult, replay_suggested: SimResult) -> bool:
    """Does the suggestion's interactive gain vanish against the replay of the settings in
    effect? (The replay reproduces what happened only approximately: a gain measured
    against the recording alone may be the replay's error.)"""
    now = replay_current.bands[Band.INTERACTIVE].wait_p95
    would = replay_suggested.bands[Band.INTERACTIVE].wait_p95
    return now < MIN_GAIN * would


def advise(
    recorded: SimResult,
    current: SchedulerSettings,
    replay_current: SimResult,
    replay_suggested: SimResult,
) -> Advice | None:
    """The advice, or None when the recorded window does not call for it."""
    crossing = cross_band(recorded)
    if not aging_decides(crossing):
        return None
    was = recorded.bands[Band.INTERACTIVE].wait_p95
    would = replay_suggested.bands[Band.INTERACTIVE].wait_p95
    if was < MIN_INTERACTIVE_P95 or was < MIN_GAIN * would:
        return None
    if too_small(recorded) is not None or within_noise(replay_current, replay_suggested):
        return None  # the page says why (too_small); no advice on noise
    suggested = replay_suggested.settings
    batch_was = replay_current.bands[Band.BATCH].wait_max
    batch_would = replay_suggested.bands[Band.BATCH].wait_max
    changes = _changes(current, suggested)
    message = (
        f"Aging decided {crossing.by_aging} of the {crossing.picks} picks "
        f"({crossing.aging_share:.0%}) that went ahead of waiting work of a higher band, and "
        f"interactive requests waited {format_duration(was)} at p95. Replayed with "
        f"{changes}: interactive p95 {format_duration(would)}, batch max wait "
        f"{format_duration(batch_would)} (replay of the settings in effect: "
        f"{format_duration(batch_was)}), swaps {replay_suggested.swaps} "
        f"(was {replay_current.swaps}). Nothing changes by itself: an admin applies it."
    )
    return Advice(message, suggested, changes, replay_current, replay_suggested)


def _changes(current: SchedulerSettings, suggested: SchedulerSettings) -> str:
    now, then = describe_settings(current).split(","), describe_settings(suggested).split(",")
    return ", ".join(part for part in then if part not in now) or "no change"
