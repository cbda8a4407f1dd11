"""llama-swap and llamaswap side by side on one config that sets every key of llama-swap's
config table (../shared/notes/llama-swap-reference.md): each key's effect a client can see
is compared (the same answer, or the deliberate difference of docs/llama-swap-compat.md).
One process per side for the whole module; tests/test_llamaswap_diff.py has the plain
config and the endpoint tables.

Keys and where they are checked: ``apiKeys`` (every request here carries the key;
test_keys), ``macros``/model ``macros``, ``name``, ``description``, ``metadata``,
``capabilities``, ``aliases``, ``includeAliasesInList``, ``unlisted``, ``selectors``,
``peers``, ``profiles``, ``filters.setParamsByID`` (test_models_list), ``startPort``,
``proxy``, ``cmd``, ``checkEndpoint``, ``hooks.on_startup.preload``, ``ttl``/``globalTTL``
(test_preload_and_running), ``useModelName``, ``filters.*`` (test_filters),
``sendLoadingState`` (test_loading_state), ``routing.router`` groups
(test_groups_keep_both), ``routing.scheduler`` fifo ``priority`` and ``concurrencyLimit``
(accepted; tests/test_llamaswap_diff.py has the limit), selectors and peers and profiles
(test_selector_peer_profile), ``upstream.ignorePaths`` (test_ignore_paths),
``performance.disabled`` (test_performance_disabled), ``compat.ignoreWebsockets``
(test_websockets), ``cmdStop``, ``unloadTimeout`` (test_unload_with_cmd_stop). Accepted
by both with no visible effect to compare here: ``healthCheckTimeout``, ``logLevel``,
``logTimeFormat``, ``logToStdout`` (tests/test_llamaswap_cli.py checks ours through
``serve``), ``captureBuffer`` (tests/test_e2e_llamaswap_api.py), ``env``, ``timeouts``,
``metricsMaxInMemory``, ``store.path``, ``ui.activity.session_id``, ``performance.every``
(ours warns and ignores the last four: no SQLite store, no UI, no sampling).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.conftest import pick_free_port
from tests.server import free_port_block, migrate_database
from tests.test_llamaswap_diff import (
    BINARY,
    ROOT,
    Side,
    _stop,
    _wait,
    keys,
    sse_events,
)

pytestmark = [
    pytest.mark.skipif(
        not os.access(BINARY, os.X_OK),
        reason=f"the llama-swap binary is not at {BINARY} (set LLAMA_SWAP_BIN to run the "
        "differential test against it)",
    ),
    pytest.mark.timeout(120),
    pytest.mark.services,  # CI runs it after `make test` (make test-services)
]

KEY = "sk-rich-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN = "sk-rich-admin"
"""Ours only (a second entry of its apiKeys): a plain key may use inference only here
(README, "Scopes"; llama-swap's keys reach everything): switching the profile, unloading
and /metrics take this one on our side, after the plain key's 403 is asserted."""
ADMIN_KEY = {
    "name": "admin",
    "key": ADMIN,
    "scopes": ["inference", "models", "profiles", "operator", "metrics"],
}
FAKE = f"{sys.executable} -m fakellm --host 127.0.0.1"
WS = f"{sys.executable} -m tests.ws_model"


def _settings(tmp: Path, start_port: int, peer_port: int) -> dict:
    record = tmp / "requests.jsonl"
    fake = "${fake} --port ${PORT} --record-file " + str(record)
    proxy = "http://127.0.0.1:${PORT}"
    return {
        "healthCheckTimeout": 20,
        "logLevel": "info",
        "logTimeFormat": "",
        "logToStdout": "proxy",
        "startPort": start_port,
        "globalTTL": 600,
        "unloadTimeout": 5,
        "includeAliasesInList": True,
        "sendLoadingState": False,
        "captureBuffer": 1,
        "metricsMaxInMemory": 500,
        "store": {"path": str(tmp / "activity.db")},
        "ui": {"activity": {"session_id": ["X-Session-ID"]}},
        "performance": {"disabled": True, "every": "10s"},
        "macros": {"fake": FAKE, "tag": "global"},
        "apiKeys": [KEY],
        "upstream": {"ignorePaths": [r"\.png$"]},
        "hooks": {"on_startup": {"preload": ["a"]}},
        "profiles": {"fast": {"description": "quick", "pins": {"fast-model": "b"}}},
        "selectors": {"any": {"strategy": "warm", "targets": ["a", "b"]}},
        "peers": {"far": {"proxy": f"http://127.0.0.1:{peer_port}", "models": ["remote-x"]}},
        "routing": {
            "router": {
                "use": "group",
                "settings": {
                    "groups": {"g": {"swap": False, "exclusive": True, "members": ["a", "b"]}}
                },
            },
            "scheduler": {"use": "fifo", "settings": {"fifo": {"priority": {"a": 1}}}},
        },
        "models": {
            "a": {
                "cmd": fake,
                "proxy": proxy,
                "macros": {"tag": "own"},
                "name": "A ${MODEL_ID} ${tag}",
                "description": "first",
                "aliases": ["alpha"],
                "env": ["FAKE_ENV=1"],
                "checkEndpoint": "/v1/models",
                "ttl": 120,
                "unloadTimeout": 3,
                "cmdStop": "/bin/kill -TERM ${PID}",
                "metadata": {"family": "test", "n": 1},
                "capabilities": {
                    "in": ["text", "image"],
                    "out": ["text"],
                    "tools": True,
                    "context": 4096,
                },
                "timeouts": {"connect": 5, "responseHeader": 60},
                "concurrencyLimit": 5,
            },
            "b": {
                # Loads for a second: longer than llamaswap waits before it starts a progress
                # stream (proxy.progress.PROGRESS_AFTER), however fast the process starts.
                "cmd": fake + " --load-seconds 1",
                "proxy": proxy,
                "useModelName": "upstream-b",
                "sendLoadingState": True,
                "filters": {
                    "stripParams": "temperature",
                    "setParams": {"seed": 7},
                    "setParamsByID": {"b:hot": {"top_k": 1}},
                },
            },
            "hidden": {"cmd": fake, "proxy": proxy, "unlisted": True},
            "ws": {"cmd": WS + " --port ${PORT}", "proxy": proxy},
            "wsq": {
                "cmd": WS + " --port ${PORT}",
                "proxy": proxy,
                "compat": {"ignoreWebsockets": True},
            },
        },
    }


def _start(
    tmp: Path, name: str, argv: list[str], env: dict, peer_port: int, start_port: int
) -> Side:
    tmp.mkdir()
    port = pick_free_port()
    settings = _settings(tmp, start_port, peer_port)
    if name == "llamaswap":
        settings["apiKeys"] = [KEY, ADMIN_KEY]
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(settings))
    log = tmp / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*argv, "-config", str(config), "-listen", f"127.0.0.1:{port}"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Side(
        name, f"http://127.0.0.1:{port}", proc, {"all": tmp / "requests.jsonl"}, log, settings
    )


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> Iterator[tuple[Side, Side]]:
    tmp = tmp_path_factory.mktemp("diffkeys")
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMASWAP_CONFIG", "LOG_LEVEL")}
    env.update(PYTHONUNBUFFERED="1")
    ours_env = dict(
        env, DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}", LLAMASWAP_STATE_DIR=str(tmp / "st")
    )
    migrate_database(ours_env)
    peer_port = pick_free_port()
    peer = subprocess.Popen(
        [*FAKE.split(), "--port", str(peer_port)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ports = free_port_block(16)  # one block: a side's models bind theirs only once loaded
    theirs = _start(tmp / "llama-swap", "llama-swap", [str(BINARY)], env, peer_port, ports)
    ours = _start(
        tmp / "llamaswap",
        "llamaswap",
        [sys.executable, "-m", "llamaswap_site.cli"],
        ours_env,
        peer_port,
        ports + 8,
    )
    try:
        _wait(theirs)
        _wait(ours)
        yield ours, theirs
    finally:
        _stop(theirs)
        _stop(ours)
        peer.kill()
        peer.wait(timeout=5)


def both(sides, method: str, path: str, auth: bool = True, admin: bool = False, **kwargs):
    """The same request to both sides, with the key (``admin``: ours gets :data:`ADMIN`,
    after checking that the plain key gets ``403 insufficient_scope`` there)."""
    kwargs.setdefault("timeout", 30)
    extra = kwargs.pop("headers", {})
    answers = []
    with httpx.Client(follow_redirects=False) as client:
        for side in sides:
            headers = {**(AUTH if auth else {}), **extra}
            if admin and side.name == "llamaswap":
                plain = client.request(method, side.url + path, headers=headers, **kwargs)
                assert plain.status_code == 403, plain.text
                assert plain.json()["error"]["code"] == "insufficient_scope"
                headers["Authorization"] = f"Bearer {ADMIN}"
            answers.append(client.request(method, side.url + path, headers=headers, **kwargs))
    return tuple(answers)


def received(side: Side) -> list[dict]:
    path = side.records["all"]
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def running(side: Side) -> dict[str, dict]:
    body = httpx.get(side.url + "/running", headers=AUTH, timeout=5).json()
    return {entry["model"]: entry for entry in body["running"]}


def wait_running(side: Side, model: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = running(side).get(model)
        if found is not None and found["state"] == "ready":
            return found
        assert time.monotonic() < deadline, (side.name, running(side))
        time.sleep(0.1)


# -- in order: preload first, then b's first load (the loading state) ---------------------------


def test_keys(sides):
    for path in ("/v1/models", "/running", "/upstream/a/health"):
        ours, theirs = both(sides, "GET", path, auth=False)
        assert ours.status_code == theirs.status_code == 401, path
    ours, theirs = both(sides, "GET", "/health", auth=False)
    assert ours.status_code == theirs.status_code == 200


def test_preload_and_running(sides):
    mine, its = (wait_running(side, "a") for side in sides)
    for key in ("ttl", "name", "description"):
        assert mine[key] == its[key], key
    assert mine["ttl"] == 120 and mine["name"] == "A a own"
    for record, side in zip((mine, its), sides, strict=True):
        start = side.config["startPort"]
        # startPort: ${PORT} in sorted id order (a, b, hidden, ws, wsq).
        assert record["proxy"] == f"http://127.0.0.1:{start}"


def test_models_list(sides):
    ours, theirs = both(sides, "GET", "/v1/models")
    assert ours.status_code == theirs.status_code == 200
    mine = {r["id"]: r for r in ours.json()["data"]}
    its = {r["id"]: r for r in theirs.json()["data"]}
    assert sorted(mine) == sorted(its)
    assert {"a", "alpha", "b", "b:hot", "any", "far/remote-x"} <= set(its)
    assert "hidden" not in its
    for name in ("a", "alpha"):
        record, reference = mine[name], its[name]
        assert keys(reference) <= keys(record), name
        for field in ("name", "description", "architecture", "capabilities", "context_length"):
            assert record.get(field) == reference.get(field), (name, field)
        assert record["meta"]["llamaswap"]["type"] == reference["meta"]["llamaswap"]["type"]
    assert mine["a"]["meta"]["llamaswap"]["family"] == its["a"]["meta"]["llamaswap"]["family"]
    for name in ("any", "far/remote-x"):
        assert mine[name]["meta"]["llamaswap"]["type"] == its[name]["meta"]["llamaswap"]["type"]


def test_loading_state(sides):
    """sendLoadingState on b: a streamed chat to b while it loads begins with
    reasoning_content, then the model's answer."""
    body = {"model": "b", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ours, theirs = both(sides, "POST", "/v1/chat/completions", json=body)
    assert ours.status_code == theirs.status_code == 200
    for response in (ours, theirs):
        events = sse_events(response.text)
        first = json.loads(events[0])["choices"][0]["delta"]
        assert first.get("reasoning_content"), (response.url, events[:2])
        assert events[-1] == "[DONE]"


def test_groups_keep_both(sides):
    """routing.router groups: g has swap false, so a and b run together."""
    for side in sides:
        assert {"a", "b"} <= set(running(side)), side.name


def test_filters(sides):
    body = {
        "model": "b:hot",
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.5,
        "max_tokens": 3,
    }
    ours, theirs = both(sides, "POST", "/v1/chat/completions", json=body)
    assert ours.status_code == theirs.status_code == 200
    mine, its = (received(side)[-1] for side in sides)
    assert mine["body"] == its["body"]
    assert mine["body"]["model"] == "upstream-b"  # useModelName
    assert "temperature" not in mine["body"] and mine["body"]["seed"] == 7
    assert mine["body"]["top_k"] == 1  # setParamsByID


def test_selector_peer_profile(sides):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for model in ("any", "far/remote-x", "alpha"):
        ours, theirs = both(sides, "POST", "/v1/chat/completions", json={**chat, "model": model})
        assert ours.status_code == theirs.status_code == 200, (model, ours.text, theirs.text)
    ours, theirs = both(sides, "GET", "/api/profiles")
    assert ours.status_code == theirs.status_code == 200
    assert keys(ours.json()) == keys(theirs.json())
    assert ours.json()["active"] is theirs.json()["active"] is None
    ours, theirs = both(sides, "PUT", "/api/profiles/active", admin=True, json={"name": "fast"})
    assert ours.status_code == theirs.status_code == 200, (ours.text, theirs.text)
    ours, theirs = both(sides, "POST", "/v1/chat/completions", json={**chat, "model": "fast-model"})
    assert ours.status_code == theirs.status_code == 200
    mine, its = (received(side)[-1] for side in sides)
    assert mine["body"]["model"] == its["body"]["model"]
    ours, theirs = both(sides, "PUT", "/api/profiles/active", admin=True, json={"name": None})
    assert ours.status_code == theirs.status_code == 200


def test_ignore_paths(sides):
    ours, theirs = both(sides, "GET", "/upstream/hidden/logo.png")
    assert ours.status_code == theirs.status_code == 409
    for side in sides:
        assert "hidden" not in running(side)


def test_performance_disabled(sides):
    ours, theirs = both(sides, "GET", "/api/performance")
    assert ours.status_code == theirs.status_code == 503
    assert ours.json() == theirs.json() == {"enabled": False}
    # Deliberate: our /metrics is the scheduler's, not the (disabled) system sampler's.
    ours, theirs = both(sides, "GET", "/metrics", admin=True)
    assert theirs.status_code == 503 and ours.status_code == 200


def test_websockets(sides):
    """A websocket to /upstream/ws/ loads ws and is relayed both ways; wsq
    (compat.ignoreWebsockets) is refused while not loaded, relayed once it is.
    Deliberate: a refused upgrade is 403 here (daphne's only answer) where llama-swap
    says 409."""
    for side in sides:
        url = side.url.replace("http://", "ws://")
        with connect(url + "/upstream/ws/", additional_headers=AUTH, open_timeout=30) as ws:
            hello = json.loads(ws.recv(timeout=10))["hello"]
            assert hello["path"] == "/", side.name
            ws.send("echo me")
            assert ws.recv(timeout=5) == "echo me"
            ws.send(b"\x01\x02")
            assert ws.recv(timeout=5) == b"\x01\x02"
        with pytest.raises(InvalidStatus) as refused:
            connect(url + "/upstream/wsq/", additional_headers=AUTH, open_timeout=10)
        status = refused.value.response.status_code
        assert status == (409 if side.name == "llama-swap" else 403), side.name
        assert "wsq" not in running(side)
        loaded = httpx.get(side.url + "/upstream/wsq/", headers=AUTH, timeout=30)
        assert loaded.status_code == 200, side.name
        with connect(url + "/upstream/wsq/", additional_headers=AUTH, open_timeout=10) as ws:
            assert json.loads(ws.recv(timeout=10))["hello"]["path"] == "/"


def test_unload_with_cmd_stop(sides):
    ours, theirs = both(sides, "POST", "/api/models/unload", admin=True)
    assert ours.status_code == theirs.status_code == 200
    for side in sides:
        assert running(side) == {}, side.name
