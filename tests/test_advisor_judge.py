"""The advisor says when the history is too small to judge (issue 21): pure, no database."""

from __future__ import annotations

import dataclasses

from scheduler.core.advisor import MIN_BAND_REQUESTS, advise, suggestion, too_small, within_noise
from scheduler.core.policy import SchedulerSettings
from scheduler.core.priority import Band
from scheduler.core.simulate import GENERATED_LOAD_SECONDS, generate_trace, simulate


def _runs(n: int, step: int = 1):
    trace = generate_trace(1000, seed=0)[:n:step]
    settings = SchedulerSettings()
    recorded = simulate(trace, settings, GENERATED_LOAD_SECONDS, label="recorded")
    replay = simulate(trace, settings, GENERATED_LOAD_SECONDS, label="replay")
    suggested = simulate(trace, suggestion(settings), GENERATED_LOAD_SECONDS, label="suggested")
    return recorded, replay, suggested


def test_a_big_overloaded_history_is_judged_and_advised():
    recorded, replay, suggested = _runs(600)
    assert too_small(recorded) is None
    assert not within_noise(replay, suggested)
    assert advise(recorded, SchedulerSettings(), replay, suggested) is not None


def test_a_small_history_is_named_too_small_and_gets_no_advice():
    recorded, replay, suggested = _runs(600, step=10)
    counts = {band: r.requests for band, r in recorded.bands.items()}
    assert any(0 < n < MIN_BAND_REQUESTS for n in counts.values()), counts
    message = too_small(recorded)
    assert message is not None and message.startswith("The history is too small to judge")
    thin = [b.value for b, n in counts.items() if 0 < n < MIN_BAND_REQUESTS]
    assert all(f"{band} {counts[Band(band)]}" in message for band in thin), message
    assert advise(recorded, SchedulerSettings(), replay, suggested) is None


def test_a_gain_seen_only_against_the_recording_is_noise():
    recorded, replay, suggested = _runs(600)
    interactive = suggested.bands[Band.INTERACTIVE]
    # The replay of the settings in effect already waits as little as the suggestion.
    same = dataclasses.replace(
        replay, bands={**replay.bands, Band.INTERACTIVE: dataclasses.replace(interactive)}
    )
    assert within_noise(same, suggested)
    assert advise(recorded, SchedulerSettings(), same, suggested) is None


def test_empty_bands_do_not_count_as_too_small():
    recorded, _, _ = _runs(600)
    emptied = dataclasses.replace(
        recorded,
        bands={
            **recorded.bands,
            Band.BATCH: dataclasses.replace(recorded.bands[Band.BATCH], requests=0),
        },
    )
    assert too_small(emptied) is None
