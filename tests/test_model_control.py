"""The models page's facts and the Load act, and the proxy log, without a server: a real
dispatcher with fake model processes and a clock the test turns."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from dashboard import logs_page, model_control, model_watch, models_page
from dashboard.model_watch import ModelWatch
from scheduler import proxylog
from scheduler.logbuffer import LogBuffer
from scheduler.process import ModelStartError
from scheduler.runtime import Runtime
from scheduler.testing import FakeProcessFactory
from scheduler.tickets import Outcome
from tests.helpers import granted, make_config, until

pytestmark = pytest.mark.timeout(10)

CAUSE = "could not run '/nonexistent/llama-server': No such file or directory"


@pytest.fixture
async def box(dispatchers):
    """A running dispatcher (models ok, with a 60 s ttl, and bad); :func:`_rt` is the
    server's runtime around it, handed to what is tested."""
    factory = FakeProcessFactory()
    factory.configure("bad", start_error=CAUSE)
    now = [1000.0]
    config = make_config("ok", "bad")
    config = dataclasses.replace(
        config, models={**config.models, "ok": dataclasses.replace(config.models["ok"], ttl=60)}
    )
    watch = ModelWatch(wall=lambda: 5.0)
    d = await dispatchers(config, process_factory=factory, clock=lambda: now[0], observers=[watch])
    yield d, factory, now, watch


def _rt(d) -> Runtime:
    return Runtime(config=d.config, dispatcher=d, upstreams=None)  # type: ignore[arg-type]


def _row(d, model: str) -> dict:
    return next(r for r in models_page.model_rows(_rt(d))["models"] if r["id"] == model)


async def test_rows_show_state_slots_load_and_a_failed_start_with_its_cause(box):
    d, _factory, now, watch = box
    ok = d.submit(d.config.models["ok"], 0, "1", "/v1/chat/completions")
    await granted(ok)
    row = _row(d, "ok")
    assert (row["state"], row["running"], row["slots"], row["ready_at"]) == ("ready", 1, 1, 5.0)
    d.finish(ok, Outcome.COMPLETED, 200)
    await until(lambda: _row(d, "ok")["load_seconds"] is not None)  # from the finished request
    await until(lambda: _row(d, "ok")["running"] == 0)

    bad = d.submit(d.config.models["bad"], 0, "2", "/v1/chat/completions")
    with pytest.raises(ModelStartError):
        await granted(bad)
    row = _row(d, "bad")
    assert row["state"] == "failed" and row["failure"] == CAUSE  # while it cools down
    await until(lambda: watch.facts.get("bad") is not None)  # the observers are told after
    now[0] += 10  # past startFailureCooldown (5 s): stopped, the cause kept as the last one
    row = _row(d, "bad")
    assert row["state"] == "stopped" and row["failure"] == CAUSE


async def test_idle_and_ttl_left_count_from_the_end_of_the_last_request(box):
    d, _factory, now, _watch = box
    ok = d.submit(d.config.models["ok"], 0, "1", "/v1/chat/completions")
    await granted(ok)
    assert "ok" not in d.model_timers()  # running: not idle
    d.finish(ok, Outcome.COMPLETED, 200)
    await until(lambda: "ok" in d.model_timers())
    now[0] += 15
    idle, ttl_left, cause = d.model_timers()["ok"]
    assert (round(idle), round(ttl_left), cause) == (15, 45, None)
    assert (_row(d, "ok")["idle_seconds"], _row(d, "ok")["ttl_left"]) == (15.0, 45.0)


async def test_load_retries_during_the_cool_down_and_says_why(box):
    d, factory, _now, watch = box
    rt = _rt(d)
    assert await model_control.load(rt, "ok", "test") is None
    assert watch.facts["ok"].load_seconds is not None and _row(d, "ok")["state"] == "ready"
    assert await model_control.load(rt, "bad", "test") == CAUSE
    assert await model_control.load(rt, "bad", "test") == CAUSE  # cooling down: tried anyway
    assert factory.journal.count(("start", "bad")) == 2
    assert watch.facts["bad"].failure == CAUSE
    with pytest.raises(model_control.UnknownModel):
        await model_control.load(rt, "nope", "test")


def test_the_watch_is_bounded():
    watch = ModelWatch()
    for i in range(model_watch.MAX_MODELS + 10):
        watch.failed(f"m{i}", "x")
    assert len(watch.facts) == model_watch.MAX_MODELS
    assert "m0" not in watch.facts and f"m{model_watch.MAX_MODELS + 9}" in watch.facts


def test_proxy_lines_are_stamped_kept_by_model_and_fed_in_order(box):
    buffer = LogBuffer(4096, prefixed=False)
    proxylog.install(buffer)
    proxylog.install(buffer)  # once
    logger = logging.getLogger("llamaswap.test")
    try:
        logger.warning("model failed to start", extra={"model": "bad", "cause": "no\nbinary"})
        logging.getLogger("scheduler.test").info("spawned")
    finally:
        for name in proxylog.LOGGERS:
            for h in [
                h for h in logging.getLogger(name).handlers if getattr(h, "buffer", None) is buffer
            ]:
                logging.getLogger(name).removeHandler(h)
    (_, _, model, line), (_, _, other, spawned) = buffer.since(0)
    assert (model, other) == ("bad", "") and spawned.endswith(b"[info] spawned\n")
    text = line.decode()
    assert text.endswith("[warn] model failed to start model=bad cause=no binary\n"), text
    assert buffer.history(None) == b"".join(e[3] for e in buffer.since(0))  # unprefixed


def test_the_logs_feed_merges_both_buffers_in_order_and_is_bounded(box):
    d, *_ = box
    d.logs.write("ok", b"model says hi")
    proxylog.proxy_log.write("ok", b"2026-12-02T07:30:01.123Z [error] it broke x=1")
    d.logs.write("ok", b"model says bye")
    out = logs_page.feed(d.logs, 0)
    tail = [(line["source"], line["level"], line["text"]) for line in out["lines"][-3:]]
    assert tail == [
        ("upstream", "output", "model says hi"),
        ("proxy", "error", "it broke x=1"),
        ("upstream", "output", "model says bye"),
    ]
    assert logs_page.feed(d.logs, out["last"])["lines"] == []
    assert len(logs_page.feed(d.logs, 0, limit=2)["lines"]) == 2
