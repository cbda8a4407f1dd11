"""An unload during a load stops the load and keeps its requests waiting for the next start.

Through the real server: ``/api/models/unload`` while a slow model loads frees the GPU (the
loading process is gone) and the request that waited for it is answered 200 by a fresh
start. Then the dispatcher over the in-memory fakes: the picked request keeps its turn and
its place, every ticket ends exactly once (left, ended by its view at the same moment,
shutdown), both places a swap can be stopped (waiting for the previous model's stop, or
starting), fifo as serial.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest

from scheduler.dispatcher import Outcome, ShuttingDown, TicketState
from scheduler.process import ModelState
from scheduler.testing import FakeProcessFactory
from tests.helpers import EventLog, granted, make_config, settle, until
from tests.server import alive, chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(60)


# -- through the real server ----------------------------------------------------------------


def models(server) -> list[int]:
    """The server's live fakellm processes."""
    found = []
    for pid in server.children():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"fakellm" in cmd and alive(pid):
            found.append(pid)
    return found


def test_unload_during_a_slow_load_then_the_waiting_request_is_served(tmp_path):
    port = free_port_block(1)
    with serve(tmp_path, {"slow": fake_model(port, load_seconds=1.0)}) as server:

        async def scenario() -> tuple[httpx.Response, httpx.Response, int]:
            async with httpx.AsyncClient(timeout=30) as client:
                waiting = asyncio.create_task(
                    client.post(server.url + "/v1/chat/completions", json=chat("slow"))
                )
                await asyncio.to_thread(
                    server.wait_for,
                    "the model is loading",
                    lambda s: [r["state"] for r in s["running"]] == ["loading"] and models(server),
                )
                (first,) = models(server)
                unloaded = await client.post(server.url + "/api/models/unload")
                return unloaded, await waiting, first

        unloaded, answer, first = asyncio.run(scenario())
        assert unloaded.status_code == 200
        assert not alive(first)  # the load was stopped: the GPU was freed as asked
        assert answer.status_code == 200, answer.text  # not 503 "unloaded while loading"
        assert answer.json()["choices"][0]["message"]["content"]
        (second,) = models(server)
        assert second != first  # served by the next start


# -- the dispatcher over fakes --------------------------------------------------------------


@pytest.fixture
async def world(dispatchers):
    async def build(*models, factory=None, **kwargs):
        factory = factory or FakeProcessFactory()
        events = EventLog()
        d = await dispatchers(
            make_config(*models, **kwargs), process_factory=factory, observers=[events]
        )
        return d, factory, events

    return build


def submit(d, model, priority, rid):
    return d.submit(d.config.models[model], priority, rid, "/v1/chat/completions")


def finishes(events: EventLog) -> Counter:
    return Counter(rid for what, rid in events.events if what == "finish")


@pytest.mark.parametrize("use", ["serial", "fifo"])
async def test_the_loading_request_keeps_its_turn_and_the_next_start_serves_it(world, use):
    factory = FakeProcessFactory(hold_start=True)
    d, _, events = await world("m", use=use, factory=factory)
    loading = submit(d, "m", 0, "loading")
    await settle()
    assert loading.state is TicketState.LOADING
    behind = submit(d, "m", 0, "behind")
    first = factory.processes["m"]
    async with asyncio.timeout(2):
        await d.unload()
    assert first.state is ModelState.STOPPED and ("ready", "m") not in factory.journal
    # Started again at once, once the stopped process was reaped: requests wait for it.
    await until(lambda: factory.processes["m"] is not first)
    assert factory.journal == [("start", "m"), ("start_failed", "m"), ("start", "m")]
    assert loading.state is TicketState.LOADING and loading.outcome is None
    factory.processes["m"].release()
    assert await granted(loading) == "http://127.0.0.1:9000"
    d.finish(loading, Outcome.COMPLETED, 200)
    await granted(behind)
    d.finish(behind, Outcome.COMPLETED, 200)
    await settle()
    assert finishes(events) == {"loading": 1, "behind": 1}
    assert factory.journal.count(("start", "m")) == 2


