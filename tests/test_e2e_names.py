"""setParamsByID aliases, selectors and profiles through the real ASGI app in-process.

The model servers are an httpx transport that records what each request carried; the
dispatcher runs over in-memory model processes (tests/asgi.py).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from scheduler import runtime
from scheduler.config import parse_config
from scheduler.keys import ApiKey, KeyRing, Scope
from tests.asgi import Body, Call, in_process, served_client
from web.runtime import carrying

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]

CONFIG = {
    "models": {
        "gpt": {
            "cmd": "fake",
            "proxy": "http://127.0.0.1:9001",
            "aliases": ["gpt-fast"],
            "filters": {
                "stripParams": "top_k",
                "setParams": {"temperature": 1.0, "effort": "none"},
                "setParamsByID": {
                    "${MODEL_ID}": {"effort": "medium"},
                    "${MODEL_ID}:high": {"effort": "high", "temperature": 0.6},
                    "gpt-fast": {"effort": "low"},
                },
            },
        },
        "coder": {"cmd": "fake", "proxy": "http://127.0.0.1:9002"},
        "small": {"cmd": "fake", "proxy": "http://127.0.0.1:9003", "useModelName": "small-q8"},
    },
    "selectors": {
        "pool": {"strategy": "warm", "targets": ["gpt", "coder"], "name": "Pool"},
        "thinker": {"strategy": "pin", "targets": ["gpt:high", "coder"]},
        "hidden-sel": {"strategy": "pin", "targets": ["coder"], "unlisted": True},
    },
    "peers": {"remote": {"proxy": "http://127.0.0.1:1", "models": ["glm"]}},
    "profiles": {
        "coding": {
            "description": "coding names",
            "pins": {"llm-code": "coder", "llm-plan": "thinker", "gpt": "small", "image": None},
        },
        "quiet": {"pins": {"llm-code": "small"}},
    },
}


class Recording(httpx.AsyncBaseTransport):
    """Model servers that answer 200 and keep (host, JSON body) of every request."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        try:
            sent = json.loads(request.content)
        except ValueError:
            sent = {"raw": request.content}
        self.seen.append((f"{request.url.host}:{request.url.port}", sent))
        body = json.dumps({"object": "chat.completion", "choices": []}).encode()
        return httpx.Response(200, headers={"content-type": "application/json"}, stream=Body(body))


PORT_OF = {"gpt": 9001, "coder": 9002, "small": 9003}


async def chat(world, model: str, headers=(), **extra) -> Call:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})
    call = Call(world.app, "/v1/chat/completions", body.encode(), headers=list(headers))
    await call.done(5)
    return call


async def finished(world, call: Call):
    """The dispatcher's ticket of a finished request (its record's source)."""
    for _ in range(200):
        ticket = world.recorder.tickets.get(call.request_id)
        if ticket is not None:
            return ticket
        await asyncio.sleep(0.01)
    raise AssertionError("never finished")


async def api(world, method: str, path: str, body: bytes = b"", headers=()) -> Call:
    call = Call(world.app, path, body, method=method, headers=list(headers))
    await call.done(5)
    return call


def config():
    return parse_config(CONFIG)


# --------------------------------------------------------------------------- setParamsByID


@pytest.mark.parametrize(
    ("requested", "effort", "temperature"),
    [
        ("gpt:high", "high", 0.6),  # the automatic alias, applied after setParams
        ("gpt", "medium", 1.0),  # the model's own id may have params too
        ("gpt-fast", "low", 1.0),  # an explicit alias with params
    ],
)
async def test_set_params_by_id_alias_applies_its_params(requested, effort, temperature):
    upstream = Recording()
    async with in_process(config(), transport=upstream) as world:
        call = await chat(world, requested, top_k=40, temperature=0.1)
        assert call.status == 200, call.body
        host, sent = upstream.seen[-1]
        assert host == "127.0.0.1:9001"
        assert sent["effort"] == effort and sent["temperature"] == temperature
        assert "top_k" not in sent
        assert sent["model"] == requested  # the name as asked, as llama-swap sends it
        ticket = await finished(world, call)
        assert ticket.model.id == "gpt"  # the scheduler saw the model that runs
        want = {} if requested == "gpt" else {"requested_model": requested}
        assert {k: v for k, v in ticket.extra.items() if k == "requested_model"} == want


