"""Several GPUs and resident groups: lanes, slots and llama-swap's routers in the dispatcher.

Over in-memory model processes (``scheduler.testing``'s fakes, whose starts, stops and
crashes behave like real ones where the races live); the real-process versions of the
main claims are in ``tests/test_e2e_lanes.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from scheduler.config import parse_config
from scheduler.dispatcher import Outcome, TicketState
from scheduler.process import ModelState
from scheduler.testing import FakeProcessFactory
from tests.helpers import granted, settle, until

pytestmark = pytest.mark.timeout(10)


def config(
    *models: str,
    lanes: dict[str, list[str]] | None = None,
    groups: dict[str, dict[str, Any]] | None = None,
    slots: dict[str, int] | None = None,
    use: str = "serial",
    **serial: Any,
):
    raw: dict[str, Any] = {
        "models": {
            m: {"cmd": "fake", "proxy": f"http://127.0.0.1:{9000 + i}", **({"slots": slots[m]} if slots and m in slots else {})}
            for i, m in enumerate(models)
        },
        "routing": {
            "scheduler": {
                "use": use,
                "settings": {"serial": {**serial, **({"lanes": lanes} if lanes else {})}},
            }
        },
    }
    if groups is not None:
        raw["routing"]["router"] = {"use": "group", "settings": {"groups": groups}}
    return parse_config(raw)


@pytest.fixture
async def world(dispatchers):
    async def build(cfg, factory=None):
        factory = factory or FakeProcessFactory()
        d = await dispatchers(cfg, process_factory=factory)
        return d, factory

    return build


def submit(d, model, priority, rid):
    return d.submit(d.config.models[model], priority, rid, "/v1/chat/completions")


def states(tickets):
    return {t.request_id: t.state.value for t in tickets}


async def test_two_lanes_serve_at_once(world):
    d, factory = await world(config("a", "b", lanes={"gpu0": ["a"], "gpu1": ["b"]}))
    ta, tb = submit(d, "a", 0, "ta"), submit(d, "b", -100, "tb")
    await granted(ta)
    await granted(tb)  # a batch request on gpu1 does not wait for gpu0's request
    assert ta.lane == "gpu0" and tb.lane == "gpu1"
    assert d.model_states() == {"a": ModelState.READY, "b": ModelState.READY}
    assert ("stop", "a") not in factory.journal and ("stop", "b") not in factory.journal
    assert {v.name: len(v.running) for v in d.lanes()} == {"gpu0": 1, "gpu1": 1}


async def test_one_lane_still_serialises_its_models(world):
    d, factory = await world(config("a", "c", "b", lanes={"gpu0": ["a", "c"], "gpu1": ["b"]}))
    ta = submit(d, "a", 0, "ta")
    await granted(ta)
    tc, tb = submit(d, "c", 100, "tc"), submit(d, "b", 0, "tb")
    await granted(tb)
    await settle()
    assert tc.state is TicketState.WAITING  # gpu0 is busy with ta, whatever tc's priority
    d.finish(ta, Outcome.COMPLETED, 200)
    await granted(tc)
    # c replaced a on gpu0 (stopped before it started); b on gpu1 never moved.
    journal = factory.journal
    assert journal.index(("stopped", "a")) < journal.index(("start", "c"))
    assert ("stop", "b") not in journal


async def test_a_model_on_no_named_lane_is_on_the_default_lane(world):
    d, _ = await world(config("a", "x", lanes={"gpu0": ["a"]}))
    tx = submit(d, "x", 0, "tx")
    await granted(tx)
    assert tx.lane == "default"
    assert d.running_models() == [{"model": "x", "state": "ready", "lane": "default"}]


async def test_slots_run_requests_of_the_loaded_model_together(world):
    d, factory = await world(config("m", "n", slots={"m": 3}))
    tickets = [submit(d, "m", 0, f"m{i}") for i in range(4)]
    await settle()
    for t in tickets[:3]:
        await granted(t)
    assert tickets[3].state is TicketState.WAITING  # three slots, three at once
    d.finish(tickets[0], Outcome.COMPLETED, 200)
    await granted(tickets[3])
    assert factory.journal.count(("start", "m")) == 1


async def test_slots_drain_before_a_swap_when_another_model_is_next(world):
    d, factory = await world(config("m", "n", slots={"m": 4}))
    first = submit(d, "m", 0, "first")
    await granted(first)
    urgent = submit(d, "n", 100, "urgent")
    late = submit(d, "m", 0, "late")
    await settle()
    # A slot is free, but the lane's best waiting request is for n: m admits no more.
    assert late.state is TicketState.WAITING and urgent.state is TicketState.WAITING
    d.finish(first, Outcome.COMPLETED, 200)
    await granted(urgent)  # drained, then swapped
    assert late.state is TicketState.WAITING
    d.finish(urgent, Outcome.COMPLETED, 200)
    await granted(late)


async def test_slots_are_joined_while_the_model_loads(world):
    factory = FakeProcessFactory(hold_start=True)
    d, factory = await world(config("m", slots={"m": 2}), factory)
    one, two, three = (submit(d, "m", 0, rid) for rid in ("one", "two", "three"))
    await until(lambda: "m" in factory.processes)
    await settle()
    assert states([one, two, three]) == {"one": "loading", "two": "loading", "three": "waiting"}
    factory.configure("m", hold_start=False)
    await granted(one)
    await granted(two)
    assert factory.journal.count(("start", "m")) == 1


async def test_a_non_swapping_group_keeps_its_members_resident(world):
    cfg = config("chat", "embed", groups={"both": {"swap": False, "members": ["chat", "embed"]}})
    d, factory = await world(cfg)
    for model in ("chat", "embed", "chat", "embed"):
        t = submit(d, model, 0, f"{model}-{len(factory.journal)}")
        await granted(t)
        d.finish(t, Outcome.COMPLETED, 200)
        await settle()
    assert factory.journal.count(("start", "chat")) == 1
    assert factory.journal.count(("start", "embed")) == 1
    assert not any(action == "stop" for action, _ in factory.journal)
    # Affinity covers both residents: neither needs a swap any more.
    t = submit(d, "embed", 0, "last")
    await granted(t)
    assert t.decision is not None and not t.decision.needs_swap


async def test_a_persistent_group_is_never_evicted(world):
    cfg = config(
        "embed",
        "a",
        "b",
        groups={
            "always": {"persistent": True, "swap": False, "exclusive": False, "members": ["embed"]},
            "chat": {"swap": True, "exclusive": True, "members": ["a", "b"]},
        },
    )
    d, factory = await world(cfg)
    for model in ("embed", "a", "b", "a", "embed"):
        t = submit(d, model, 0, f"{model}-{len(factory.journal)}")
        await granted(t)
        d.finish(t, Outcome.COMPLETED, 200)
        await settle()
    assert ("stop", "embed") not in factory.journal
    assert factory.journal.count(("start", "embed")) == 1
    assert factory.journal.count(("stop", "a")) == 1  # swapped out by b, then back


async def test_a_crash_on_one_lane_does_not_disturb_the_other(world):
    d, factory = await world(config("a", "b", lanes={"gpu0": ["a"], "gpu1": ["b"]}))
    ta, tb = submit(d, "a", 0, "ta"), submit(d, "b", 0, "tb")
    await granted(ta)
    await granted(tb)
    factory.processes["a"].crash()
    d.finish(ta, Outcome.FAILED, 502)
    await until(lambda: "a" not in d.model_states())
    assert tb.state is TicketState.RUNNING and d.model_states()["b"] is ModelState.READY
    again = submit(d, "a", 0, "again")
    await granted(again)  # a restarts on gpu0
    assert factory.journal.count(("start", "a")) == 2
    assert ("stop", "b") not in factory.journal
    d.finish(tb, Outcome.COMPLETED, 200)
    d.finish(again, Outcome.COMPLETED, 200)


async def test_fifo_runs_members_of_a_non_swapping_group_at_once(world):
    cfg = config("chat", "embed", use="fifo", groups={"both": {"swap": False, "members": ["chat", "embed"]}})
    d, factory = await world(cfg)
    tc, te = submit(d, "chat", 0, "tc"), submit(d, "embed", 0, "te")
    await granted(tc)
    await granted(te)
    assert tc.state is TicketState.RUNNING and te.state is TicketState.RUNNING
    assert not any(action == "stop" for action, _ in factory.journal)


async def test_fifo_swaps_only_once_the_models_it_evicts_are_idle(world):
    d, factory = await world(config("a", "b", use="fifo"))
    ta = submit(d, "a", 0, "ta")
    await granted(ta)
    tb = submit(d, "b", 0, "tb")
    await settle()
    assert tb.state is TicketState.WAITING and ("stop", "a") not in factory.journal
    d.finish(ta, Outcome.COMPLETED, 200)
    await granted(tb)


async def test_unload_of_one_lane_leaves_the_other_loaded(world):
    d, factory = await world(config("a", "b", lanes={"gpu0": ["a"], "gpu1": ["b"]}))
    for model in ("a", "b"):
        t = submit(d, model, 0, model)
        await granted(t)
        d.finish(t, Outcome.COMPLETED, 200)
    await d.unload(["a"])
    assert d.model_states() == {"b": ModelState.READY}


async def test_the_queue_api_metrics_and_records_show_each_requests_lane():
    import json

    from activity.metrics import export
    from activity.rows import record_fields
    from tests.asgi import Call, Gate, in_process

    gate = Gate()
    cfg = config("m", "n", "x", lanes={"gpu0": ["m", "n"], "gpu1": ["x"]})

    def chat(model):
        return json.dumps({"model": model, "messages": [{"role": "user", "content": model}]}).encode()

    async with in_process(cfg, transport=gate) as world:
        running = Call(world.app, "/v1/chat/completions", chat("m"))
        await until(lambda: len(world.dispatcher.in_flight()) == 1)
        waiting = Call(world.app, "/v1/chat/completions", chat("n"))
        other = Call(world.app, "/v1/chat/completions", chat("x"))
        await until(lambda: len(world.dispatcher.in_flight()) == 2 and len(world.dispatcher.queue) == 1)
        api = Call(world.app, "/api/queue", b"", method="GET")
        await api.done()
        state = json.loads(api.body)
        assert [(w["model"], w["lane"], w["position"]) for w in state["waiting"]] == [("n", "gpu0", 1)]
        # Nothing measured yet: m's running job is assumed to take the default 30 s.
        assert 0 < state["waiting"][0]["estimated_wait_seconds"] <= 30
        assert sorted((r["model"], r["lane"]) for r in state["running"]) == [("m", "gpu0"), ("x", "gpu1")]
        assert {lane["lane"]: (lane["running"], lane["waiting"]) for lane in state["lanes"]} == {
            "gpu0": (1, 1),
            "gpu1": (1, 0),
        }
        metrics = export().decode()
        assert 'llamaswap_lane_queue_depth{band="normal",lane="gpu0"} 1.0' in metrics
        assert 'llamaswap_lane_running{lane="gpu1"} 1.0' in metrics
        ticket = next(t for t in world.dispatcher.in_flight() if t.model.id == "x")
        assert record_fields(ticket, world.dispatcher.settings, world.dispatcher.now())["lane"] == "gpu1"
        gate.open.set()
        for call in (running, waiting, other):
            await call.done()
            assert call.status == 200


async def test_the_matrix_router_keeps_a_set_together_and_evicts_the_cheapest_way(world):
    raw = {
        "models": {m: {"cmd": "fake", "proxy": f"http://127.0.0.1:{9000 + i}"} for i, m in enumerate("abc")},
        "routing": {
            "router": {
                "use": "matrix",
                "settings": {"matrix": {"evict_costs": {"a": 5}, "sets": {"pair": "a & b", "alt": "a & c"}}},
            }
        },
    }
    d, factory = await world(parse_config(raw))
    for model in ("a", "b", "c"):
        t = submit(d, model, 0, model)
        await granted(t)
        d.finish(t, Outcome.COMPLETED, 200)
        await settle()
    # a and b ran side by side (set "pair"); c's only set is "alt" (a & c): b goes, a stays.
    assert d.model_states() == {"a": ModelState.READY, "c": ModelState.READY}
    assert ("stop", "a") not in factory.journal and ("stop", "b") in factory.journal
