"""Fleet membership on a real Redis (fleet/node.py, fleet/view.py): nodes in one process,
each with its own dispatcher (fake model processes) and its own key prefix per test, so
parallel runs never meet. What a user would notice: every node sees the others and their
loaded models within a second of a change, a node that stops publishing is shown down
within ~3 s and comes back by itself, and with Redis away a node keeps its requests here
and says the fleet is degraded."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest
import redis

from fleet import metrics as fleet_metrics
from fleet.node import Fleet, current, enabled, section
from fleet.view import MAX_MESSAGE_BYTES, BadMessage, decode, encode, local_view
from scheduler.core.placement import DOWN_SECONDS, NodeView
from scheduler.dispatcher import Dispatcher, Outcome
from scheduler.testing import FakeProcessFactory
from tests.helpers import make_config, until

REDIS_URL = "redis://127.0.0.1:6379/0"


def redis_up() -> bool:
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


needs_redis = pytest.mark.skipif(not redis_up(), reason="no Redis at 127.0.0.1:6379")


@pytest.fixture
async def nodes():
    """``await nodes("box-a", url=...)`` -> a started Fleet on its own dispatcher."""
    prefix = f"llamaswap-test:{uuid.uuid4().hex}"
    built: list[tuple[Fleet, Dispatcher]] = []

    async def build(name: str, *, redis_url: str = REDIS_URL, models=("qwen", "llama")) -> Fleet:
        dispatcher = Dispatcher(make_config(*models), process_factory=FakeProcessFactory())
        await dispatcher.start()
        fleet = Fleet(name, f"http://{name}:8080", redis_url, dispatcher, prefix=prefix)
        await fleet.start()
        built.append((fleet, dispatcher))
        return fleet

    yield build
    for fleet, dispatcher in built:
        await fleet.stop()
        await dispatcher.stop(grace=0)
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=f"{prefix}:*"):
        client.delete(key)


async def load(fleet: Fleet, model: str) -> None:
    """Run one request of ``model`` on ``fleet``'s dispatcher (its model stays loaded)."""
    dispatcher = fleet.dispatcher
    ticket = dispatcher.submit(dispatcher.config.models[model], 0, uuid.uuid4().hex, "/v1/x")
    await ticket.wait()
    dispatcher.finish(ticket, Outcome.COMPLETED, 200)


def test_fleet_mode_needs_redis_and_a_name():
    assert enabled("redis://x", "box-a")
    assert not enabled("", "box-a")
    assert not enabled("redis://x", "")


@needs_redis
async def test_nodes_see_each_other_and_a_load_within_a_second(nodes):
    a = await nodes("box-a")
    b = await nodes("box-b")
    await until(lambda: "box-b" in a.view.views and "box-a" in b.view.views, timeout=2.0)
    await until(lambda: not a.degraded() and not b.degraded(), timeout=2.0)
    await load(b, "qwen")
    loaded_at = time.monotonic()
    await until(lambda: a.view.views["box-b"].models.get("qwen") == "ready", timeout=1.0)
    assert time.monotonic() - loaded_at < 1.0
    state = a.state()
    assert [n["node"] for n in state["nodes"]] == ["box-a", "box-b"]
    row_b = state["nodes"][1]
    assert row_b["up"] and row_b["loaded"] == ["qwen"] and row_b["url"] == "http://box-b:8080"
    assert state["status"] == "ok" and state["up"] == 2


@needs_redis
async def test_a_warm_node_gets_the_request_and_the_reason_says_why(nodes):
    from fleet.placing import decide

    a = await nodes("box-a")
    b = await nodes("box-b")
    await load(b, "qwen")

    def b_idle_and_warm() -> bool:
        view = a.view.views.get("box-b")
        return (
            view is not None
            and view.models.get("qwen") == "ready"
            and not any(lane.running for lane in view.lanes.values())
        )

    await until(b_idle_and_warm, timeout=2.0)
    await until(lambda: not a.degraded())
    placement = decide(a, "qwen", 0)
    assert placement.forward and placement.node == "box-b"
    assert placement.reason.startswith("sent to box-b: model loaded there, not loaded here")
    assert a.view.pending == {"box-b": 1}  # counted against box-b until its next view