# --------------------------------------------------------------------------- selectors


async def test_a_selector_resolves_before_the_request_queues():
    upstream = Recording()
    async with in_process(config(), transport=upstream) as world:
        # Nothing loaded: warm cold-starts its first target.
        call = await chat(world, "pool")
        assert call.status == 200
        assert upstream.seen[-1] == ("127.0.0.1:9001", upstream.seen[-1][1])
        assert upstream.seen[-1][1]["model"] == "gpt"
        ticket = await finished(world, call)
        assert ticket.model.id == "gpt" and ticket.extra["requested_model"] == "pool"
        # coder loaded now: warm follows it.
        assert (await chat(world, "coder")).status == 200
        call = await chat(world, "pool")
        assert upstream.seen[-1][0] == "127.0.0.1:9002"
        assert (await finished(world, call)).model.id == "coder"
        # pin: its first target, an automatic alias with its params.
        call = await chat(world, "thinker")
        host, sent = upstream.seen[-1]
        assert host == "127.0.0.1:9001" and sent["model"] == "gpt:high" and sent["effort"] == "high"
        assert (await finished(world, call)).extra["requested_model"] == "thinker"


async def test_models_list_has_peers_selectors_and_the_active_profiles_pins():
    async with in_process(config(), transport=Recording()) as world:
        listing = json.loads((await api(world, "GET", "/v1/models")).body)
        records = {r["id"]: r for r in listing["data"]}
        assert list(records) == sorted(records)
        assert records["remote/glm"]["meta"]["llamaswap"] == {"type": "peer", "peerID": "remote"}
        assert records["remote/glm"]["name"] == "remote: glm"
        assert records["pool"]["meta"]["llamaswap"] == {
            "type": "selector",
            "strategy": "warm",
            "targets": ["gpt", "coder"],
        }
        assert records["pool"]["name"] == "Pool" and records["pool"]["status"] == {"value": "unloaded"}
        assert "hidden-sel" not in records  # unlisted
        assert "llm-code" not in records  # no profile active
        runtime.current().profile = "coding"
        records = {r["id"]: r for r in json.loads((await api(world, "GET", "/v1/models")).body)["data"]}
        assert records["llm-code"]["meta"]["llamaswap"] == {"type": "profile"}
        assert "llm-plan" in records
        assert "image" not in records  # an empty pin is not listed
        assert records["gpt"]["meta"]["llamaswap"]["type"] == "model"  # a pin never shadows a model


# --------------------------------------------------------------------------- profiles


async def test_profile_switch_via_the_api_changes_resolution_and_is_audited():
    from control.models import SettingsChange

    upstream = Recording()
    async with in_process(config(), transport=upstream) as world:
        state = json.loads((await api(world, "GET", "/api/profiles")).body)
        assert state["active"] is None
        assert [p["id"] for p in state["profiles"]] == ["coding", "quiet"]
        assert state["profiles"][0]["pins"]["image"] == ""
        assert (await chat(world, "llm-code")).status == 404

        switched = await api(world, "PUT", "/api/profiles/active", b'{"name": "coding"}')
        assert switched.status == 200 and json.loads(switched.body) == {"active": "coding"}
        call = await chat(world, "llm-code")
        assert call.status == 200 and upstream.seen[-1][0] == "127.0.0.1:9002"
        ticket = await finished(world, call)
        assert ticket.model.id == "coder" and ticket.extra["requested_model"] == "llm-code"
        # A pin to a selector, and a pin that shadows a model id (useModelName applies).
        await chat(world, "llm-plan")
        assert upstream.seen[-1][1]["effort"] == "high"
        await chat(world, "gpt")
        assert upstream.seen[-1] == ("127.0.0.1:9003", upstream.seen[-1][1])
        assert upstream.seen[-1][1]["model"] == "small-q8"
        # An empty pin: 404 while the profile is active.
        refused = await chat(world, "image")
        assert refused.status == 404
        error = json.loads(refused.body)["error"]
        assert error["code"] == "model_not_found" and "disabled by the active profile" in error["message"]

        assert (await api(world, "PUT", "/api/profiles/active", b'{"name": "nope"}')).status == 404
        assert (await api(world, "PUT", "/api/profiles/active", b'{"profile": "x"}')).status == 400
        assert (await api(world, "PUT", "/api/profiles/active", b'{"name": 3}')).status == 400
        assert (await api(world, "POST", "/api/profiles/active", b'{"name": null}')).status == 405
        assert runtime.current().profile == "coding"
        assert (await api(world, "PUT", "/api/profiles/active", b'{"name": null}')).status == 200
        assert runtime.current().profile == ""
        assert (await chat(world, "gpt")).status == 200 and upstream.seen[-1][0] == "127.0.0.1:9001"

    changes = [
        (c.field, c.old, c.new, c.who, c.source)
        async for c in SettingsChange.objects.filter(field="profile").order_by("id")
    ]
    assert changes == [
        ("profile", None, "coding", "API (no API keys configured)", "admin"),
        ("profile", "coding", None, "API (no API keys configured)", "admin"),
    ]


