"""Websocket passthrough on ``/upstream/{model}/...`` (and llama-swap's ``/comfyui/...``,
HTTP too) through the real server: a real
``serve`` subprocess, a real websocket model server (tests/ws_model.py) started by it, and
the ``websockets`` client as the user's browser or script."""

from __future__ import annotations

import json
import sys
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.server import free_port_block, serve

pytestmark = pytest.mark.timeout(60)


ALLOW = ["^/$", "^/(ws|socket|prompt|refuse)$"]
"""A ComfyUI-style server's paths (its socket, its prompt route); not ``/slots``."""


def ws_model(port: int, **keys) -> dict:
    return {
        "cmd": f"{sys.executable} -m tests.ws_model --port {port}",
        "proxy": f"http://127.0.0.1:{port}",
        **keys,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port_block(5)
    models = {
        "comfy": ws_model(port),
        "org/comfy": ws_model(port + 1, timeouts={"idle": 1}),
        "quiet": ws_model(port + 2, compat={"ignoreWebsockets": True}),
        "other": ws_model(port + 3),
        # llama-swap's /comfyui model; its compat.ignoreWebsockets is forced on.
        "comfyui_auto": ws_model(port + 4, compat={"ignoreWebsockets": False}),
    }
    extra = {"upstream": {"allowPaths": ALLOW}}
    with serve(tmp_path_factory.mktemp("wsproxy"), models, extra) as srv:
        srv.ports = {"comfy": port, "org/comfy": port + 1, "quiet": port + 2, "other": port + 3}
        yield srv


def ws_url(server, path: str) -> str:
    return server.url.replace("http://", "ws://") + path


def running(server) -> dict[str, str]:
    body = httpx.get(server.url + "/running", timeout=5).json()
    return {entry["model"]: entry["state"] for entry in body["running"]}


def hello(ws: ClientConnection) -> dict:
    return json.loads(ws.recv(timeout=10))["hello"]


def closed(ws: ClientConnection) -> tuple[int, str]:
    """The close code and reason the server sent."""
    with pytest.raises(ConnectionClosed) as info:
        ws.recv(timeout=10)
    assert info.value.rcvd is not None, "closed without a close frame"
    return info.value.rcvd.code, info.value.rcvd.reason


def unload(server, model: str | None = None) -> None:
    path = "/api/models/unload" + (f"/{model}" if model else "")
    assert httpx.post(server.url + path, timeout=30).status_code == 200


def test_a_websocket_loads_its_model_then_relays_text_and_binary_both_ways(server):
    unload(server)
    assert "comfy" not in running(server)
    with connect(
        ws_url(server, "/upstream/comfy/ws?clientId=42"),
        subprotocols=["comfy"],  # type: ignore[list-item]
        additional_headers={"X-Custom": "kept"},
        open_timeout=30,
    ) as ws:
        seen = hello(ws)
        assert seen["path"] == "/ws?clientId=42"
        assert seen["subprotocol"] == "comfy" and ws.subprotocol == "comfy"
        assert seen["headers"]["x-custom"] == "kept"
        assert running(server)["comfy"] == "ready"
        ws.send("text frame")
        assert ws.recv(timeout=5) == "text frame"
        ws.send(b"\x00\xffbinary")
        assert ws.recv(timeout=5) == b"\x00\xffbinary"


def test_a_relay_loses_no_frame_to_a_slow_reader_or_a_fast_sender(server):
    # The dashboard's socket keeps only the newest state when its reader lags and closes a
    # sender of more than 10 messages a second; a relayed socket's frames are the model's
    # data: every one arrives, in order.
    with connect(ws_url(server, "/upstream/other/ws"), open_timeout=30) as ws:
        hello(ws)
        for i in range(300):
            ws.send(f"m{i}")
        assert [ws.recv(timeout=10) for _ in range(300)] == [f"m{i}" for i in range(300)]
        ws.send("burst:400:16384")  # 6.5 MB, past the kernel's and Twisted's buffers
        time.sleep(1)  # a reader that lags behind on purpose
        got = [ws.recv(timeout=10) for _ in range(400)]
        assert [int.from_bytes(m[:4], "big") for m in got] == list(range(400))
        assert all(len(m) == 16384 for m in got)


def test_ids_with_a_slash_work_as_over_http(server):
    with connect(ws_url(server, "/upstream/org/comfy/socket"), open_timeout=30) as ws:
        assert hello(ws)["path"] == "/socket"


def test_close_codes_pass_both_ways(server):
    """Codes pass; reasons do not (daphne's ASGI close carries none, either way)."""
    with connect(ws_url(server, "/upstream/comfy/ws"), open_timeout=30) as ws:
        hello(ws)
        ws.send("close:4001:done here")
        assert closed(ws)[0] == 4001
    with connect(ws_url(server, "/upstream/comfy/ws"), open_timeout=30) as ws:
        hello(ws)
        ws.close(4002, "client leaves")
    port = server.ports["comfy"]
    deadline = time.monotonic() + 5
    while True:
        last = httpx.get(f"http://127.0.0.1:{port}/last-close", timeout=5).json()
        if last or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert last["code"] == 4002


def test_an_open_socket_does_not_hold_the_models_turn(server):
    """A ComfyUI-style UI keeps its socket open and posts over HTTP through /upstream."""
    with connect(ws_url(server, "/upstream/comfy/ws"), open_timeout=30) as ws:
        hello(ws)
        r = httpx.get(server.url + "/upstream/comfy/prompt", timeout=10)
        assert r.status_code == 200 and r.text == "plain HTTP\n"
        ws.send("still here")
        assert ws.recv(timeout=5) == "still here"


def test_the_model_going_away_closes_the_client_with_4012(server):
    with connect(ws_url(server, "/upstream/other/ws"), open_timeout=30) as ws:
        hello(ws)
        unload(server, "other")
        assert closed(ws)[0] == 4012  # 1012 service restart (daphne sends only 1000, 3000-4999)


def test_a_message_over_the_limit_from_the_model_closes_with_4009(server):
    from proxy.wsproxy import MAX_MESSAGE_BYTES

    with connect(ws_url(server, "/upstream/comfy/ws"), open_timeout=30, max_size=None) as ws:
        hello(ws)
        ws.send(f"big:{MAX_MESSAGE_BYTES // 2}")
        assert len(ws.recv(timeout=10)) == MAX_MESSAGE_BYTES // 2
        ws.send(f"big:{MAX_MESSAGE_BYTES + 1}")
        assert closed(ws)[0] == 4009


def test_an_idle_socket_is_closed_after_the_models_idle_timeout(server):
    with connect(ws_url(server, "/upstream/org/comfy/ws"), open_timeout=30) as ws:
        hello(ws)
        started = time.monotonic()
        assert closed(ws)[0] == 4001
        assert 0.5 < time.monotonic() - started < 5


def test_ignore_websockets_never_loads_the_model(server):
    unload(server, "quiet")
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(server, "/upstream/quiet/ws"), open_timeout=10)
    assert refused.value.response.status_code == 403
    assert "quiet" not in running(server)
    assert "not loaded (compat.ignoreWebsockets)" in server.log_path.read_text()
    # Loaded by an HTTP request, the model takes websockets.
    assert httpx.get(server.url + "/upstream/quiet/", timeout=30).status_code == 200
    with connect(ws_url(server, "/upstream/quiet/ws"), open_timeout=10) as ws:
        assert hello(ws)["path"] == "/ws"