async def test_the_picked_request_keeps_its_place(world):
    factory = FakeProcessFactory()
    factory.configure("a", hold_start=True)
    d, _, events = await world("a", "b", factory=factory, swap_affinity_bonus=0)
    first = submit(d, "a", 0, "first")
    await settle()
    assert first.state is TicketState.LOADING
    later = submit(d, "b", 0, "later")  # same priority, arrived after it
    await settle()
    await d.unload(["a"])
    await settle()
    # "first" arrived before "later": picked again before it, its model started again.
    assert first.state is TicketState.LOADING and later.state is TicketState.WAITING
    factory.processes["a"].release()
    await granted(first)
    d.finish(first, Outcome.COMPLETED, 200)
    await granted(later)
    d.finish(later, Outcome.COMPLETED, 200)
    await settle()
    assert finishes(events) == {"first": 1, "later": 1}


async def test_an_unload_while_the_swap_waits_for_the_previous_stop(world):
    factory = FakeProcessFactory(stop_delay=0.2)
    d, _, events = await world("a", "b", factory=factory)
    t = submit(d, "a", 0, "a1")
    await granted(t)
    d.finish(t, Outcome.COMPLETED, 200)
    nxt = submit(d, "b", 0, "b1")
    await until(lambda: ("stop", "a") in factory.journal)
    assert nxt.state is TicketState.LOADING and "b" not in factory.processes
    async with asyncio.timeout(2):
        await d.unload(["b"])  # b's swap gives up before starting anything
    assert await granted(nxt) == "http://127.0.0.1:9001"  # then b starts for it
    assert factory.journal.count(("start", "b")) == 1
    assert factory.journal.index(("stopped", "a")) < factory.journal.index(("start", "b"))
    d.finish(nxt, Outcome.COMPLETED, 200)
    await settle()
    assert finishes(events) == {"a1": 1, "b1": 1}


async def test_a_client_that_leaves_during_the_second_load_ends_once(world):
    factory = FakeProcessFactory()
    factory.configure("m", hold_start=True)
    d, _, events = await world("m", "n", factory=factory)
    leaver = submit(d, "m", 0, "leaver")
    await settle()
    other = submit(d, "n", -100, "other")  # queued behind it
    await d.unload(["m"])
    await settle()
    assert leaver.state is TicketState.LOADING  # its model loads again
    d.cancel(leaver)
    await granted(other)  # and the load nobody waits for gives way
    d.finish(other, Outcome.COMPLETED, 200)
    await settle()
    assert leaver.state is TicketState.DONE and leaver.outcome is Outcome.CANCELLED_RUNNING
    assert factory.processes["m"].state is ModelState.STOPPED
    assert finishes(events) == {"leaver": 1, "other": 1}


async def test_a_request_ended_by_its_view_as_the_load_stops_starts_nothing(world):
    factory = FakeProcessFactory(hold_start=True)
    d, _, events = await world("m", factory=factory)
    gone = submit(d, "m", 0, "gone")
    await settle()
    unloading = asyncio.create_task(d.unload())
    d.cancel(gone)  # in the same batch as the unload
    await unloading
    await settle()
    assert gone.state is TicketState.DONE and gone.outcome is Outcome.CANCELLED_RUNNING
    assert len(d.queue) == 0 and d.in_flight() == []
    assert factory.journal == [("start", "m"), ("start_failed", "m")]
    assert finishes(events) == {"gone": 1}


async def test_an_unload_during_a_load_at_shutdown_ends_the_request_as_shutting_down(world):
    factory = FakeProcessFactory(hold_start=True)
    d, _, events = await world("m", factory=factory)
    loading = submit(d, "m", 0, "loading")
    await settle()
    stopping = asyncio.create_task(d.stop(grace=5))
    await settle()
    async with asyncio.timeout(3):
        await d.unload()
        with pytest.raises(ShuttingDown):
            await granted(loading)
        await stopping
    assert loading.outcome is Outcome.REJECTED and loading.status == 503
    assert finishes(events) == {"loading": 1}
