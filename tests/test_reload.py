"""Config reload without losing the queue, in the dispatcher (in-memory model processes).

The real-process version (SIGHUP and --watch-config on the real server, the same process
id for an unchanged model) is in tests/test_e2e_reload.py.
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


def config(models: dict[str, Any], lanes: dict[str, list[str]] | None = None, **serial: Any):
    raw: dict[str, Any] = {
        "models": {m: {"cmd": "fake", **keys} for m, keys in models.items()},
        "routing": {"scheduler": {"settings": {"serial": {**serial, **({"lanes": lanes} if lanes else {})}}}},
    }
    return parse_config(raw)


def port(n: int) -> dict[str, str]:
    return {"proxy": f"http://127.0.0.1:{n}"}


@pytest.fixture
async def world(dispatchers):
    async def build(cfg):
        factory = FakeProcessFactory()
        d = await dispatchers(cfg, process_factory=factory)
        return d, factory

    return build


def submit(d, model, priority, rid):
    return d.submit(d.config.models[model], priority, rid, "/v1/chat/completions")


async def test_nothing_waiting_or_running_is_lost_and_unchanged_models_keep_their_process(world):
    d, factory = await world(config({"a": port(9000), "b": port(9001)}))
    running = submit(d, "a", 0, "running")
    await granted(running)
    waiting = [submit(d, m, p, f"w{i}") for i, (m, p) in enumerate([("a", 0), ("b", 100), ("a", -100)])]
    await settle()
    report = await d.reload(config({"a": port(9000), "b": port(9001), "c": port(9002)}, agingDivisor=30))
    assert report.added == ("c",) and report.kept == ("a", "b") and not report.changed
    assert running.state is TicketState.RUNNING and [t.state for t in waiting] == [TicketState.WAITING] * 3
    assert d.settings.aging_divisor == 30
    d.finish(running, Outcome.COMPLETED, 200)
    served = []
    for _ in waiting:
        await until(lambda: any(t.state is TicketState.RUNNING for t in waiting))
        current = next(t for t in waiting if t.state is TicketState.RUNNING)
        await granted(current)
        served.append(current.request_id)
        d.finish(current, Outcome.COMPLETED, 200)
        await settle()
    assert served == ["w1", "w0", "w2"]  # the same order as without the reload
    assert factory.journal.count(("start", "a")) == 2  # a, then b swapped in, then a again


async def test_a_loaded_unchanged_model_is_not_restarted(world):
    d, factory = await world(config({"a": port(9000)}))
    t = submit(d, "a", 0, "t")
    await granted(t)
    d.finish(t, Outcome.COMPLETED, 200)
    await d.reload(config({"a": port(9000), "b": port(9001)}))
    again = submit(d, "a", 0, "again")
    await granted(again)
    assert factory.journal.count(("start", "a")) == 1 and ("stop", "a") not in factory.journal


async def test_a_changed_model_finishes_its_request_then_restarts_with_its_new_definition(world):
    d, factory = await world(config({"a": port(9000)}))
    running = submit(d, "a", 0, "running")
    assert await granted(running) == "http://127.0.0.1:9000"
    waiting = submit(d, "a", 0, "waiting")
    await settle()
    report = await d.reload(config({"a": port(9100)}))
    assert report.changed == ("a",)
    await settle()
    assert ("stop", "a") not in factory.journal  # never stopped under a running request
    d.finish(running, Outcome.COMPLETED, 200)
    assert await granted(waiting) == "http://127.0.0.1:9100"
    journal = factory.journal
    assert journal.index(("stopped", "a")) < len(journal) - 1 - journal[::-1].index(("start", "a"))
    assert waiting.model.proxy == "http://127.0.0.1:9100"


async def test_a_removed_model_serves_what_it_had_waiting_then_stops(world):
    d, factory = await world(config({"a": port(9000), "gone": port(9001)}))
    running = submit(d, "gone", 0, "running")
    await granted(running)
    waiting = submit(d, "gone", 0, "waiting")
    await settle()
    report = await d.reload(config({"a": port(9000)}))
    assert report.removed == ("gone",)
    d.finish(running, Outcome.COMPLETED, 200)
    await granted(waiting)  # served by the model it asked for
    assert ("stop", "gone") not in factory.journal
    d.finish(waiting, Outcome.COMPLETED, 200)
    await until(lambda: ("stopped", "gone") in factory.journal)
    assert "gone" not in d.model_states()


async def test_a_model_moved_to_another_lane_moves_once_idle(world):
    d, factory = await world(config({"a": port(9000), "b": port(9001)}))
    t = submit(d, "a", 0, "t")
    await granted(t)
    d.finish(t, Outcome.COMPLETED, 200)
    await d.reload(config({"a": port(9000), "b": port(9001)}, lanes={"gpu1": ["a"]}))
    await until(lambda: "a" not in d.model_states())  # idle: stopped at once
    ta, tb = submit(d, "a", 0, "ta"), submit(d, "b", 0, "tb")
    await granted(ta)
    await granted(tb)  # a on gpu1 and b on the default lane, at once
    assert ta.lane == "gpu1" and tb.lane == "default"
    assert d.model_states() == {"a": ModelState.READY, "b": ModelState.READY}


async def test_a_reload_during_a_load_moves_or_removes_the_loading_model_cleanly(dispatchers):
    factory = FakeProcessFactory()
    factory.configure("a", hold_start=True)
    d = await dispatchers(config({"a": port(9000), "b": port(9001)}), process_factory=factory)
    loading = submit(d, "a", 0, "loading")
    waiting = submit(d, "b", 0, "waiting")
    await until(lambda: "a" in factory.processes)
    # a moves to gpu1 while it loads on the default lane; b is removed while it waits.
    report = await d.reload(config({"a": port(9000)}, lanes={"gpu1": ["a"]}))
    assert report.removed == ("b",) and report.changed == ("a",)
    factory.configure("a", hold_start=False)
    await granted(loading)  # the load it waited for completes and serves it
    d.finish(loading, Outcome.COMPLETED, 200)
    await granted(waiting)  # the removed model still serves what it had waiting
    d.finish(waiting, Outcome.COMPLETED, 200)
    await until(lambda: not d.model_states())  # both stopped once idle: nothing left
    again = submit(d, "a", 0, "again")
    await granted(again)  # a starts afresh on its new lane
    assert again.lane == "gpu1" and d.model_states() == {"a": ModelState.READY}
    assert factory.journal.count(("start", "a")) == 2
    d.finish(again, Outcome.COMPLETED, 200)