@pytest.mark.parametrize(
    ("path", "headers", "logged"),
    [
        ("/upstream/nothing/ws", {}, "model 'nothing' not found"),
        ("/upstream/comfy", {}, "no path after the model"),
        ("/upstream/comfy/slots", {}, "/slots is not in upstream.allowPaths"),
        ("/upstream/comfy/ws", {"Origin": "https://evil.example"}, None),
        ("/upstream/comfy/refuse", {}, "refused the websocket: HTTP 404"),
    ],
)
def test_refusals_happen_before_the_handshake(server, path, headers, logged):
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(server, path), additional_headers=headers, open_timeout=30)
    assert refused.value.response.status_code == 403
    if logged is not None:
        assert logged in server.log_path.read_text()


# -- /comfyui: llama-swap's passthrough to the model comfyui_auto ------------------------------


@pytest.mark.parametrize(("method", "status"), [("GET", 301), ("HEAD", 301), ("POST", 308)])
def test_bare_comfyui_is_redirected_to_its_root_with_the_query(server, method, status):
    r = httpx.request(method, server.url + "/comfyui?token=value", timeout=5)
    assert r.status_code == status and r.headers["location"] == "/comfyui/?token=value"


def test_only_the_comfyui_root_starts_its_model(server):
    unload(server, "comfyui_auto")
    # A stale tab's API call, asset or socket: refused, nothing loads.
    r = httpx.post(server.url + "/comfyui/api/prompt", json={}, timeout=10)
    assert r.status_code == 409
    error = r.json()["error"]
    assert error["code"] == "model_not_loaded"
    assert error["message"] == "model comfyui_auto is not loaded; only /comfyui/ can start it"
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url(server, "/comfyui/ws"), open_timeout=10)
    assert refused.value.response.status_code == 403
    with pytest.raises(InvalidStatus):  # the root's socket neither (ignoreWebsockets, forced)
        connect(ws_url(server, "/comfyui/"), open_timeout=10)
    assert "comfyui_auto" not in running(server)
    # The root loads it, and reaches the model's own root with the query.
    r = httpx.get(server.url + "/comfyui/?token=value", timeout=30)
    assert r.status_code == 200 and r.text == "plain HTTP\n"
    assert r.headers["x-path"] == "/?token=value"
    assert running(server)["comfyui_auto"] == "ready"


