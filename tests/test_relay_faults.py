"""Every turn ends, whatever happens: faults injected at every await point of a request's life.

The real ASGI application (the lean proxy handler, the views, the relay, the dispatcher
task) runs in-process; the model process is the in-memory fake and the model's HTTP server
an httpx transport that stops at each await point a request passes (connecting, headers,
each chunk, closing) until the test has injected its fault there. For every point and
every fault, a user would notice three things, and the test asserts them: the next request
is served within a second, the request's record shows the outcome its client saw, and the
dispatcher is idle afterwards (nothing waiting, nothing in flight).

tests/test_e2e_proxy.py backs these fakes with real processes and sockets (a crash
mid-stream, a disconnect while streaming, a disconnect while queued).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from proxy.turn import Turn
from scheduler.config import parse_config
from scheduler.dispatch_state import ANNOUNCE_AFTER
from scheduler.dispatcher import Dispatcher, Outcome
from tests.asgi import Call, in_process

pytestmark = pytest.mark.timeout(20)

POINTS = ("queued", "loading", "connecting", "headers", "chunk", "closing", "after")
FAULTS = ("disconnect", "cancel", "exception", "reset")


class Upstream(httpx.AsyncBaseTransport):
    """The model's HTTP server. ``hold`` names the point where the next request stops until
    :meth:`release`; ``fault`` is raised there on release (``"exception"``: a bug,
    ``"reset"``: the connection reset by the model)."""

    def __init__(self) -> None:
        self.hold: str | None = None
        self.fault: str | None = None
        self.reached = asyncio.Event()
        self._release = asyncio.Event()
        self.requests = 0
        self.targets: list[bytes] = []

    def release(self) -> None:
        self._release.set()

    async def point(self, name: str) -> None:
        if self.hold != name:
            return
        self.hold = None  # one request only
        self.reached.set()
        await self._release.wait()
        fault, self.fault = self.fault, None
        if fault == "exception":
            raise RuntimeError(f"injected at {name}")
        if fault == "reset":
            raise httpx.ReadError(f"connection reset at {name}")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        self.targets.append(request.url.raw_path)
        await self.point("connecting")
        stream = json.loads(request.content or b"{}").get("stream", False)
        if stream:
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, stream=_Body(self, True)
            )
        return httpx.Response(
            200, headers={"content-type": "application/json"}, stream=_Body(self, False)
        )


class _Body(httpx.AsyncByteStream):
    def __init__(self, upstream: Upstream, stream: bool) -> None:
        self.upstream = upstream
        self.stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await self.upstream.point("headers")
        if self.stream:
            for i in range(3):
                yield f'data: {{"n": {i}}}\n\n'.encode()
                if i == 1:
                    await self.upstream.point("chunk")
            yield b"data: [DONE]\n\n"
        else:
            yield b'{"choices": '
            await self.upstream.point("chunk")
            yield b'[], "usage": {"total_tokens": 3}}'

    async def aclose(self) -> None:
        await self.upstream.point("closing")


def chat(stream: bool) -> bytes:
    return json.dumps({"model": "m", "stream": stream, "messages": []}).encode()


SHAPES = {
    "one lane": {"models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}}},
    # The same, with m on a named lane of two.
    "named lane": {
        "models": {
            "m": {"cmd": "fake", "proxy": "http://model.invalid:9000"},
            "other": {"cmd": "fake", "proxy": "http://model.invalid:9001"},
        },
        "routing": {
            "scheduler": {"settings": {"serial": {"lanes": {"gpu1": ["m"], "gpu0": ["other"]}}}}
        },
    },
    # m served with two slots (a second request would run beside the first, so there is
    # no "queued" point behind one blocker: see test_with_slots_a_fault_ends_the_turn).
    "2 slots": {"models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000", "slots": 2}}},
}


@pytest.fixture
async def proxy(request):
    config = parse_config(SHAPES[getattr(request, "param", "one lane")])
    upstream = Upstream()
    async with in_process(config, transport=upstream) as world:
        world.upstream = upstream
        yield world


async def idle(dispatcher: Dispatcher) -> None:
    for _ in range(20):
        await asyncio.sleep(0)
        if not dispatcher.in_flight() and not len(dispatcher.queue):
            for _ in range(ANNOUNCE_AFTER):  # the observers' deferred on_finish (the recorder)
                await asyncio.sleep(0)
            return
    raise AssertionError(f"dispatcher not idle: {dispatcher.in_flight()} {len(dispatcher.queue)}")


def expected(point: str, fault: str) -> Outcome:
    """What the record of the faulted request must say."""
    if point == "after":
        return Outcome.COMPLETED  # it had been answered in full
    if fault in ("disconnect", "cancel"):
        return Outcome.CANCELLED_WAITING if point == "queued" else Outcome.CANCELLED_RUNNING
    return Outcome.FAILED


CASES = [
    (point, fault, stream)
    for point in POINTS
    for fault in FAULTS
    for stream in (True, False)
    # A reset is the model's: it can happen only where the model is talking.
    if not (fault == "reset" and point in ("queued", "loading", "after"))
]


@pytest.mark.parametrize("proxy", ["one lane", "named lane"], indirect=True)
@pytest.mark.parametrize(("point", "fault", "stream"), CASES)
async def test_a_fault_at_any_point_ends_the_turn(proxy, monkeypatch, point, fault, stream):
    await fault_ends_the_turn(proxy, monkeypatch, point, fault, stream)


@pytest.mark.parametrize("proxy", ["2 slots"], indirect=True)
@pytest.mark.parametrize(("point", "fault", "stream"), [c for c in CASES if c[0] != "queued"])
async def test_with_slots_a_fault_ends_the_turn(proxy, monkeypatch, point, fault, stream):
    await fault_ends_the_turn(proxy, monkeypatch, point, fault, stream)


async def fault_ends_the_turn(proxy, monkeypatch, point, fault, stream):
    upstream, dispatcher, factory = proxy.upstream, proxy.dispatcher, proxy.factory
    blocker = None
    if point == "queued":
        # Someone else is being served; the victim waits in the queue behind them.
        upstream.hold = "connecting"
        blocker = Call(proxy.app, "/v1/chat/completions", chat(False))
        async with asyncio.timeout(2):
            await upstream.reached.wait()
        if fault == "exception":
            gate = asyncio.Event()

            async def broken_wait(self):
                gate.set()
                raise RuntimeError("injected while queued")

            monkeypatch.setattr(Turn, "wait", broken_wait)
    elif point == "loading":
        factory.configure(
            "m", hold_start=True, start_error="injected" if fault == "exception" else None
        )
        # Without this, startFailureCooldown would answer the next request with the
        # start's failure for 5 s (tests/test_admission.py); here it must start again.
        dispatcher.set_settings(dispatcher.settings.with_changes(start_failure_cooldown=0.0))
    elif point != "after":
        upstream.hold = point
        upstream.fault = fault if fault in ("exception", "reset") else None

    victim = Call(proxy.app, "/v1/chat/completions", chat(stream))

    # Let the victim reach the point.
    async with asyncio.timeout(2):
        if point == "queued":
            while not len(dispatcher.queue) and not victim.task.done():
                await asyncio.sleep(0)
        elif point == "loading":
            while not dispatcher.in_flight():
                await asyncio.sleep(0)
            await asyncio.sleep(0)
        elif point == "after":
            await victim.complete.wait()
        else:
            await upstream.reached.wait()

    # Inject the fault; a client that leaves is noticed where the request stands.
    if fault == "disconnect":
        victim.disconnect.set()
        await victim.done()
    elif fault == "cancel":
        victim.task.cancel()  # the server gives up on the request (daphne's timeout)
        await victim.done()
    if point == "loading":
        factory.processes["m"].release()
    elif point not in ("queued", "after"):
        upstream.release()
    await victim.done()
    if blocker is not None:
        monkeypatch.undo()
        upstream.release()
        await blocker.done()
    factory.configure("m", hold_start=False, start_error=None)

    # The next request is served, at once.
    nxt = Call(proxy.app, "/v1/chat/completions", chat(stream))
    async with asyncio.timeout(1):
        await nxt.task
    assert nxt.status == 200, nxt.body
    await idle(dispatcher)
    # The record of the faulted request says what its client saw.
    outcomes = {rid: o for rid, o in proxy.recorder.finished.items() if rid != nxt.request_id}
    if blocker is not None:
        outcomes.pop(blocker.request_id)
    assert list(outcomes.values()) == [expected(point, fault)], outcomes
    if victim.status not in (None, 200):
        assert "error" in json.loads(victim.body)  # an OpenAI-shaped error, not an HTML page


async def test_a_malformed_upstream_url_is_refused_before_it_takes_a_turn(proxy):
    # Clients cannot send a raw control character through Twisted; an ASGI server that
    # lets one through must not cost anybody the GPU.
    call = Call(proxy.app, "/upstream/m/\x01", b"", method="GET")
    await call.done()
    assert call.status == 400, call.body
    assert json.loads(call.body)["error"]["code"] == "invalid_path"
    nxt = Call(proxy.app, "/v1/chat/completions", chat(False))
    async with asyncio.timeout(1):
        await nxt.task
    assert nxt.status == 200
    await idle(proxy.dispatcher)
    assert list(proxy.recorder.finished) == [nxt.request_id]  # never queued


ALL_PATHS = {"models": {"m": {"cmd": "x", "proxy": "http://m"}}, "upstream": {"allowPaths": [""]}}


@pytest.mark.parametrize(
    "sent",
    [b"/a%3Fb?q=1", b"/x%23y", b"/a%2Fb/c", b"/100%25", b"/v1/models", b"/"],
)
async def test_upstream_passthrough_sends_the_path_as_the_client_wrote_it(proxy, sent):
    from dataclasses import replace

    from scheduler import runtime

    rt = runtime.current()  # every path allowed: the encoding is what is tested here
    rt.config = replace(
        rt.config, upstream_allow_paths=parse_config(ALL_PATHS).upstream_allow_paths
    )
    call = Call(proxy.app, "/upstream/m" + sent.decode(), b"", method="GET")
    await call.done()
    assert call.status == 200
    assert proxy.upstream.targets == [sent]