@needs_redis
async def test_a_silent_node_is_shown_down_then_comes_back(nodes):
    a = await nodes("box-a")
    b = await nodes("box-b")
    await until(lambda: a.view.up("box-b", a.clock()), timeout=2.0)
    for task in b._tasks:  # as if killed: no goodbye, the presence key left to expire
        task.cancel()
    went = time.monotonic()
    await until(lambda: not a.view.up("box-b", a.clock()), timeout=DOWN_SECONDS + 1.5)
    assert DOWN_SECONDS - 1.2 < time.monotonic() - went < DOWN_SECONDS + 1.0
    assert [n["up"] for n in a.state()["nodes"]] == [True, False]
    again = Fleet("box-b", "http://box-b:8080", REDIS_URL, b.dispatcher, prefix=b.prefix)
    await again.start()
    try:
        await until(lambda: a.view.up("box-b", a.clock()), timeout=1.5)
    finally:
        await again.stop()
        await b.start()  # the fixture stops it


@needs_redis
async def test_a_new_node_reads_the_live_ones_from_their_presence_keys(nodes):
    a = await nodes("box-a")
    await until(lambda: not a.degraded(), timeout=2.0)
    b = await nodes("box-b")
    # box-a may not publish again for up to a second; box-b knows it at once from its key
    await until(lambda: "box-a" in b.view.views, timeout=0.5)


async def test_without_redis_the_node_serves_here_and_says_degraded(nodes):
    a = await nodes("box-a", redis_url="redis://127.0.0.1:1/0")
    await until(lambda: "cannot" in a.view.reason or "lost" in a.view.reason, timeout=3.0)
    assert a.degraded()
    assert a.state()["status"].startswith("degraded: ")
    from fleet.placing import decide

    placement = decide(a, "qwen", 0)
    assert not placement.forward and placement.node == "box-a"
    assert "degraded" in placement.reason
    # its own view stays current without Redis
    await load(a, "qwen")
    a.refresh()
    assert a.view.views["box-a"].models == {"qwen": "ready"}


async def test_a_view_survives_the_wire_and_bad_messages_are_refused():
    dispatcher = Dispatcher(make_config("qwen"), process_factory=FakeProcessFactory())
    await dispatcher.start()
    try:
        view = local_view("box-a", "http://a:1", dispatcher, dispatcher.now())
    finally:
        await dispatcher.stop(grace=0)
    back, token, seq = decode(encode(view, "t0k", 7), heard=5.0)
    assert (token, seq) == ("t0k", 7)
    assert back == NodeView(**{**view.__dict__, "heard": 5.0})
    good = json.loads(encode(view, "t", 1))
    for bad in (
        b"not json",
        b"[1]",
        json.dumps({**good, "v": 2}),
        json.dumps({**good, "node": ""}),
        json.dumps({**good, "seq": "1"}),
        json.dumps({**good, "serves": [1]}),
        json.dumps({**good, "lanes": {"default": {"depth": {"normal": "x"}}}}),
        json.dumps({**good, "models": {"qwen": 3}}),
        b"{" + b" " * MAX_MESSAGE_BYTES + b"}",
    ):
        with pytest.raises(BadMessage):
            decode(bad, heard=0.0)


@needs_redis
async def test_the_dashboard_and_metrics_show_the_fleet(nodes):
    a = await nodes("box-a")
    b = await nodes("box-b")
    await until(lambda: "box-b" in a.view.views and "box-a" in b.view.views, timeout=2.0)
    assert current() is b  # the last started: one per server in production
    fleet_state = section()
    assert fleet_state is not None and {n["node"] for n in fleet_state["nodes"]} == {
        "box-a",
        "box-b",
    }
    families = {m.name: m for m in fleet_metrics.COLLECTOR.collect()}
    up = {s.labels["state"]: s.value for s in families["llamaswap_fleet_nodes"].samples}
    assert up == {"up": 2, "down": 0}
    depth = [s for s in families["llamaswap_fleet_queue_depth"].samples]
    assert len(depth) == 2 * 3 and all(s.value == 0 for s in depth)


def test_the_dashboard_page_lists_the_fleets_nodes():
    from django.template.loader import render_to_string
    from django.test import RequestFactory

    from dashboard.snapshot import empty_snapshot

    view = fleet_of_two()
    snap = empty_snapshot(0.0)
    snap["fleet"] = view.state(now=10.0)
    html = render_to_string(
        "dashboard/index.html",
        {"snap": snap, "nav": "dashboard"},
        request=RequestFactory().get("/"),
    )
    fleet_html = html[html.index('id="fleet"') :]
    fleet_html = fleet_html[: fleet_html.index("</section>")]
    assert "1 of 2 up" in fleet_html
    assert 'data-node="box-a"' in fleet_html and "(here)" in fleet_html
    assert "box-b</strong>" in fleet_html and ">down</span>" in fleet_html
    assert "qwen" in fleet_html and "waiting 2 / 0 / 0" in fleet_html


