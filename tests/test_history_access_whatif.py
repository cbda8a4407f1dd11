"""Issue 21's history, access and what-if pieces without a browser: outcome names in words
(one mapping, page and API), the history's outcome and lane filters, the dashboard's open
or keyed line, and the what-if charts and verdicts for candidates that coincide."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

import pytest
from django.contrib.auth.models import User
from django.urls import reverse

from activity.models import OUTCOME_WORDS, RequestRecord, outcome_words
from control.keys import set_keys_required
from dashboard import whatif
from dashboard.snapshot import access_block
from scheduler.core.policy import SchedulerSettings
from scheduler.core.priority import Band
from scheduler.core.simulate import GENERATED_LOAD_SECONDS, generate_trace, simulate
from scheduler.dispatcher import Outcome

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _row(request_id: str, minutes: int, **fields) -> RequestRecord:
    values = {
        "model": "m",
        "path": "/v1/chat/completions",
        "priority": 0,
        "band": "normal",
        "policy": "serial",
        "finished_at": T0 + timedelta(minutes=minutes, seconds=1),
        "outcome": "completed",
        "status": 200,
        "duration_ms": 1000.0,
    }
    values.update(fields)
    return RequestRecord.objects.create(
        request_id=request_id, arrived_at=T0 + timedelta(minutes=minutes), **values
    )


def test_every_outcome_has_words_and_codes_are_not_shown_as_words():
    assert set(OUTCOME_WORDS) == {o.value for o in Outcome}
    assert outcome_words("cancelled_waiting") == "cancelled while waiting"
    assert outcome_words("cancelled_running") == "cancelled while running"
    assert all("_" not in words for words in OUTCOME_WORDS.values())
    assert outcome_words("something_new") == "something_new"


@pytest.mark.django_db
def test_history_filters_by_outcome_and_lane_and_says_outcomes_in_words(client):
    _row("a-done", 1, lane="gpu0", prompt_tokens=12, completion_tokens=34, tokens_per_second=56.7)
    _row("b-gone", 2, lane="gpu1", outcome="cancelled_waiting", status=None)
    _row("c-done", 3, lane="gpu1", path="/v1/embeddings")
    url = reverse("dashboard:history")

    page = client.get(url, {"outcome": "cancelled_waiting"}).content.decode()
    assert "b-gone" in page and "a-done" not in page and "c-done" not in page
    assert "cancelled while waiting" in page
    assert '<option value="cancelled_waiting" selected>cancelled while waiting</option>' in page

    page = client.get(url, {"lane": "gpu1", "outcome": "completed"}).content.decode()
    assert "c-done" in page and "a-done" not in page and "b-gone" not in page
    assert "/v1/embeddings" in page

    page = client.get(url, {"lane": "gpu0"}).content.decode()
    assert ">12<" in page.replace(" ", "") and ">34<" in page and ">56.7<" in page

    bad = client.get(url, {"outcome": "cancelled"})
    assert bad.status_code == 400
    assert "outcome: there is no outcome" in bad.content.decode()


@pytest.mark.django_db
def test_the_api_gives_the_outcome_in_words_beside_the_code(client):
    _row("gone", 1, outcome="cancelled_waiting", status=None)
    (row,) = client.get("/api/metrics/activity").json()["data"]
    assert row["outcome"] == "cancelled_waiting"
    assert row["outcome_text"] == "cancelled while waiting"


def test_access_line_words():
    assert access_block(keyed=False, keys=0)["text"] == "API open: no key needed"
    keyed = access_block(keyed=True, keys=1, since=1.0, by="admin")
    assert keyed["text"] == "API keyed: every API call needs a key (1 key in force)"
    assert access_block(keyed=True, keys=3)["text"].endswith("(3 keys in force)")
    assert access_block(keyed=True, keys=None)["text"] == "API keyed: every API call needs a key"


@pytest.mark.django_db
def test_the_dashboard_says_open_then_keyed_with_who_and_counters_since_start(client):
    page = client.get("/").content.decode()
    assert 'data-keyed="false"' in page and "API open: no key needed" in page
    assert "since the server started" in page and "dispatched since start" in page
    set_keys_required(True, "admin", follow=False)
    User.objects.create_superuser("boss", "b@example.com", "pw-boss-123")
    client.login(username="boss", password="pw-boss-123")
    page = client.get("/").content.decode()
    assert 'data-keyed="true"' in page and "keys required since" in page and "by admin" in page


def test_identical_lines_are_marked_not_hidden():
    trace = generate_trace(200, seed=0)
    one = simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS, label="replay")
    twin = dataclasses.replace(one, label="agingDivisor=600")
    charts = whatif.charts([one, twin])
    for chart in charts:
        if len(chart["lines"]) == 2:
            first, second = chart["lines"]
            assert not first["dotted"] and second["dotted"]
            assert second["label"] == "agingDivisor=600 (same as replay)"
    assert all(len(t["label"]) for c in charts for t in c["x_ticks"])


def test_verdicts_say_better_or_worse_against_the_replay():
    trace = generate_trace(600, seed=0)
    replay = simulate(trace, SchedulerSettings(), GENERATED_LOAD_SECONDS, label="replay")
    capped = simulate(
        trace, SchedulerSettings.create(aging_cap=100), GENERATED_LOAD_SECONDS, label="cap"
    )
    (verdict,) = whatif.verdicts([replay, replay, capped])
    interactive = verdict["cells"][0]
    was = replay.bands[Band.INTERACTIVE].wait_p95
    now = capped.bands[Band.INTERACTIVE].wait_p95
    expected = "better" if now < was else "worse"
    assert interactive["kind"] in (expected, "same")
    assert interactive["text"].split(" ")[0] in ("▼", "▲", "=")
