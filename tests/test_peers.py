"""peers through the real ASGI app in-process, against a second server on loopback.

The peer is the simulated model server (fakellm), which records every request with its
headers; one test uses a second real llamaswap (``llamaswap serve``) as the peer and shows
it queues the forwarded request at the priority the client asked of this one.
"""

from __future__ import annotations

import asyncio
import json
import time
import types

import httpx
import pytest

from activity.models import RequestRecord
from activity.recorder import Recorder
from proxy import peers
from scheduler.config import parse_config
from scheduler.dispatcher import Outcome
from scheduler.keys import ApiKey, KeyPolicy, KeyRing
from tests.asgi import Call, FinishLog, in_process
from tests.server import chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(60)


def config(peer_url: str, local_url: str = "http://127.0.0.1:1", **peer) -> object:
    return parse_config(
        {
            "models": {"local": {"cmd": "fake", "proxy": local_url}},
            "peers": {
                "remote": {
                    "proxy": peer_url,
                    "apiKey": "sk-peer-secret",
                    "models": ["qwen-remote", "shared"],
                    "filters": {
                        "stripParams": "top_k",
                        "setParams": {"seed": 7},
                        "setParamsByID": {"remote/qwen-remote": {"effort": "high"}},
                    },
                    **peer,
                },
                "open": {"proxy": peer_url + "/base", "models": ["shared", "plain"]},
            },
            "selectors": {"overflow": {"strategy": "spillover", "targets": ["local", "plain"]}},
        }
    )


def received(url: str) -> list[dict]:
    return httpx.get(url + "/fake/requests", timeout=5).json()


async def post(world, model: str, headers=(), timeout: float = 10, **extra) -> Call:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})
    call = Call(world.app, "/v1/chat/completions", body.encode(), headers=list(headers))
    await call.done(timeout)
    return call


async def record_of(world, call: Call):
    for _ in range(300):
        ticket = world.recorder.tickets.get(call.request_id)
        if ticket is not None:
            return ticket
        await asyncio.sleep(0.01)
    raise AssertionError("no record")


async def test_a_peer_model_is_forwarded_with_its_key_and_the_priority(fakellm):
    peer = await fakellm()
    async with in_process(config(peer.url)) as world:
        call = await post(
            world,
            "remote/qwen-remote",
            [(b"x-llamaswap-priority", b"interactive")],
            top_k=40,
            max_tokens=3,
        )
        assert call.status == 200, call.body
        assert json.loads(call.body)["object"] == "chat.completion"
        assert call.headers[b"x-llamaswap-request-id"]
        sent = received(peer.url)[-1]
        assert sent["path"] == "/v1/chat/completions"
        assert sent["body"]["model"] == "qwen-remote"  # the peer's own name
        assert sent["body"]["seed"] == 7 and sent["body"]["effort"] == "high"
        assert "top_k" not in sent["body"]
        headers = sent["headers"]
        assert headers["authorization"] == "Bearer sk-peer-secret"
        assert headers["x-api-key"] == "sk-peer-secret"
        assert headers["x-llamaswap-priority"] == "100"

        ticket = await record_of(world, call)
        assert ticket.outcome is Outcome.COMPLETED and ticket.status == 200
        assert ticket.model.id == "remote/qwen-remote" and ticket.extra["peer"] == "remote"
        assert ticket.priority == 100 and ticket.decision is None
        assert ticket.extra["usage"]["completion_tokens"] == 3


async def test_a_bare_name_goes_to_the_one_peer_that_has_it(fakellm):
    peer = await fakellm()
    async with in_process(config(peer.url)) as world:
        call = await post(world, "qwen-remote")
        assert call.status == 200
        sent = received(peer.url)[-1]
        assert sent["body"]["model"] == "qwen-remote"
        assert "effort" not in sent["body"]  # setParamsByID keyed by the full name only
        assert sent["headers"]["x-llamaswap-priority"] == "0"
        assert (await record_of(world, call)).extra["requested_model"] == "qwen-remote"
        # Two peers list "shared": only the full names work.
        assert (await post(world, "shared")).status == 404
        call = await post(world, "open/shared")
        assert call.status == 200
        sent = received(peer.url)[-1]
        assert sent["path"] == "/base/v1/chat/completions"  # the peer's base path is kept
        assert "authorization" not in sent["headers"]  # no apiKey: none added