def fleet_of_two():
    from fleet.view import FleetView
    from scheduler.core.placement import LaneWait

    view = FleetView(here="box-a", degraded=False)
    here = NodeView(
        node="box-a",
        url="http://a",
        models={"qwen": "ready"},
        lanes={"default": LaneWait(depth={"interactive": 2}, running=1)},
        heard=10.0,
    )
    gone = NodeView(
        node="box-b", url="http://b", models={"llama": "ready"}, heard=10.0 - DOWN_SECONDS - 1
    )
    view.update(here, "t", 1)
    view.update(gone, "u", 1)
    return view


def _request(*headers: tuple[bytes, bytes], content_type="application/json", method="POST"):
    """What ``fleet.placing.hop`` reads of a proxied request."""
    from types import SimpleNamespace

    return SimpleNamespace(
        scope={"headers": list(headers)},
        META={},
        method=method,
        content_type=content_type,
    )


@pytest.fixture
def placing_node(nodes):
    """box-a (real Redis) with a warm, idle box-b in its view, and a runtime to read."""
    from scheduler import runtime
    from scheduler.core.placement import LaneWait
    from scheduler.keys import KeyRing

    async def build(keys: KeyRing | None = None):
        a = await nodes("box-a")
        await until(lambda: not a.degraded(), timeout=2.0)
        warm = NodeView(
            node="box-b",
            url="http://box-b:8080",
            serves=frozenset({"qwen"}),
            models={"qwen": "ready"},
            lanes={"default": LaneWait()},
            heard=a.clock(),
        )
        a.view.update(warm, "b-token", 1)
        runtime.install(
            runtime.Runtime(
                config=a.dispatcher.config,
                dispatcher=a.dispatcher,
                upstreams=None,
                keys=keys or KeyRing(),
            )
        )
        return a

    yield build
    runtime.install(None)


@needs_redis
async def test_a_request_is_placed_once_and_a_forged_header_only_keeps_it_here(placing_node):
    from fleet.placing import hop
    from scheduler.names import Route

    a = await placing_node()
    qwen = a.dispatcher.config.models["qwen"]
    target = Route("qwen", "qwen", model=qwen)
    extra: dict = {}
    request = _request((b"content-type", b"application/json"))
    placed = hop(request, target, extra)
    assert placed is not None and placed.placement.node == "box-b"
    assert placed.route.peer.peer.proxy == "http://box-b:8080"
    assert placed.route.model is qwen  # its ticket and record name the local model
    assert (b"x-llamaswap-placed", f"box-a {a.token}".encode()) in request.scope["headers"]
    assert extra["placement"].startswith("sent to box-b")
    # On the receiving side: a valid token leaves the record to the sender ...
    extra = {}
    assert hop(_request((b"x-llamaswap-placed", b"box-b b-token")), target, extra) is None
    assert extra == {"recorded_elsewhere": "box-b"}
    # ... a forged one only stops placement: recorded here as usual
    extra = {}
    assert hop(_request((b"x-llamaswap-placed", b"box-b forged")), target, extra) is None
    assert extra == {}
    # multipart bodies and useModelName stay here (their body is not the client's JSON)
    assert hop(_request(content_type="multipart/form-data"), target, {}) is None
    renamed = Route("qwen", "qwen", model=dataclasses.replace(qwen, use_model_name="up"))
    assert hop(_request(), renamed, {}) is None


@needs_redis
async def test_with_keys_the_clients_own_key_goes_along_or_it_stays_here(placing_node):
    from fleet.placing import hop
    from scheduler.config.access import read_api_keys
    from scheduler.keys import KeyRing
    from scheduler.names import Route

    a = await placing_node(KeyRing(read_api_keys(["sk-fleet-1"])))
    target = Route("qwen", "qwen", model=a.dispatcher.config.models["qwen"])
    placed = hop(_request((b"authorization", b"Bearer sk-fleet-1")), target, {})
    assert placed is not None and placed.route.peer.peer.api_key == "sk-fleet-1"
    assert hop(_request(), target, {}) is None  # a staff session: its cookie is this node's