async def test_with_keys_the_switch_needs_one_and_names_it():
    from control.models import SettingsChange

    ring = KeyRing(
        {
            "sk-chat": ApiKey("chat"),
            "sk-ops": ApiKey("ops", scopes=frozenset({Scope.INFERENCE, Scope.PROFILES})),
        }
    )
    async with in_process(config(), transport=Recording(), keys=ring) as world:
        body = b'{"name": "quiet"}'
        assert (await api(world, "PUT", "/api/profiles/active", body)).status == 401
        # An inference key (the default scope) may not switch the profile for everyone.
        chat = [(b"authorization", b"Bearer sk-chat")]
        assert (await api(world, "PUT", "/api/profiles/active", body, chat)).status == 403
        assert runtime.current().profile == ""
        auth = [(b"authorization", b"Bearer sk-ops")]
        assert (await api(world, "PUT", "/api/profiles/active", body, auth)).status == 200
        # A page of another site is refused even with the key (a browser would send it).
        cross = [*auth, (b"origin", b"http://evil.example")]
        assert (await api(world, "PUT", "/api/profiles/active", b'{"name": null}', cross)).status == 403
        assert runtime.current().profile == "quiet"
        # Or a staff member's session (a plain user's is refused).
        for name, staff, status in (("someone", False, 401), ("boss", True, 200)):
            cookie = await _session_cookie(name, staff)
            switched = await api(world, "PUT", "/api/profiles/active", b'{"name": "coding"}', [cookie])
            assert switched.status == status
        assert runtime.current().profile == "coding"
    changes = [(c.who, c.new) async for c in SettingsChange.objects.filter(field="profile").order_by("id")]
    assert changes == [("API key ops", "quiet"), ("boss (API)", "coding")]


async def _session_cookie(name: str, staff: bool) -> tuple[bytes, bytes]:
    from asgiref.sync import sync_to_async
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.test import Client

    def login() -> str:
        user = User.objects.create_user(name, password="pw-" + name * 3, is_staff=staff)
        client = Client()
        client.force_login(user)
        return client.cookies[settings.SESSION_COOKIE_NAME].value

    value = await sync_to_async(login)()
    return (b"cookie", f"{settings.SESSION_COOKIE_NAME}={value}".encode())


