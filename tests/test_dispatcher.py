"""The dispatcher task over in-memory model processes: who gets the GPU, and when.

No sockets and no subprocesses: scheduler.testing's fakes record every start and stop,
and tickets are driven the way the proxy views drive them.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from scheduler.config import parse_config
from scheduler.core.policy import SchedulerSettings
from scheduler.dispatcher import (
    Outcome,
    Overloaded,
    QueueFull,
    ShuttingDown,
    TicketState,
    WaitExpired,
)
from scheduler.process import ModelStartError, ModelState
from scheduler.testing import FakeProcessFactory
from tests.helpers import EventLog, granted, make_config, settle

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
async def world(dispatchers):
    """``await world(*models, factory=None, **settings)`` -> (dispatcher, factory, events)."""

    async def build(*models, factory=None, **kwargs):
        factory = factory or FakeProcessFactory()
        events = EventLog()
        d = await dispatchers(make_config(*models, **kwargs), process_factory=factory, observers=[events])
        return d, factory, events

    return build


def submit(d, model, priority, rid):
    return d.submit(d.config.models[model], priority, rid, "/v1/chat/completions")


async def test_serial_runs_one_request_at_a_time_in_priority_order(world):
    d, factory, rec = await world("m")
    first = submit(d, "m", 0, "first")
    await granted(first)
    waiting = [submit(d, "m", p, rid) for p, rid in [(-100, "batch"), (0, "normal"), (100, "vip")]]
    await settle()
    assert all(t.state is TicketState.WAITING for t in waiting)
    order = []
    current = first
    for _ in waiting:
        d.finish(current, Outcome.COMPLETED, 200)
        await settle()
        running = [t for t in waiting if t.state is TicketState.RUNNING]
        assert len(running) == 1  # exactly one request in flight
        current = running[0]
        await granted(current)
        order.append(current.request_id)
    assert order == ["vip", "normal", "batch"]


async def test_a_swap_stops_the_loaded_model_before_starting_the_next(world):
    d, factory, rec = await world("a", "b")
    t1 = submit(d, "a", 0, "1")
    assert await granted(t1) == "http://127.0.0.1:9000"
    d.finish(t1, Outcome.COMPLETED, 200)
    t2 = submit(d, "b", 0, "2")
    assert await granted(t2) == "http://127.0.0.1:9001"
    assert factory.journal == [
        ("start", "a"),
        ("ready", "a"),
        ("stop", "a"),
        ("stopped", "a"),
        ("start", "b"),
        ("ready", "b"),
    ]
    assert t2.swapped and t2.decision.needs_swap
    assert d.running_models() == [{"model": "b", "state": "ready", "lane": "default"}]


async def test_a_model_that_fails_to_start_fails_its_request_and_cools_down(dispatchers):
    # Before startFailureCooldown every request tried the start again; now, for the
    # cool-down (5 s by default), the next ones fail at once with the same cause.
    factory = FakeProcessFactory()
    factory.configure("bad", start_error="process exited with code 1 before becoming healthy")
    now = [1000.0]
    d = await dispatchers(make_config("bad", "ok"), process_factory=factory, clock=lambda: now[0])
    t1 = submit(d, "bad", 0, "1")
    behind = submit(d, "ok", 0, "2")
    with pytest.raises(ModelStartError) as error:
        await granted(t1)
    assert error.value.model == "bad" and "code 1" in error.value.cause
    d.finish(t1, Outcome.FAILED, 503)
    await granted(behind)  # everyone else is still served
    d.finish(behind, Outcome.COMPLETED, 200)
    now[0] += 4.9
    cooling = submit(d, "bad", 0, "3")
    with pytest.raises(ModelStartError) as again:
        await granted(cooling)
    assert "code 1" in again.value.cause and cooling.status == 503
    assert factory.journal.count(("start", "bad")) == 1  # no start was tried for it
    now[0] += 0.2  # the cool-down is over: the next request tries the start again
    later = submit(d, "bad", 0, "4")
    with pytest.raises(ModelStartError):
        await granted(later)
    assert factory.journal.count(("start", "bad")) == 2


async def test_no_cool_down_when_it_is_off(dispatchers):
    factory = FakeProcessFactory()
    factory.configure("bad", start_error="exited with code 1")
    d = await dispatchers(make_config("bad"), process_factory=factory)
    d.set_settings(d.settings.with_changes(start_failure_cooldown=0.0))
    for rid in ("1", "2"):
        ticket = submit(d, "bad", 0, rid)
        with pytest.raises(ModelStartError):
            await granted(ticket)
        d.finish(ticket, Outcome.FAILED, 503)
    assert factory.journal.count(("start", "bad")) == 2


async def test_client_gone_while_waiting_is_never_dispatched(world):
    d, factory, rec = await world("m")
    running = submit(d, "m", 0, "running")
    await granted(running)
    gone = submit(d, "m", 100, "gone")
    stays = submit(d, "m", 0, "stays")
    await settle()
    d.cancel(gone)
    d.finish(running, Outcome.COMPLETED, 200)
    await granted(stays)
    assert gone.state is TicketState.DONE and gone.outcome is Outcome.CANCELLED_WAITING
    assert not gone.granted.done()
    assert ("dispatch", "gone") not in rec.events
    assert ("finish", "gone") in rec.events


async def test_client_gone_during_the_load_lets_the_next_request_use_the_model(world):
    factory = FakeProcessFactory()
    factory.configure("m", hold_start=True)
    d, _, rec = await world("m", factory=factory)
    leaver = submit(d, "m", 0, "leaver")
    nxt = submit(d, "m", 0, "next")
    await settle()
    assert leaver.state is TicketState.LOADING
    d.cancel(leaver)
    await settle()
    factory.processes["m"].release()
    await granted(nxt)
    assert leaver.outcome is Outcome.CANCELLED_RUNNING
    assert factory.journal.count(("start", "m")) == 1  # one load served both turns


async def test_a_crash_while_ready_unloads_and_the_next_request_restarts_it(world):
    d, factory, rec = await world("m")
    t1 = submit(d, "m", 0, "1")
    await granted(t1)
    factory.processes["m"].crash(returncode=3)
    d.finish(t1, Outcome.FAILED, 200, "stream broken")
    await rec.wait_state("m", ModelState.STOPPED)
    assert d.running_models() == []
    t2 = submit(d, "m", 0, "2")
    await granted(t2)
    assert factory.journal.count(("start", "m")) == 2


async def test_ttl_unloads_an_idle_model(dispatchers):
    factory = FakeProcessFactory()
    recorder = EventLog()
    config = make_config("m")
    model = dataclasses.replace(config.models["m"], ttl=0.05)
    config = dataclasses.replace(config, models={"m": model})
    d = await dispatchers(config, process_factory=factory, observers=[recorder])
    t = d.submit(model, 0, "1", "/v1/completions")
    await granted(t)
    d.finish(t, Outcome.COMPLETED, 200)
    async with asyncio.timeout(2):
        await recorder.wait_state("m", ModelState.STOPPED)
    assert ("stopped", "m") in factory.journal
    assert d.running_models() == []


async def test_settings_change_reaches_the_next_pick(world):
    d, factory, rec = await world("a", "b", swapAffinityBonus=10)
    t0 = submit(d, "a", 0, "0")
    await granted(t0)
    cold = submit(d, "b", 0, "cold")
    warm = submit(d, "a", 0, "warm")
    await settle()
    # With the bonus, 'warm' would go next; with bonus 0 it is plain arrival order.
    d.set_settings(d.settings.with_changes(swap_affinity_bonus=0), source="admin")
    await settle()
    d.finish(t0, Outcome.COMPLETED, 200)
    await granted(cold)
    assert warm.state is TicketState.WAITING
    assert ("settings", "admin") in rec.events
    assert d.settings_source == "admin"


async def test_fifo_serves_the_ready_model_at_once_and_caps_it(dispatchers):
    # The limit is the config's (the admission rules are built from it, scheduler/rules.py).
    config = make_config("a", "b", use="fifo")
    model_a = dataclasses.replace(config.models["a"], concurrency_limit=2)
    config = dataclasses.replace(config, models={**config.models, "a": model_a})
    d = await dispatchers(config, process_factory=FakeProcessFactory())
    first = d.submit(model_a, 0, "1", "/v1/completions")
    await granted(first)
    second = d.submit(model_a, 0, "2", "/v1/completions")
    await granted(second)  # no waiting for the first to finish
    third = d.submit(model_a, 0, "3", "/v1/completions")
    with pytest.raises(Overloaded):
        await granted(third)
    # A request needing a swap waits; a busy model is never stopped to make room.
    other = submit(d, "b", 100, "b")
    await settle()
    assert other.state is TicketState.WAITING
    d.finish(first, Outcome.COMPLETED, 200)
    await settle()
    assert other.state is TicketState.WAITING
    d.finish(second, Outcome.COMPLETED, 200)
    await granted(other)


async def test_shutdown_fails_waiting_requests_and_stops_models(world):
    d, factory, rec = await world("m")
    running = submit(d, "m", 0, "running")
    await granted(running)
    waiting = submit(d, "m", 0, "waiting")
    await settle()
    stopper = asyncio.create_task(d.stop(grace=5))
    with pytest.raises(ShuttingDown):
        await granted(waiting)
    assert not stopper.done()  # the running request gets its grace period
    d.finish(running, Outcome.COMPLETED, 200)
    async with asyncio.timeout(2):
        await stopper
    assert factory.journal[-1] == ("stopped", "m")
    late = submit(d, "m", 0, "late")
    with pytest.raises(ShuttingDown):
        await granted(late)


async def test_a_second_stop_without_grace_cuts_the_grace_short(world):
    d, factory, rec = await world("m")
    running = submit(d, "m", 0, "running")
    await granted(running)
    patient = asyncio.create_task(d.stop(grace=60))
    await settle()
    assert not patient.done()
    async with asyncio.timeout(2):
        await d.stop(grace=0)  # the second SIGINT
        await patient
    assert factory.journal[-1] == ("stopped", "m")


async def test_observers_see_enqueue_dispatch_finish_with_the_decision(world):
    d, factory, rec = await world("m")
    t = submit(d, "m", 7, "r1")
    await granted(t)
    d.finish(t, Outcome.COMPLETED, 200)
    await settle()
    assert rec.events == [("enqueue", "r1"), ("dispatch", "r1"), ("finish", "r1")]
    assert t.decision.priority == 7 and t.decision.band.value == "normal"
    assert t.load_seconds is not None and t.outcome is Outcome.COMPLETED


async def test_preload_loads_the_model_at_start(dispatchers):
    factory = FakeProcessFactory()
    raw = {
        "models": {"m": {"cmd": "fake", "proxy": "http://127.0.0.1:9000"}},
        "hooks": {"on_startup": {"preload": ["m"]}},
    }
    recorder = EventLog()
    await dispatchers(parse_config(raw), process_factory=factory, observers=[recorder])
    async with asyncio.timeout(2):
        await recorder.wait_state("m", ModelState.READY)
    assert recorder.events == []  # a preload is not a request


def test_settings_validation_is_the_core_one():
    with pytest.raises(ValueError):
        SchedulerSettings.create(swap_affinity_bonus=100)


# -- a turn always ends; a replaced process is gone before its successor starts ---------


def started_after_stopped(journal, old: str, new: str) -> bool:
    """In ``journal``, the last stop of ``old`` completed before the last start of ``new``."""
    stopped = max(i for i, e in enumerate(journal) if e == ("stopped", old))
    started = max(i for i, e in enumerate(journal) if e == ("start", new))
    return stopped < started


@pytest.mark.parametrize("successor", ["other", "same"])
async def test_ttl_unload_is_reaped_before_the_next_start(successor, dispatchers):
    # A slow stop (a big model freeing VRAM) must finish before anything else starts:
    # else two models share the GPU for a moment, or the same one finds its port taken.
    factory = FakeProcessFactory(stop_delay=0.2)
    recorder = EventLog()
    config = make_config("a", "b")
    a = dataclasses.replace(config.models["a"], ttl=0.01)
    config = dataclasses.replace(config, models={**config.models, "a": a})
    d = await dispatchers(config, process_factory=factory, observers=[recorder])
    t = d.submit(a, 0, "1", "/v1/completions")
    await granted(t)
    d.finish(t, Outcome.COMPLETED, 200)
    async with asyncio.timeout(2):
        await recorder.wait_state("a", ModelState.STOPPING)
    name = "a" if successor == "same" else "b"
    nxt = d.submit(config.models[name], 0, "2", "/v1/completions")
    await granted(nxt)
    assert started_after_stopped(factory.journal, "a", name)


async def test_unload_waits_for_the_stop_and_the_next_start_waits_for_it(world):
    d, factory, rec = await world("a", "b", factory=FakeProcessFactory(stop_delay=0.1))
    t = submit(d, "a", 0, "1")
    await granted(t)
    d.finish(t, Outcome.COMPLETED, 200)
    unloading = asyncio.create_task(d.unload())
    await settle()
    nxt = submit(d, "b", 0, "2")
    await granted(nxt)
    await unloading
    assert started_after_stopped(factory.journal, "a", "b")


async def test_unload_during_a_load_unloads_the_model_being_loaded(world):
    factory = FakeProcessFactory()
    factory.configure("m", hold_start=True)
    d, _, rec = await world("m", factory=factory)
    loading = submit(d, "m", 0, "1")
    await settle()
    assert loading.state is TicketState.LOADING
    first = factory.processes["m"]
    async with asyncio.timeout(2):
        await d.unload()
    assert first.state is ModelState.STOPPED
    assert ("ready", "m") not in factory.journal
    # Its request was not failed: it waits for the next start (tests/test_unload_during_load.py).
    await settle()
    assert loading.outcome is None and not loading.granted.done()
    assert factory.processes["m"] is not first
    factory.processes["m"].release()
    await granted(loading)


async def test_a_failed_start_fails_all_its_waiters_at_once_and_others_go_on(world):
    factory = FakeProcessFactory()
    factory.configure("bad", start_error="health check timed out", start_delay=0.05)
    d, _, rec = await world("bad", "ok", factory=factory)
    bad = [submit(d, "bad", 0, f"bad{i}") for i in range(3)]
    ok = submit(d, "ok", -100, "ok")  # lowest priority: picked only after every bad one
    for ticket in bad:
        with pytest.raises(ModelStartError):
            await granted(ticket, timeout=1)
    await granted(ok)
    assert factory.journal.count(("start", "bad")) == 1  # one start for all three
    assert all(t.outcome is Outcome.FAILED and t.status == 503 for t in bad)


async def test_a_load_whose_waiters_all_left_is_abandoned_when_other_work_waits(world):
    factory = FakeProcessFactory()
    factory.configure("big", hold_start=True)
    d, _, rec = await world("big", "small", factory=factory)
    leaver = submit(d, "big", 100, "leaver")
    await settle()
    assert leaver.state is TicketState.LOADING
    other = submit(d, "small", 0, "other")
    await settle()
    d.cancel(leaver)
    await granted(other)  # not held behind a load nobody waits for
    assert ("ready", "big") not in factory.journal
    assert started_after_stopped(factory.journal + [("stopped", "big")], "big", "small") or (
        "start_failed",
        "big",
    ) in factory.journal


async def test_max_queue_depth_refuses_with_429_and_an_estimate(world):
    d, factory, rec = await world("m", maxQueueDepth=2)
    running = submit(d, "m", 0, "running")
    await granted(running)
    waiting = [submit(d, "m", 0, f"w{i}") for i in range(2)]
    refused = submit(d, "m", 100, "refused")
    with pytest.raises(QueueFull) as error:
        await granted(refused)
    assert error.value.status == 429 and error.value.retry_after >= 1
    assert refused.outcome is Outcome.QUEUE_FULL and refused.status == 429
    assert all(t.state is TicketState.WAITING for t in waiting)
    assert ("finish", "refused") in rec.events


async def test_max_wait_expires_a_waiting_request_of_its_band_only(world):
    d, factory, rec = await world("m", maxWait={"batch": 0.05})
    running = submit(d, "m", 0, "running")
    await granted(running)
    batch = submit(d, "m", -100, "batch")
    normal = submit(d, "m", 0, "normal")
    with pytest.raises(WaitExpired) as error:
        await granted(batch, timeout=1)
    assert error.value.status == 503 and error.value.retry_after >= 1
    assert batch.outcome is Outcome.EXPIRED and batch.decision is None
    assert normal.state is TicketState.WAITING
    d.finish(running, Outcome.COMPLETED, 200)
    await granted(normal)


async def test_a_ticket_whose_owner_vanished_is_ended_by_the_dispatcher(world, caplog):
    # The backstop: a request object dropped with its turn open (a bug on some exit
    # path) costs an error line, not the GPU.
    d, factory, rec = await world("m")

    class Owner:
        pass

    owner = Owner()
    lost = d.submit(d.config.models["m"], 0, "lost", "/v1/completions", owner=owner)
    await granted(lost)
    nxt = submit(d, "m", 0, "next")
    await settle()
    assert nxt.state is TicketState.WAITING
    del owner
    await granted(nxt)
    assert lost.outcome is Outcome.FAILED
    assert "turn abandoned" in caplog.text


async def test_a_request_granted_to_a_dead_unreaped_process_is_resent_to_a_restarted_one(world):
    # The model died, but its exit is not reaped yet: the dispatcher still thinks it is
    # ready and grants the next request to it. The view finds the connection refused and
    # asks for a resend: the dead process is reaped, a new one started, the ticket granted.
    d, factory, rec = await world("m")
    t1 = submit(d, "m", 0, "1")
    await granted(t1)
    process = factory.processes["m"]
    process.crash(returncode=-9, reap_delay=0.3)
    assert not process.alive and process.state is ModelState.READY
    d.finish(t1, Outcome.FAILED, 200, "stream broken")
    t2 = submit(d, "m", 0, "2")
    await granted(t2)  # granted to the dead process
    d.resend(t2)
    await granted(t2)
    fresh = factory.processes["m"]
    assert fresh is not process and fresh.alive
    journal = factory.journal
    assert journal.index(("died", "m")) < journal.index(("stopped", "m")) < len(journal) - 2
    assert journal[-2:] == [("start", "m"), ("ready", "m")]
    with pytest.raises(RuntimeError):
        d.resend(t2)  # once only
    d.finish(t2, Outcome.COMPLETED, 200)
    await settle()
    assert d.in_flight() == []


async def test_after_a_broken_answer_the_next_request_waits_for_a_dying_model_to_show_it(world):
    # A model that broke off an answer may be dying: a request sent into its listen backlog
    # now would be reset, and could not be resent. Its exit gets a moment to show.
    d, factory, events = await world("m")
    t1 = submit(d, "m", 0, "1")
    await granted(t1)
    dying = factory.processes["m"]
    dying.crash(returncode=-11, reap_delay=0.2)  # dead; its exit is reported 0.2 s later
    d.finish(t1, Outcome.FAILED, 200, "stream broken")
    d.suspect(t1)
    t2 = submit(d, "m", 0, "2")
    await granted(t2)
    fresh = factory.processes["m"]
    assert fresh is not dying and fresh.alive  # never granted to the dying one
    assert factory.journal.count(("start", "m")) == 2


async def test_after_a_broken_answer_a_live_model_serves_the_next_request(world):
    d, factory, events = await world("m")
    t1 = submit(d, "m", 0, "1")
    await granted(t1)
    d.finish(t1, Outcome.FAILED, 200, "stream broken")
    d.suspect(t1)
    t2 = submit(d, "m", 0, "2")
    await granted(t2, timeout=2)  # after at most SUSPECT_WAIT
    assert factory.journal.count(("start", "m")) == 1