async def test_the_clients_key_is_never_passed_on_and_the_keys_rule_applies(fakellm):
    peer = await fakellm()
    ring = KeyRing({"sk-client": ApiKey("cli", policy=KeyPolicy(default=-100, ceiling=0))})
    async with in_process(config(peer.url), keys=ring) as world:
        auth = [(b"authorization", b"Bearer sk-client")]
        assert (await post(world, "open/plain", auth)).status == 200
        sent = received(peer.url)[-1]
        assert "authorization" not in sent["headers"] and "x-api-key" not in sent["headers"]
        assert sent["headers"]["x-llamaswap-priority"] == "-100"  # the key's default
        call = await post(
            world, "remote/shared", [*auth, (b"x-llamaswap-priority", b"interactive")]
        )
        sent = received(peer.url)[-1]
        assert sent["headers"]["authorization"] == "Bearer sk-peer-secret"
        assert sent["headers"]["x-llamaswap-priority"] == "0"  # the key's ceiling
        ticket = await record_of(world, call)
        assert ticket.api_key == "cli" and ticket.requested_priority == 100


async def test_streams_are_relayed_and_recorded(fakellm):
    peer = await fakellm()
    async with in_process(config(peer.url)) as world:
        call = await post(world, "remote/qwen-remote", stream=True, max_tokens=4)
        assert call.status == 200
        assert call.headers[b"content-type"].startswith(b"text/event-stream")
        events = [line[6:] for line in call.body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        ticket = await record_of(world, call)
        assert ticket.outcome is Outcome.COMPLETED


class Seen(FinishLog):
    """Every ``on_finish`` the observers get, in order (one per request, or a bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[tuple[str, Outcome | None, int | None]] = []

    def on_finish(self, ticket):
        super().on_finish(ticket)
        self.ends.append((ticket.request_id, ticket.outcome, ticket.status))


async def test_a_peer_that_dies_mid_stream_is_recorded_once_as_the_client_saw_it(fakellm):
    peer = await fakellm()
    async with in_process(config(peer.url)) as world:
        seen = Seen()
        world.dispatcher.observers.append(seen)
        call = await post(
            world, "remote/qwen-remote", stream=True, max_tokens=8, fake_crash_after=3
        )
        # The client got the first chunks, then an error event and no [DONE].
        assert call.status == 200
        events = [line[6:] for line in call.body.decode().splitlines() if line.startswith("data: ")]
        assert len(events) == 5 and "[DONE]" not in events  # the role, three tokens, the error
        assert json.loads(events[-1])["error"]["code"] == "upstream_stream_broken"
        # Ended once, when the handler closed the request, as the client saw it: failed.
        assert seen.ends == [(call.request_id, Outcome.FAILED, 200)]
        ticket = seen.tickets[call.request_id]
        assert ticket.error.startswith("stream broken") and ticket.lane == ""
        assert ticket.finished_at is not None and ticket.extra["peer"] == "remote"
        assert world.recorder.finished == {call.request_id: Outcome.FAILED}
        assert peers.load("remote/qwen-remote") == 0
        # Never in the dispatcher's queue nor on a lane.
        assert not world.dispatcher.in_flight() and len(world.dispatcher.queue) == 0


async def test_every_way_a_peer_request_ends_is_told_once(fakellm):
    peer = await fakellm()
    async with in_process(config(peer.url, timeouts={"responseHeader": 0.5})) as world:
        seen = Seen()
        world.dispatcher.observers.append(seen)
        answered = await post(world, "remote/qwen-remote", max_tokens=2)
        streamed = await post(world, "remote/qwen-remote", stream=True, max_tokens=2)
        refused = await post(world, "remote/qwen-remote", fake_status=429)
        late = await post(world, "remote/qwen-remote", fake_delay=2)
        assert (answered.status, streamed.status, refused.status, late.status) == (
            200,
            200,
            429,
            504,
        )
        assert seen.ends == [
            (answered.request_id, Outcome.COMPLETED, 200),
            (streamed.request_id, Outcome.COMPLETED, 200),
            (refused.request_id, Outcome.COMPLETED, 429),  # the peer answered: relayed as is
            (late.request_id, Outcome.FAILED, 504),
        ]
        assert peers.load("remote/qwen-remote") == 0


async def test_a_peer_request_takes_no_local_turn(fakellm):
    peer = await fakellm()
    local = await fakellm()
    async with in_process(config(peer.url, local.url)) as world:
        # The local model is busy with a slow request, and another one waits behind it.
        slow = asyncio.create_task(post(world, "local", timeout=20, fake_delay=3))
        behind = asyncio.create_task(post(world, "local", timeout=20))
        for _ in range(300):
            if world.dispatcher.in_flight() and len(world.dispatcher.queue) == 1:
                break
            await asyncio.sleep(0.01)
        started = time.monotonic()
        call = await post(world, "remote/qwen-remote", max_tokens=2)
        assert call.status == 200
        assert time.monotonic() - started < 2  # not behind the local queue
        assert len(world.dispatcher.queue) == 1 and not slow.done()
        assert all(t.request_id != call.request_id for t in world.dispatcher.in_flight())
        await slow
        await behind


async def test_spillover_sends_overflow_to_the_peer(fakellm):
    peer = await fakellm()
    local = await fakellm()
    async with in_process(config(peer.url, local.url)) as world:
        first = asyncio.create_task(post(world, "overflow", timeout=20, fake_delay=2))
        for _ in range(300):
            if world.dispatcher.in_flight():
                break
            await asyncio.sleep(0.01)
        # "local" has one request (spillover 1): the next goes to the peer.
        call = await post(world, "overflow")
        assert call.status == 200
        assert received(peer.url)[-1]["body"]["model"] == "plain"
        ticket = await record_of(world, call)
        assert ticket.model.id == "open/plain" and ticket.extra["requested_model"] == "overflow"
        assert (await first).status == 200
        assert (await record_of(world, await post(world, "overflow"))).model.id == "local"


async def test_peer_timeouts_and_a_peer_that_is_down(fakellm, free_port):
    peer = await fakellm()
    async with in_process(config(peer.url, timeouts={"responseHeader": 0.3})) as world:
        call = await post(world, "remote/qwen-remote", fake_delay=2)
        assert call.status == 504
        assert json.loads(call.body)["error"]["code"] == "upstream_timeout"
        ticket = await record_of(world, call)
        assert (ticket.outcome, ticket.status) == (Outcome.FAILED, 504)
    async with in_process(config(f"http://127.0.0.1:{free_port()}")) as world:
        call = await post(world, "remote/qwen-remote")
        assert call.status == 502
        assert json.loads(call.body)["error"]["code"] == "peer_unavailable"


@pytest.mark.django_db(transaction=True)
async def test_a_peer_request_is_recorded_in_the_activity_log(fakellm):
    peer = await fakellm()
    async with in_process(config(peer.url)) as world:
        recorder = Recorder()
        world.dispatcher.observers.append(recorder)
        await recorder.start()
        try:
            call = await post(world, "qwen-remote", [(b"x-llamaswap-priority", b"batch")])
            assert call.status == 200
            await record_of(world, call)
            await recorder.flush()
        finally:
            await recorder.stop()
    row = await RequestRecord.objects.aget(request_id=call.request_id)
    assert (row.model, row.peer, row.requested_model) == (
        "remote/qwen-remote",
        "remote",
        "qwen-remote",
    )
    assert (row.policy, row.band, row.priority, row.outcome, row.status) == (
        "peer",
        "batch",
        -100,
        "completed",
        200,
    )
    assert row.queue_wait_ms is None and row.completion_tokens is not None
    assert row.metadata() == {"peer": "remote"}
    assert row.lane == ""  # no GPU lane here
    # On the dashboard's activity list (the history page), with both names.
    from django.test import AsyncClient

    page = (await AsyncClient().get("/history/")).content.decode()
    assert "remote/qwen-remote" in page and '<span class="tag">peer</span>' in page
    assert "as qwen-remote" in page
    rows = json.loads((await AsyncClient().get("/api/metrics/activity")).content)["data"]
    mine = next(r for r in rows if r["request_id"] == call.request_id)
    assert (mine["peer"], mine["requested_model"], mine["policy"]) == (
        "remote",
        "qwen-remote",
        "peer",
    )


async def test_a_peer_that_is_another_llamaswap_queues_it_by_the_same_rule(tmp_path, fakellm):
    port = free_port_block(1)
    models = {"big": fake_model(port)}
    with serve(tmp_path, models) as other:
        # Hold the other box's GPU with a slow request of its own.
        async with httpx.AsyncClient(timeout=30) as client:
            held = asyncio.create_task(
                client.post(other.url + "/v1/chat/completions", json=chat("big", fake_delay=3))
            )
            await asyncio.to_thread(other.wait_running)
            cfg = parse_config(
                {
                    "models": {"local": {"cmd": "fake", "proxy": "http://127.0.0.1:1"}},
                    "peers": {"box": {"proxy": other.url, "models": ["big"]}},
                }
            )
            async with in_process(cfg) as world:
                call = Call(
                    world.app,
                    "/v1/chat/completions",
                    json.dumps(chat("big")).encode(),
                    headers=[(b"x-llamaswap-priority", b"interactive")],
                )
                state = await asyncio.to_thread(other.wait_queue, 1)
                assert state["waiting"][0]["priority"] == 100
                assert state["waiting"][0]["band"] == "interactive"
                await call.done(30)
                assert call.status == 200
            assert (await held).status_code == 200


async def test_spillover_counts_a_burst_before_the_dispatcher_sees_it(fakellm):
    peer = await fakellm()
    local = await fakellm()
    async with in_process(config(peer.url, local.url)) as world:
        # Two at once: resolved in the same tick, before the dispatcher task runs.
        calls = await asyncio.gather(
            post(world, "overflow", timeout=20, fake_delay=0.5),
            post(world, "overflow", timeout=20, fake_delay=0.5),
        )
        models = sorted([(await record_of(world, c)).model.id for c in calls])
        assert models == ["local", "open/plain"]


def multipart(model: str, audio: bytes) -> tuple[bytes, bytes]:
    built = httpx.Request(
        "POST",
        "http://x/",
        data={"model": model, "language": "en"},
        files={"file": ("a.wav", audio)},
    )
    return built.read(), built.headers["content-type"].encode()


async def test_a_multipart_model_field_is_rewritten_and_files_pass_untouched(fakellm):
    peer = await fakellm()
    local = await fakellm()
    audio = bytes(range(256)) * 40 + b"\r\n--not-a-boundary\r\n"
    async with in_process(config(peer.url, local.url)) as world:
        for requested, server, sent_as in (
            ("qwen-remote", peer, "qwen-remote"),
            ("remote/qwen-remote", peer, "qwen-remote"),  # the peer's own name
            ("overflow", local, "local"),  # a selector's pick
        ):
            body, content_type = multipart(requested, audio)
            call = Call(world.app, "/v1/audio/transcriptions", body, content_type=content_type)
            await call.done(10)
            assert call.status == 200, call.body
            got = received(server.url)[-1]["body"]
            assert got["fields"] == {"model": sent_as, "language": "en"}
            assert got["files"] == {"a.wav": len(audio)}


async def test_a_client_that_leaves_cancels_the_peer_request(fakellm):
    peer = await fakellm()
    async with in_process(config(peer.url)) as world:
        body = json.dumps(chat("remote/qwen-remote", fake_delay=5)).encode()
        call = Call(world.app, "/v1/chat/completions", body)
        for _ in range(300):
            if received(peer.url):
                break
            await asyncio.sleep(0.01)
        call.disconnect.set()
        await call.done(5)
        assert call.status is None  # nothing was sent back
        for _ in range(300):
            if world.recorder.tickets:
                break
            await asyncio.sleep(0.01)
        (ticket,) = world.recorder.tickets.values()
        assert ticket.model.id == "remote/qwen-remote"
        assert ticket.outcome is Outcome.CANCELLED_RUNNING
        assert peers.load("remote/qwen-remote") == 0
        for _ in range(300):
            if received(peer.url)[-1]["disconnected"]:
                break
            await asyncio.sleep(0.01)
        assert received(peer.url)[-1]["disconnected"]  # the peer saw it go


async def test_a_peer_turn_dropped_unclosed_is_still_ended_once():
    # The handler closes every turn; should a bug drop one, the backstop ends its ticket
    # (as the dispatcher's does for a local turn) and the observers still hear of it once.
    import gc

    from proxy.turn import Turn
    from scheduler.config import ModelConfig
    from scheduler.tickets import Unqueued

    seen = Seen()
    clock = types.SimpleNamespace(observers=[seen], now=time.monotonic)
    unqueued = Unqueued(clock)
    model = ModelConfig(id="remote/m", cmd=(), proxy="http://127.0.0.1:9", check_endpoint=None)
    turn = Turn(unqueued, model, 0, "req-dropped", "/v1/chat/completions")
    ticket = turn.ticket
    assert unqueued.load("remote/m") == 1 and ticket.lane == ""
    del turn
    gc.collect()
    for _ in range(3):  # ended on the loop's next turn, as the dispatcher's backstop does
        await asyncio.sleep(0)
    assert seen.ends == [("req-dropped", Outcome.FAILED, 500)]
    assert unqueued.load("remote/m") == 0 and ticket.error == "turn abandoned by its request"
    unqueued.finish(ticket, Outcome.COMPLETED, 200)  # a late close changes nothing
    assert len(seen.ends) == 1


@pytest.mark.django_db(transaction=True)
async def test_a_request_the_fleet_placed_on_another_node_is_recorded_as_the_local_model(
    fakellm, monkeypatch
):
    """fleet/placing.py sends a local model's request to another node through the peer
    path. Its record is made the moment its ticket finishes (a JSON answer read whole
    finishes it before the view has returned): it names the local model, not
    ``node/model``, and says where the request went."""
    from fleet import placing
    from scheduler.config.peers import Peer, PeerModel
    from scheduler.core.placement import Placement
    from scheduler.names import Route

    node = await fakellm()
    async with in_process(config(node.url)) as world:
        local = world.dispatcher.config.models["local"]
        box_b = Peer(id="box-b", proxy=node.url, models=("local",))
        route = Route("local", "local", model=local, peer=PeerModel(box_b, "local"))
        placement = Placement("box-b", "sent to box-b: model loaded there", forward=True)
        hops = [placing.Hop(route=route, placement=placement)]

        def hop(request, target, extra):
            if not hops:
                return None
            extra["placement"] = placement.reason
            return hops.pop()

        monkeypatch.setattr(placing, "hop", hop)
        finished: list[str] = []  # the model each ticket names when it finishes
        world.dispatcher.observers.append(
            types.SimpleNamespace(
                on_finish=lambda ticket: finished.append(ticket.model.id),
                **{
                    name: lambda *a: None
                    for name in ("on_enqueue", "on_dispatch", "on_model_state", "on_settings")
                },
            )
        )
        recorder = Recorder()
        world.dispatcher.observers.append(recorder)
        await recorder.start()
        try:
            call = await post(world, "local")
            assert call.status == 200
            await record_of(world, call)
            await recorder.flush()
        finally:
            await recorder.stop()
    assert finished == ["local"]
    assert received(node.url)[-1]["body"]["model"] == "local"
    row = await RequestRecord.objects.aget(request_id=call.request_id)
    assert (row.model, row.peer, row.placement) == (
        "local",
        "box-b",
        "sent to box-b: model loaded there",
    )
