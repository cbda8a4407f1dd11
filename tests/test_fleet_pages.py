"""The control room across a fleet (docs/fleet.md): the history names each request's node
and filters by it, a request's page says where it was placed and why, and a record keeps
its placement through the journal (activity/rows.py's snapshot)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from activity.models import RequestRecord
from activity.rows import snapshot, snapshot_fields
from scheduler.core.policy import SchedulerSettings
from scheduler.dispatcher import Outcome, Ticket
from tests.helpers import make_config

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
SENT = "sent to box-b: model loaded there, not loaded here, estimated wait 2.0 s against 40 s here"


def _record(request_id: str, node: str = "", at: float = 0.0, **values) -> RequestRecord:
    return RequestRecord.objects.create(
        request_id=request_id,
        model="qwen",
        path="/v1/chat/completions",
        priority=0,
        band="normal",
        policy="peer" if values.get("peer") else "serial",
        node=node,
        arrived_at=T0 + timedelta(seconds=at),
        finished_at=T0 + timedelta(seconds=at + 1),
        outcome="completed",
        status=200,
        duration_ms=1000.0,
        **values,
    )


@pytest.mark.django_db
def test_history_names_each_node_and_filters_by_it(client):
    _record("on-a", "box-a", 1)
    _record("placed", "box-a", 2, peer="box-b", placement=SENT)
    _record("on-b", "box-b", 3)
    page = client.get("/history/").content.decode()
    assert "<th" in page and ">node</th>" in page
    assert '<option value="box-b" >box-b</option>' in page.replace("  ", " ")
    assert "box-a → box-b" in page  # received by box-a, ran on box-b
    only_b = client.get("/history/?node=box-b").content.decode()
    assert "1 request" in only_b and "on-b" in only_b and "on-a" not in only_b
    nowhere = client.get("/history/?node=box-z")
    assert nowhere.status_code == 200 and "no recorded requests match" in nowhere.content.decode()


@pytest.mark.django_db
def test_one_box_shows_no_node_column(client):
    _record("alone")
    page = client.get("/history/").content.decode()
    assert ">node</th>" not in page and 'name="node"' not in page


@pytest.mark.django_db
def test_the_request_page_says_where_it_was_placed_and_why(client):
    _record("placed", "box-a", peer="box-b", placement=SENT)
    page = client.get("/requests/placed/").content.decode()
    assert f"Placement by <strong>box-a</strong>: {SENT}." in page
    _record("here", "box-a", 5)
    assert 'id="placement"' not in client.get("/requests/here/").content.decode()


def _ticket(**extra) -> Ticket:
    return Ticket(
        request_id="r1",
        model=make_config("qwen").models["qwen"],
        priority=0,
        path="/v1/chat/completions",
        arrival=10.0,
        arrival_wall=1_790_000_000.0,
        granted=None,  # type: ignore[arg-type]
        outcome=Outcome.COMPLETED,
        status=200,
        extra=extra,
    )


def test_the_placement_goes_into_the_record_and_an_older_journal_still_replays():
    snap = snapshot(_ticket(placement=SENT, peer="box-b"), SchedulerSettings(), 11.0)
    fields = snapshot_fields(snap)
    assert fields["placement"] == SENT and fields["peer"] == "box-b"
    older = (1, *snap[1:-1])  # a version 1 line, journaled before placement was recorded
    assert snapshot_fields(older)["placement"] == ""
    assert snapshot_fields(older) | {"placement": SENT} == fields
    with pytest.raises(ValueError, match="version 9"):
        snapshot_fields((9, *snap[1:]))
