"""The what-if page and the advisor (issue 13): a window of the recorded history replayed
under the settings in effect and candidates, off the event loop, cached."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from django.urls import reverse

from dashboard import whatif
from scheduler.core.advisor import advise, cross_band, suggestion
from scheduler.core.policy import SchedulerSettings, Term
from scheduler.core.simulate import GENERATED_LOAD_SECONDS, generate_trace, simulate
from tests.test_replay import record_run

pytestmark = pytest.mark.django_db


def _inline(fn):
    future: Future = Future()
    try:
        future.set_result(fn())
    except Exception as error:  # noqa: BLE001  # the page reports it
        future.set_exception(error)
    return future


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    whatif.clear()
    monkeypatch.setattr(whatif, "_submit", _inline)
    yield
    whatif.clear()


@pytest.fixture
def overloaded():
    """The generated overload trace (its first 600 requests), as recorded under the
    spec's defaults: a batch flood that aging lets ahead of interactive work."""
    trace = generate_trace(1000, seed=0)[:600]
    result = simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS)
    record_run(result, trace, GENERATED_LOAD_SECONDS)
    return trace, result


def test_the_page_replays_the_window_with_candidates_and_advises(client, overloaded):
    url = reverse("dashboard:whatif")
    response = client.get(
        url, {"since": "2026-11-30", "c1": "agingCap=100", "c2": "use=fifo", "tz": "UTC"}
    )
    assert response.status_code == 200
    page = response.content.decode()
    for label in ("recorded", "replay: defaults", "agingCap=100", "use=fifo"):
        assert f'<th class="n">{label}</th>' in page
    assert "with 100% of the picks in the same order" in page
    assert page.count("<polyline") == 3 * 4  # three bands, four columns
    assert "Advice" in page and "Aging decided" in page
    assert "agingCap=100" in page and "bandShare.batch=0.2" in page
    # Cached: a second load computes nothing.
    calls = []
    original = whatif.compute
    whatif.compute = lambda *a, **k: calls.append(1) or original(*a, **k)  # type: ignore[assignment]
    try:
        again = client.get(
            url, {"since": "2026-11-30", "c1": "agingCap=100", "c2": "use=fifo", "tz": "UTC"}
        )
    finally:
        whatif.compute = original  # type: ignore[assignment]
    assert again.status_code == 200 and calls == []
    advice = whatif.latest_advice()
    assert advice is not None and advice.suggested.aging_cap == 100


def test_no_advice_before_any_replay():
    assert whatif.latest_advice() is None


def test_while_it_runs_the_page_says_so_and_reloads(client, overloaded, monkeypatch):
    pending: Future = Future()
    monkeypatch.setattr(whatif, "_submit", lambda fn: pending)
    response = client.get(reverse("dashboard:whatif"))
    page = response.content.decode()
    assert response.status_code == 200
    assert 'http-equiv="refresh"' in page and "Replaying 600 recorded requests" in page


def test_bad_candidates_and_dates_are_named(client, overloaded):
    response = client.get(reverse("dashboard:whatif"), {"c1": "agingCap=-1", "since": "yesterday"})
    page = response.content.decode()
    assert response.status_code == 400
    assert "agingCap" in page and "since:" in page


def test_an_empty_window_says_so(client, overloaded):
    response = client.get(reverse("dashboard:whatif"), {"until": "2026-01-01"})
    assert response.status_code == 200 and "No request was recorded" in response.content.decode()


def test_the_advisor_stays_quiet_when_aging_decides_nothing_across_bands():
    trace = generate_trace(600, seed=1, shape="steady")
    recorded = simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS, label="recorded")
    suggested = simulate(trace, suggestion(SchedulerSettings()), GENERATED_LOAD_SECONDS)
    assert advise(recorded, SchedulerSettings(), recorded, suggested) is None


def test_cross_band_counts_picks_ahead_of_waiting_higher_band_work():
    trace = generate_trace(1000, seed=0)
    recorded = simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS)
    crossing = cross_band(recorded)
    assert crossing.picks > 100 and crossing.aging_share > 0.9
    # Strict priority never lets a lower band go while a higher one waits.
    fifo = simulate(trace, SchedulerSettings.create(use="fifo"), GENERATED_LOAD_SECONDS)
    assert cross_band(fifo).picks == 0
    assert all(Term.AGING not in d.reordered_by for d in fifo.dispatches)


def test_suggestion_keeps_what_is_set():
    s = suggestion(SchedulerSettings.create(aging_cap=50, swap_affinity_bonus=40))
    assert s.aging_cap == 50 and s.swap_affinity_bonus == 40 and s.band_share