async def test_the_dashboard_control_switches_for_staff_only():
    from django.contrib.auth.models import User
    from django.template import RequestContext, Template
    from django.test import RequestFactory

    from control.models import SettingsChange

    async with in_process(config(), transport=Recording()) as world:
        staff = await User.objects.acreate_user("boss", password="pw-boss-boss", is_staff=True)
        plain = await User.objects.acreate_user("someone", password="pw-some-some")
        client = served_client(world.runtime)
        await client.aforce_login(plain)
        response = await client.post("/dashboard/profile/", {"profile": "coding"})
        assert response.status_code == 302 and "/login/" in response["Location"]
        assert runtime.current().profile == ""

        await client.aforce_login(staff)
        response = await client.post("/dashboard/profile/", {"profile": "coding"})
        assert response.status_code == 302 and response["Location"] == "/dashboard/"
        assert runtime.current().profile == "coding"
        assert (await client.post("/dashboard/profile/", {"profile": "nope"})).status_code == 404
        response = await client.post("/dashboard/profile/", {"profile": ""})
        assert runtime.current().profile == ""

        # The include: a form for staff, the state for others.
        request = RequestFactory(**carrying(world.runtime)).get("/dashboard/")
        request.user = staff
        html = Template("{% load profile_control %}{% profile_control %}").render(
            RequestContext(request, {})
        )
        assert 'action="/dashboard/profile/"' in html and "coding names" in html
        request.user = plain
        html = Template("{% load profile_control %}{% profile_control %}").render(
            RequestContext(request, {})
        )
        assert "<form" not in html and "active profile: <strong>none</strong>" in html
    whos = [c.who async for c in SettingsChange.objects.filter(field="profile").order_by("id")]
    assert whos == ["boss (dashboard)", "boss (dashboard)"]


# --------------------------------------------------------------------------- multipart


async def test_use_model_name_rewrites_a_multipart_model_field():
    upstream = Recording()
    async with in_process(config(), transport=upstream) as world:
        built = httpx.Request("POST", "http://x/", data={"model": "small"}, files={"f": ("a.wav", b"abc")})
        call = Call(
            world.app,
            "/v1/audio/transcriptions",
            built.read(),
            content_type=built.headers["content-type"].encode(),
        )
        await call.done(5)
        assert call.status == 200
        raw = upstream.seen[-1][1]["raw"]
        assert b'name="model"\r\n\r\nsmall-q8\r\n' in raw and b"abc" in raw


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        # No model field: the bytes as they were.
        (b'--B\r\nContent-Disposition: form-data; name="x"\r\n\r\n1\r\n--B--\r\n', None),
        # Unquoted name, other headers, header case.
        (
            b"--B\r\nCONTENT-DISPOSITION: form-data; name=model\r\nX-A: b\r\n\r\nold\r\n--B--\r\n",
            b"--B\r\nCONTENT-DISPOSITION: form-data; name=model\r\nX-A: b\r\n\r\nnew\r\n--B--\r\n",
        ),
        # A file that happens to be named "model" is a file: untouched.
        (
            b'--B\r\nContent-Disposition: form-data; name="model"; filename="m.bin"\r\n\r\nold\r\n--B--\r\n',
            None,
        ),
        # "model_name" is another field.
        (b'--B\r\nContent-Disposition: form-data; name="model_name"\r\n\r\nold\r\n--B--\r\n', None),
    ],
)
def test_rewrite_multipart_model(body, expected):
    from proxy.routing import rewrite_multipart_model

    assert rewrite_multipart_model(body, "B", "new") == (body if expected is None else expected)


async def test_upstream_takes_the_profiles_pin_but_no_selector():
    upstream = Recording()
    async with in_process(config(), transport=upstream) as world:
        assert (await api(world, "POST", "/upstream/llm-code/x", b"{}")).status == 404
        assert (await api(world, "POST", "/upstream/pool/x", b"{}")).status == 404  # a selector
        runtime.current().profile = "coding"
        call = await api(world, "POST", "/upstream/llm-code/completion", b"{}")
        assert call.status == 200 and upstream.seen[-1][0] == "127.0.0.1:9002"
        ticket = await finished(world, call)
        assert ticket.model.id == "coder" and ticket.extra["requested_model"] == "llm-code"
        assert (await api(world, "POST", "/upstream/image/x", b"{}")).status == 404  # disabled


async def test_a_reload_keeps_the_active_profile_while_it_exists(tmp_path):
    import yaml

    from llamaswap_site.reload import Reloader

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    async with in_process(config(), transport=Recording()):
        rt = runtime.current()
        rt.profile = "coding"
        reloader = Reloader(str(path))
        assert await reloader.reload("test") is not None
        assert rt.profile == "coding"
        changed = {**CONFIG, "profiles": {"quiet": CONFIG["profiles"]["quiet"]}}
        path.write_text(yaml.safe_dump(changed))
        assert await reloader.reload("test") is not None
        assert rt.profile == "" and set(rt.config.profiles) == {"quiet"}
