"""Records delayed by a database outage, as the fleet shows them (activity/recorder.py's
``delayed``, fleet/view.py's ``delayed`` in a node's message and the fleet's state). The
end-to-end outages are in tests/test_e2e_fleet_outage.py."""

from __future__ import annotations

import json
import threading

import pytest
from django.db import OperationalError

from activity.recorder import DELAYED_AFTER, Recorder
from fleet.view import BadMessage, FleetView, decode, decode_message, encode
from scheduler.core.placement import NodeView
from scheduler.dispatcher import Dispatcher, Outcome
from scheduler.testing import FakeProcessFactory
from tests.helpers import FakeClock, granted, make_config, until

pytestmark = pytest.mark.timeout(20)


def test_a_nodes_delayed_records_survive_the_wire():
    view = NodeView(node="box-a", url="http://a", heard=0.0)
    back, token, seq, delayed = decode_message(encode(view, "t", 3, delayed=8), heard=1.0)
    assert (back.node, token, seq, delayed) == ("box-a", "t", 3, 8)
    assert decode(encode(view, "t", 3, delayed=8), heard=1.0)[2] == 3
    older = {k: v for k, v in json.loads(encode(view, "t", 3)).items() if k != "delayed"}
    assert decode_message(json.dumps(older), heard=1.0)[3] == 0  # a node of before: none
    for bad in (-1, "8", True, 1.5):
        with pytest.raises(BadMessage):
            decode_message(json.dumps({**older, "delayed": bad}), heard=1.0)


def test_the_fleet_state_names_each_nodes_delayed_records():
    view = FleetView(here="box-a", degraded=False)
    view.update(NodeView(node="box-a", url="http://a", heard=10.0), "t", 1)
    view.update(NodeView(node="box-b", url="http://b", heard=10.0), "u", 1)
    view.delayed.update({"box-a": 0, "box-b": 8})
    state = view.state(now=10.5)
    assert {n["node"]: n["delayed"] for n in state["nodes"]} == {"box-a": 0, "box-b": 8}
    assert state["records_delayed"] == 8


@pytest.fixture
async def recording():
    """``await recording(writer)`` -> (dispatcher, recorder, clock), stopped after."""
    built = []

    async def build(writer):
        clock = FakeClock()
        recorder = Recorder(clock=clock, writer=writer, interval=0.02)
        dispatcher = Dispatcher(
            make_config("a"),
            process_factory=FakeProcessFactory(),
            clock=clock,
            wall_clock=clock.wall,
            observers=[recorder],
        )
        await dispatcher.start()
        await recorder.start()
        built.append((dispatcher, recorder))
        return dispatcher, recorder, clock

    yield build
    for dispatcher, recorder in built:
        await dispatcher.stop(grace=0)
        await recorder.stop(timeout=1)


async def finish(dispatcher: Dispatcher, count: int) -> None:
    model = dispatcher.config.models["a"]
    for i in range(count):
        ticket = dispatcher.submit(model, 0, f"r{i}", "/v1/chat/completions")
        await granted(ticket)
        dispatcher.finish(ticket, Outcome.COMPLETED, 200)


async def test_records_are_delayed_while_the_database_fails_and_not_after(recording):
    outage = {"on": True, "attempts": 0}

    def writer(items):
        outage["attempts"] += 1
        if outage["on"]:
            raise OperationalError("server closed the connection unexpectedly")
        return 0

    dispatcher, recorder, _ = await recording(writer)
    await finish(dispatcher, 3)
    await until(lambda: recorder.delayed == 3)  # at once: the write failed
    assert outage["attempts"] == 1
    outage["on"] = False
    await until(lambda: recorder.pending == 0, timeout=5)
    assert recorder.delayed == 0


async def test_records_behind_a_write_that_hangs_are_delayed_after_a_while(recording):
    release = threading.Event()
    entered = threading.Event()

    def writer(items):
        entered.set()
        release.wait(10)
        return 0

    dispatcher, recorder, clock = await recording(writer)
    try:
        await finish(dispatcher, 2)
        await until(entered.is_set)
        assert recorder.pending == 2 and recorder.delayed == 0  # the usual pace, so far
        clock.advance(DELAYED_AFTER)
        assert recorder.delayed == 2
    finally:
        release.set()
    await until(lambda: recorder.pending == 0, timeout=5)
    assert recorder.delayed == 0