async def test_serve_names_the_node_and_keeps_its_dashboard_group_its_own(settings):
    from fleet.wiring import from_settings

    settings.REDIS_URL = ""
    settings.LLAMASWAP_NODE = ""
    dispatcher = Dispatcher(make_config("qwen"), process_factory=FakeProcessFactory())
    assert from_settings("box-a", dispatcher, "127.0.0.1", 8080, False) is None  # no Redis
    assert settings.LLAMASWAP_NODE == "box-a"  # the records are named all the same
    settings.REDIS_URL = REDIS_URL
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
    fleet = from_settings("box-b", dispatcher, "0.0.0.0", 8080, True)
    assert fleet is not None and fleet.node == "box-b"
    assert fleet.url.startswith("https://") and fleet.url.endswith(":8080")
    assert "0.0.0.0" not in fleet.url  # every interface: the host's name
    assert settings.CHANNEL_LAYERS["default"]["CONFIG"] == {
        "hosts": [REDIS_URL],
        "prefix": "asgi:box-b",
    }


def _peer_answer(status: int, code: str, message: str):
    from django.http import JsonResponse

    return JsonResponse({"error": {"message": message, "code": code}}, status=status)


@needs_redis
async def test_a_node_that_goes_away_before_answering_gets_the_request_placed_again(
    placing_node, settings
):
    """The peer path's own 502 for a hop that got no byte (refused, reset): the node is
    out of placement and the request goes to the next node, or runs here; anything the
    node did send (a relayed 502) reaches the client as it is: never run twice."""
    from types import SimpleNamespace

    from django.http import HttpResponse

    from fleet.placing import PLACEMENT_HEADER, run
    from scheduler.core.placement import LaneWait
    from scheduler.names import Route

    settings.DEBUG = False
    a = await placing_node()
    box_c = NodeView(
        node="box-c",
        url="http://box-c:8080",
        serves=frozenset({"qwen"}),
        models={"qwen": "ready"},
        lanes={"default": LaneWait(wait={"normal": 0.05})},
        heard=a.clock(),
    )
    a.view.update(box_c, "c-token", 1)
    target = Route("qwen", "qwen", model=a.dispatcher.config.models["qwen"])
    sent_to: list[str] = []
    closed: list[dict] = []

    def forwarding(answers):
        async def forward(route, extra):
            node = route.peer.peer.id
            sent_to.append(node)

            async def close():
                closed.append(ticket.extra)

            ticket = SimpleNamespace(extra=dict(extra), model=None)
            request.turn = SimpleNamespace(ticket=ticket, close=close)
            return answers[node](node)

        return forward

    went_away = lambda node: _peer_answer(  # noqa: E731
        502, "peer_unavailable", f"peer {node!r} did not answer: RemoteProtocolError: closed"
    )
    request = _request((b"content-type", b"application/json"))
    extra: dict = {}
    answer = await run(
        request, target, extra, forwarding({"box-b": went_away, "box-c": lambda n: HttpResponse()})
    )
    assert sent_to == ["box-b", "box-c"]
    assert answer is not None and answer[PLACEMENT_HEADER].startswith(
        "sent to box-b: model loaded there"
    )
    assert (
        "box-b went away before answering (RemoteProtocolError): placed again; sent to box-c"
        in (answer[PLACEMENT_HEADER])
    )
    assert closed == [{**closed[0], "recorded_elsewhere": "here"}]  # the failed hop: no record
    assert not a.view.up("box-b", a.clock())  # out of placement until it publishes again
    assert [h for h in request.scope["headers"] if h[0] == b"x-llamaswap-placed"] == [
        (b"x-llamaswap-placed", f"box-a {a.token}".encode())
    ]  # one mark, the last hop's

    # Every node that serves it went away: it runs here, and its record says why.
    box_b = a.view.views["box-b"]
    a.view.update(dataclasses.replace(box_b, heard=a.clock()), "b-token", 2)
    a.view.update(dataclasses.replace(box_c, heard=a.clock()), "c-token", 2)
    sent_to.clear()
    request, extra = _request((b"content-type", b"application/json")), {}
    answers = {"box-b": went_away, "box-c": went_away}
    assert await run(request, target, extra, forwarding(answers)) is None
    assert sent_to == ["box-b", "box-c"]
    assert extra["placement"].startswith("sent to box-b: model loaded there")
    for node in ("box-b", "box-c"):
        assert f"{node} went away before answering (RemoteProtocolError)" in extra["placement"]
    assert not request.scope["headers"][1:]  # no mark left: the local run is its own

    # A node that answered (a relayed 502 of its model) is never asked again.
    a.view.update(dataclasses.replace(box_c, heard=a.clock()), "c-token", 3)
    sent_to.clear()
    broken = lambda node: _peer_answer(502, "upstream_broken", "ReadError: cut")  # noqa: E731
    answer = await run(_request(), target, {}, forwarding({"box-c": broken}))
    assert sent_to == ["box-c"] and answer is not None and answer.status_code == 502