@pytest.mark.parametrize(
    ("sent", "received"),
    [
        # any path of the model (upstream.allowPaths names a llama-server's), as encoded
        (
            "/comfyui/api/userdata/workflows%2Fexample.json?preview=1",
            "/api/userdata/workflows%2Fexample.json?preview=1",
        ),
        (
            "/comfyui/api/userdata/workflows%252Fexample.json",
            "/api/userdata/workflows%252Fexample.json",
        ),
        ("/comfyui/api/%E2%9C%93%2Ffile.json", "/api/%E2%9C%93%2Ffile.json"),
    ],
)
def test_a_loaded_comfyui_gets_every_path_as_the_client_encoded_it(server, sent, received):
    assert httpx.get(server.url + "/comfyui/", timeout=30).status_code == 200
    r = httpx.get(server.url + sent, timeout=10)  # tests/ws_model.py takes GETs only
    assert r.status_code == 200 and r.headers["x-path"] == received


def test_a_loaded_comfyuis_socket_is_relayed_and_takes_no_turn(server):
    assert httpx.get(server.url + "/comfyui/", timeout=30).status_code == 200
    with connect(ws_url(server, "/comfyui/ws?clientId=7"), open_timeout=10) as ws:
        assert hello(ws)["path"] == "/ws?clientId=7"
        r = httpx.get(server.url + "/comfyui/prompt", timeout=10)
        assert r.status_code == 200
        ws.send("still here")
        assert ws.recv(timeout=5) == "still here"


def test_comfyui_is_refused_for_a_dot_segment(server):
    assert httpx.get(server.url + "/comfyui/", timeout=30).status_code == 200
    r = httpx.get(server.url + "/comfyui/a/%2E%2E/secret", timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "path_not_allowed"


def test_api_keys_guard_websockets_as_they_guard_http(tmp_path):
    port = free_port_block(1)
    extra = {"apiKeys": ["sk-test"], "upstream": {"allowPaths": ALLOW}}
    with serve(tmp_path, {"comfy": ws_model(port)}, extra) as srv:
        url = ws_url(srv, "/upstream/comfy/ws")
        with pytest.raises(InvalidStatus) as refused:
            connect(url, open_timeout=10)
        assert refused.value.response.status_code == 403
        assert "comfy" not in running_with_key(srv)
        with connect(
            url, additional_headers={"Authorization": "Bearer sk-test"}, open_timeout=30
        ) as ws:
            seen = hello(ws)
            # The key is this server's, never passed to the model (as over HTTP).
            assert "authorization" not in seen["headers"]


def running_with_key(server) -> dict[str, str]:
    body = httpx.get(
        server.url + "/running", headers={"Authorization": "Bearer sk-test"}, timeout=5
    ).json()
    return {entry["model"]: entry["state"] for entry in body["running"]}


@pytest.mark.parametrize(
    ("code", "sent"),
    [
        (1000, 1000),
        (4001, 4001),
        (3000, 3000),
        (1001, 4001),
        (1009, 4009),
        (1012, 4012),
        (5000, 1000),
    ],
)
def test_close_codes_daphne_cannot_send_go_as_4xxx(code, sent):
    from proxy.wsproxy import client_code

    assert client_code(code) == sent


async def test_sockets_over_the_cap_are_refused_before_the_handshake(monkeypatch):
    from proxy import wsproxy

    monkeypatch.setattr(wsproxy, "_relays", wsproxy.MAX_RELAYS)
    sent = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    await wsproxy.app({"type": "websocket", "path": "/upstream/m/ws"}, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008}]
    assert wsproxy._relays == wsproxy.MAX_RELAYS  # nothing counted for a refused one