@needs_redis
async def test_the_models_page_lists_every_nodes_models_and_states(nodes):
    from dashboard import models_page
    from scheduler.runtime import Runtime

    b = await nodes("box-b")
    a = await nodes("box-a")  # started last: this process's fleet (the page reads its view)
    await until(lambda: "box-b" in a.view.views, timeout=2.0)
    await load(b, "qwen")
    rt = Runtime(config=a.dispatcher.config, dispatcher=a.dispatcher, upstreams=None)  # type: ignore[arg-type]

    def node(name: str) -> dict:
        fleet = models_page.model_rows(rt)["fleet"]
        return next(n for n in fleet["nodes"] if n["node"] == name)

    await until(lambda: node("box-b")["models"].get("qwen") == "ready", timeout=1.0)
    assert node("box-a") | {"models": {}} == node("box-a")  # nothing loaded here
    assert node("box-a")["here"] and node("box-b")["up"]
    await b.stop()  # gone from Redis: shown down within ~3 s, nothing loaded any more
    await until(lambda: not node("box-b")["up"], timeout=DOWN_SECONDS + 1.5)
    assert node("box-b")["models"] == {}


@needs_redis
@pytest.mark.django_db(transaction=True)
async def test_a_key_issued_or_revoked_on_one_node_holds_on_every_node(nodes):
    """The keys are rows in the shared database; box-a's save is announced, and box-b
    reads them again: the key works there at once, and stops working once revoked."""
    from asgiref.sync import sync_to_async
    from django.utils import timezone

    from control import changes
    from control.keys import assign, new_key
    from control.models import IssuedKey
    from scheduler import runtime
    from scheduler.keys import KeyRing

    b = await nodes("box-b")  # the node that must learn of it
    a = await nodes("box-a")  # this process's fleet: the announcer
    await until(lambda: not a.degraded() and not b.degraded(), timeout=2.0)
    ring = KeyRing()
    runtime.install(
        runtime.Runtime(
            config=b.dispatcher.config, dispatcher=b.dispatcher, upstreams=None, keys=ring
        )  # type: ignore[arg-type]
    )
    key = new_key()

    def issue() -> None:  # written as another node would: no signal here
        record = IssuedKey(name="ci")
        assign(record, key)
        IssuedKey.objects.bulk_create([record])

    try:
        await sync_to_async(issue)()
        assert ring.lookup(key) is None
        changes.changed("keys")  # what box-a's save does once committed
        await until(lambda: ring.lookup(key) is not None, timeout=2.0)
        assert ring.lookup(key).name == "ci" and ring.required

        await sync_to_async(IssuedKey.objects.filter(name="ci").update)(revoked_at=timezone.now())
        changes.changed("keys")
        await until(lambda: ring.lookup(key) is None, timeout=2.0)
    finally:
        runtime.install(None)


@needs_redis
@pytest.mark.django_db(transaction=True)
async def test_a_settings_edit_saved_on_one_node_reaches_every_nodes_scheduler(nodes):
    from asgiref.sync import sync_to_async

    from control import changes
    from control.models import SchedulerSettingsRecord
    from scheduler import runtime

    b = await nodes("box-b")
    a = await nodes("box-a")
    await until(lambda: not a.degraded() and not b.degraded(), timeout=2.0)
    runtime.install(
        runtime.Runtime(config=b.dispatcher.config, dispatcher=b.dispatcher, upstreams=None)  # type: ignore[arg-type]
    )
    assert b.dispatcher.settings.aging_divisor != 7
    try:
        await sync_to_async(SchedulerSettingsRecord.objects.create)(
            pk=SchedulerSettingsRecord.SINGLETON_PK,
            values={"agingDivisor": 7},
            admin_overrides={"agingDivisor": {"by": "ops", "at": "2026-12-02 15:00:00 UTC"}},
        )
        changes.changed("settings")  # what box-a's admin save does once committed
        await until(lambda: b.dispatcher.settings.aging_divisor == 7, timeout=2.0)
    finally:
        runtime.install(None)
