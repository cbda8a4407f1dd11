"""llama-swap and llamaswap side by side: the same config, the same requests.

The real llama-swap binary (``../shared/tools/llama-swap/llama-swap``, or
``LLAMA_SWAP_BIN``) and llamaswap (its console script, started with llama-swap's own
command line) each serve the same two simulated models (fakellm, one with a ``/`` in its
id). Each request goes to both; what a client sees (status, content type, JSON keys, SSE
framing, the CORS and redirect headers) and what the model server receives (method,
path, JSON body) must agree, except for the deliberate differences of
docs/llama-swap-compat.md, which are asserted here as such (so a change to either side
shows), and the known gaps listed there (asserted too: closing one fails the test, which
then moves it to the agreements).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import pick_free_port
from tests.server import fake_model, migrate_database

ROOT = Path(__file__).resolve().parent.parent
_CANDIDATES = [
    ROOT.parent / "shared/tools/llama-swap/llama-swap",  # beside the checkout
    Path("/work/shared/tools/llama-swap/llama-swap"),  # the machine's copy (a CI clone elsewhere)
]
BINARY = Path(
    os.environ.get("LLAMA_SWAP_BIN")
    or next((p for p in _CANDIDATES if os.access(p, os.X_OK)), _CANDIDATES[0])
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

MODELS = ("m", "org/model")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ORIGIN = "https://chat.example"


@dataclass
class Side:
    name: str
    url: str
    proc: subprocess.Popen
    records: dict[str, Path]
    log: Path
    config: dict

    def received(self, model: str) -> list[dict]:
        """What the model server received, in order (fakellm's record file)."""
        path = self.records[model]
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]


def _start(tmp: Path, name: str, argv: list[str], env: dict, ids: tuple[str, ...] = MODELS) -> Side:
    tmp.mkdir()
    port = pick_free_port()
    records = {model: tmp / f"{model.replace('/', '_')}.jsonl" for model in ids}
    models = {model: fake_model(pick_free_port(), record=records[model]) for model in ids}
    if "org/model" in models:
        models["org/model"]["concurrencyLimit"] = 2  # test_concurrency_limit_counts_the_waiting
    config = tmp / "config.yaml"
    # llama-swap's scheduler on both sides (ours defaults to the serial priority one, which
    # queues a burst rather than refusing it).
    routing = {"scheduler": {"use": "fifo"}}
    settings = {"healthCheckTimeout": 15, "models": models, "routing": routing}
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
    return Side(name, f"http://127.0.0.1:{port}", proc, records, log, settings)


def _wait(side: Side) -> None:
    deadline = time.monotonic() + 30
    while True:
        assert side.proc.poll() is None, side.log.read_text()
        try:
            if httpx.get(side.url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, side.log.read_text()
        time.sleep(0.05)


def _stop(side: Side) -> None:
    if side.proc.poll() is None:
        os.killpg(side.proc.pid, signal.SIGTERM)
    try:
        side.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(side.proc.pid, signal.SIGKILL)
        side.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def sides(tmp_path_factory) -> Iterator[tuple[Side, Side]]:
    yield from _both_sides(tmp_path_factory.mktemp("diff"), MODELS)


@pytest.fixture(scope="module")
def comfy_sides(tmp_path_factory) -> Iterator[tuple[Side, Side]]:
    """Both sides serving llama-swap's ComfyUI model, ``comfyui_auto`` (a fakellm here)."""
    yield from _both_sides(tmp_path_factory.mktemp("comfy"), ("comfyui_auto",))


def _both_sides(tmp: Path, ids: tuple[str, ...]) -> Iterator[tuple[Side, Side]]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMASWAP_CONFIG", "LOG_LEVEL")}
    env.update(PYTHONUNBUFFERED="1")
    ours_env = dict(
        env, DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}", LLAMASWAP_STATE_DIR=str(tmp / "st")
    )
    # The activity log's tables (llama-swap keeps its own in memory).
    migrate_database(ours_env)
    theirs = _start(tmp / "llama-swap", "llama-swap", [str(BINARY)], env, ids)
    ours = _start(
        tmp / "llamaswap", "llamaswap", [sys.executable, "-m", "llamaswap_site.cli"], ours_env, ids
    )
    try:
        _wait(theirs)
        _wait(ours)
        yield ours, theirs
    finally:
        _stop(theirs)
        _stop(ours)


def both(sides, method: str, path: str, **kwargs) -> tuple[httpx.Response, httpx.Response]:
    """The same request to llamaswap and to llama-swap: (ours, theirs)."""
    ours, theirs = sides
    kwargs.setdefault("timeout", 30)
    with httpx.Client(follow_redirects=False) as client:
        return tuple(client.request(method, s.url + path, **kwargs) for s in (ours, theirs))  # type: ignore[return-value]


def media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";")[0].strip()


def keys(value) -> set[str]:
    return set(value) if isinstance(value, dict) else set()


def sse_events(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, each event framed by a blank line."""
    assert body.endswith("\n\n"), body[-200:]
    events = [event for event in body.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events), events[:3]
    return [event.removeprefix("data: ") for event in events]


# -- the tests, in order: the models load on the first inference ---------------------------


def test_health(sides):
    ours, theirs = both(sides, "GET", "/health")
    assert ours.status_code == theirs.status_code == 200
    assert media_type(ours) == media_type(theirs) == "text/plain"
    assert ours.text == theirs.text == "OK"


def test_models_list(sides):
    ours, theirs = both(sides, "GET", "/v1/models")
    assert ours.status_code == theirs.status_code == 200
    assert media_type(ours) == media_type(theirs) == "application/json"
    mine, its = ours.json(), theirs.json()
    assert keys(mine) == keys(its) == {"object", "data"}
    assert [r["id"] for r in mine["data"]] == [r["id"] for r in its["data"]] == list(MODELS)
    for record, reference in zip(mine["data"], its["data"], strict=True):
        assert keys(reference) <= keys(record), (record, reference)
        assert record["owned_by"] == reference["owned_by"]
        assert record["status"] == reference["status"] == {"value": "unloaded"}
        assert record["meta"]["llamaswap"]["type"] == reference["meta"]["llamaswap"]["type"]


def test_preflight(sides):
    asked = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization, bad header",
    }
    for headers in (asked, {**asked, "Origin": ORIGIN}):
        ours, theirs = both(sides, "OPTIONS", "/v1/chat/completions", headers=headers)
        assert ours.status_code == theirs.status_code == 204
        for name in ("methods", "headers", "max-age"):
            header = (
                f"access-control-allow-{name}" if name != "max-age" else "access-control-max-age"
            )
            assert ours.headers[header] == theirs.headers[header], header
        assert theirs.headers["access-control-allow-origin"] == "*"
        if "Origin" in headers:
            # Deliberate: an origin allowedOrigins does not list is told no at the preflight.
            assert "access-control-allow-origin" not in ours.headers
        else:
            assert ours.headers["access-control-allow-origin"] == "*"


def test_cross_site_request(sides):
    """Deliberate: llama-swap serves another site's page (and echoes its Origin on
    /v1/models); llamaswap refuses it unless security.cors.allowedOrigins lists it."""
    headers = {"Origin": ORIGIN, "Sec-Fetch-Site": "cross-site"}
    ours, theirs = both(sides, "GET", "/v1/models", headers=headers)
    assert theirs.status_code == 200
    assert theirs.headers["access-control-allow-origin"] == ORIGIN
    assert ours.status_code == 403
    assert ours.json()["error"]["code"] == "cross_origin_refused"


def _last(side: Side, model: str) -> dict:
    received = side.received(model)
    assert received, f"{side.name}: {model} received nothing"
    return received[-1]


FORWARDED_DIFFERENCE = {"x-forwarded-for", "connection"}
"""Request headers only one side's model server receives (docs/llama-swap-compat.md):
llama-swap's Go reverse proxy adds ``X-Forwarded-For``; llamaswap's client says
``Connection: keep-alive`` (hop-by-hop, Go's leaves it implicit)."""


def test_chat_completion(sides):
    ours, theirs = both(sides, "POST", "/v1/chat/completions", json=CHAT)
    assert ours.status_code == theirs.status_code == 200, ours.text
    assert media_type(ours) == media_type(theirs) == "application/json"
    assert keys(ours.json()) == keys(theirs.json())
    assert ours.json()["choices"][0]["message"] == theirs.json()["choices"][0]["message"]
    # What the model received: the same method, path and body.
    mine, its = (_last(side, "m") for side in sides)
    assert (mine["method"], mine["path"], mine["body"]) == (its["method"], its["path"], its["body"])
    assert mine["headers"].get("content-type") == its["headers"].get("content-type")
    assert set(mine["headers"]) ^ set(its["headers"]) == FORWARDED_DIFFERENCE, (
        sorted(mine["headers"].items()),
        sorted(its["headers"].items()),
    )


def test_chat_completion_stream(sides):
    body = {**CHAT, "stream": True}
    ours, theirs = both(sides, "POST", "/v1/chat/completions", json=body)
    assert ours.status_code == theirs.status_code == 200
    assert media_type(ours) == media_type(theirs) == "text/event-stream"
    assert ours.headers.get("x-accel-buffering") == theirs.headers.get("x-accel-buffering")
    mine, its = sse_events(ours.text), sse_events(theirs.text)
    assert mine[-1] == its[-1] == "[DONE]"
    assert len(mine) == len(its)
    deltas = [[json.loads(e)["choices"][0]["delta"] for e in events[:-1]] for events in (mine, its)]
    assert deltas[0] == deltas[1]
    assert (_last(sides[0], "m")["body"]) == (_last(sides[1], "m")["body"])


def test_running(sides):
    ours, theirs = both(sides, "GET", "/running")
    assert ours.status_code == theirs.status_code == 200
    assert media_type(ours) == media_type(theirs) == "application/json"
    mine, its = ours.json()["running"], theirs.json()["running"]
    assert [(r["model"], r["state"]) for r in mine] == [(r["model"], r["state"]) for r in its]
    assert [(r["model"], r["state"]) for r in its] == [("m", "ready")]
    # Deliberate: ours adds the model's lane.
    assert keys(mine[0]) - keys(its[0]) == {"lane"}
    for key in ("ttl", "name", "description"):
        assert mine[0][key] == its[0][key], key
    # Each its own config's command and address (each side has a fakellm of its own).
    for records, side in zip((mine, its), sides, strict=True):
        model = side.config["models"]["m"]
        assert records[0]["proxy"] == model["proxy"]
        assert records[0]["cmd"].split() == model["cmd"].split()


def test_version(sides):
    ours, theirs = both(sides, "GET", "/api/version")
    assert ours.status_code == theirs.status_code == 200
    assert media_type(ours) == media_type(theirs) == "application/json"
    assert keys(ours.json()) == keys(theirs.json()) == {"version", "commit", "build_date"}


def test_cancel_unknown_inflight(sides):
    ours, theirs = both(sides, "POST", "/api/inflight/nope/cancel")
    assert ours.status_code == theirs.status_code == 404
    assert media_type(ours) == media_type(theirs) == "application/json"
    assert "message" in ours.json()["error"] and "message" in theirs.json()["error"]


@pytest.mark.parametrize(
    ("method", "path", "status", "location"),
    [
        ("GET", "/upstream/org/model", 301, "/upstream/org/model/"),
        ("HEAD", "/upstream/m?x=1", 301, "/upstream/m/?x=1"),
        ("POST", "/upstream/org%2Fmodel", 308, "/upstream/org/model/"),
    ],
)
def test_upstream_redirect(sides, method, path, status, location):
    ours, theirs = both(sides, method, path)
    assert ours.status_code == theirs.status_code == status
    assert ours.headers["location"] == theirs.headers["location"] == location


@pytest.mark.parametrize(
    "path", ["/upstream/org/model/v1/models", "/upstream/org%2Fmodel/v1/models?a=b"]
)
def test_upstream_passthrough_with_a_slash_in_the_id(sides, path):
    ours, theirs = both(sides, "GET", path)
    assert ours.status_code == theirs.status_code == 200, ours.text
    assert media_type(ours) == media_type(theirs)
    assert keys(ours.json()) == keys(theirs.json())
    mine, its = (_last(side, "org/model") for side in sides)
    assert (mine["method"], mine["path"]) == (its["method"], its["path"]) == ("GET", "/v1/models")


def test_bare_upstream(sides):
    ours, theirs = both(sides, "GET", "/upstream")
    assert ours.status_code == theirs.status_code == 302
    assert ours.headers["location"] == theirs.headers["location"] == "/ui/models"


@pytest.mark.parametrize("path", ["/ui/", "/ui/models", "/ui/activity", "/ui/logs", "/"])
def test_web_ui_addresses(sides, path):
    """Deliberate: llama-swap serves its web UI (``/`` redirects to ``/ui``); here a
    bookmark to it lands on the dashboard's page for the same thing."""
    ours, theirs = both(sides, "GET", path)
    if path == "/":
        assert theirs.status_code == 302 and theirs.headers["location"] == "/ui"
        assert ours.status_code in (200, 302)  # the dashboard (or its login)
        return
    assert theirs.status_code == 200 and media_type(theirs) == "text/html"
    landing = {
        "/ui/": "/",
        "/ui/models": "/models/",
        "/ui/activity": "/history/",
        "/ui/logs": "/dashboard/logs/",
    }
    assert ours.status_code == 302 and ours.headers["location"] == landing[path]


def test_hardware_and_performance(sides):
    ours, theirs = both(sides, "GET", "/api/hardware")
    assert ours.status_code == theirs.status_code == 200
    assert media_type(ours) == media_type(theirs) == "application/json"
    mine, its = ours.json(), theirs.json()
    assert keys(mine) == keys(its)
    for part in ("capture", "architecture", "operating_system", "environment", "cpu", "memory"):
        assert keys(mine[part]) == keys(its[part]), part
    for fact in ("logical_thread_count", "physical_core_count", "socket_count"):
        assert mine["cpu"][fact] == its["cpu"][fact], fact
    assert mine["architecture"]["raw_name"] == its["architecture"]["raw_name"]
    assert mine["memory"]["capacity_bytes"] == its["memory"]["capacity_bytes"]
    # Deliberate: llamaswap samples no CPU/GPU figures: performance sampling's "off" answer.
    ours, theirs = both(sides, "GET", "/api/performance")
    assert theirs.status_code == 200 and theirs.json()["enabled"] is True
    assert ours.status_code == 503 and ours.json() == {"enabled": False}


def test_metrics_and_favicon(sides):
    """Deliberate: llama-swap's /metrics has system and GPU figures only; ours the
    scheduler's and each model's (README, "Metrics"): both Prometheus text."""
    ours, theirs = both(sides, "GET", "/metrics")
    assert ours.status_code == theirs.status_code == 200
    assert media_type(ours) == media_type(theirs) == "text/plain"
    ours, theirs = both(sides, "GET", "/favicon.ico")
    assert ours.status_code == theirs.status_code == 200


def test_profiles_and_captures(sides):
    ours, theirs = both(sides, "GET", "/api/profiles")
    assert ours.status_code == theirs.status_code == 200
    assert ours.json() == theirs.json() == {"active": None, "profiles": []}
    ours, theirs = both(sides, "GET", "/api/captures/999999")
    assert ours.status_code == theirs.status_code == 404
    assert media_type(ours) == media_type(theirs) == "application/json"


@pytest.mark.parametrize(
    "path",
    ["/logs/stream", "/logs/stream/proxy", "/logs/stream/upstream", "/logs/stream/m"],
)
def test_log_streams(sides, path):
    """The same status and framing (a chunked text stream that stays open)."""
    for side in sides:
        with httpx.Client(timeout=10) as client, client.stream("GET", side.url + path) as r:
            assert r.status_code == 200, (side.name, path)
            assert media_type(r) == "text/plain", (side.name, r.headers)
            assert r.headers.get("transfer-encoding") == "chunked", (side.name, r.headers)


def test_comfyui_without_its_model(sides):
    ours, theirs = both(sides, "GET", "/comfyui/")
    assert ours.status_code == theirs.status_code == 404  # no comfyui_auto in this config
    assert media_type(ours) == media_type(theirs) == "application/json"
    message = ours.json()["error"]["message"]
    assert message == theirs.json()["error"]["message"] == "local model comfyui_auto not found"


# -- /comfyui (its own pair of servers: the model comfyui_auto) -------------------------------


def _comfy_state(side: Side) -> str | None:
    running = httpx.get(side.url + "/running", timeout=5).json()["running"]
    return next((r["state"] for r in running if r["model"] == "comfyui_auto"), None)


@pytest.mark.parametrize(("method", "status"), [("GET", 301), ("HEAD", 301), ("POST", 308)])
def test_comfyui_redirect(comfy_sides, method, status):
    ours, theirs = both(comfy_sides, method, "/comfyui?token=value")
    assert ours.status_code == theirs.status_code == status
    assert ours.headers["location"] == theirs.headers["location"] == "/comfyui/?token=value"


def test_comfyui_only_its_root_starts_the_model(comfy_sides):
    ours, theirs = both(comfy_sides, "POST", "/comfyui/v1/chat/completions", json=CHAT)
    assert ours.status_code == theirs.status_code == 409
    assert media_type(ours) == media_type(theirs) == "application/json"
    message = ours.json()["error"]["message"]
    assert message == theirs.json()["error"]["message"]
    assert message == "model comfyui_auto is not loaded; only /comfyui/ can start it"
    assert [_comfy_state(side) for side in comfy_sides] == [None, None]
    assert all(side.received("comfyui_auto") == [] for side in comfy_sides)
    # The root loads it and reaches the model's root (fakellm: 404 to a GET there).
    ours, theirs = both(comfy_sides, "GET", "/comfyui/?token=value")
    assert ours.status_code == theirs.status_code == 404
    assert media_type(ours) == media_type(theirs) == "application/json"
    assert [_comfy_state(side) for side in comfy_sides] == ["ready", "ready"]
    mine, its = (_last(side, "comfyui_auto") for side in comfy_sides)
    assert (mine["method"], mine["path"]) == (its["method"], its["path"]) == ("GET", "/")


@pytest.mark.parametrize(
    ("method", "path", "reaches"),
    [
        ("POST", "/comfyui/v1/chat/completions", "/v1/chat/completions"),
        ("GET", "/comfyui/v1/models?a=b", "/v1/models"),
        ("GET", "/comfyui/slots", "/slots"),  # every path: upstream.allowPaths is /upstream's
        ("GET", "/comfyui/api/userdata/workflows%2Fexample.json", None),
    ],
)
def test_comfyui_passes_every_path_through_once_loaded(comfy_sides, method, path, reaches):
    assert all(
        httpx.get(side.url + "/comfyui/", timeout=30).status_code == 404 for side in comfy_sides
    )
    body = CHAT if method == "POST" else None
    ours, theirs = both(comfy_sides, method, path, json=body)
    assert ours.status_code == theirs.status_code, (ours.text, theirs.text)
    assert media_type(ours) == media_type(theirs)
    mine, its = (_last(side, "comfyui_auto") for side in comfy_sides)
    assert (mine["method"], mine["path"], mine["body"]) == (its["method"], its["path"], its["body"])
    if reaches is not None:
        assert mine["path"] == reaches


def test_unknown_model_errors(sides):
    for method, path, body in (
        ("POST", "/v1/chat/completions", {"model": "nope", "messages": []}),
        ("GET", "/upstream/nope/x", None),
        ("POST", "/api/models/unload/org/nope", None),
    ):
        ours, theirs = both(sides, method, path, json=body)
        assert ours.status_code == theirs.status_code == 404, path
        assert media_type(ours) == media_type(theirs) == "application/json"
        mine, its = ours.json()["error"], theirs.json()["error"]
        assert {"message", "type", "code"} <= keys(mine) & keys(its)
        assert mine["type"] == its["type"] == "invalid_request_error"
        # Deliberate: our codes name the case; llama-swap adds "src" and "param": null.
        assert keys(theirs.json()) - keys(ours.json()) == {"src"}


def test_logs(sides):
    ours, theirs = both(sides, "GET", "/logs")
    assert ours.status_code == theirs.status_code == 200
    assert media_type(ours) == media_type(theirs) == "text/plain"
    # Deliberate: ours holds the models' output whatever logToStdout says; llama-swap's
    # follows logToStdout (default proxy: its own lines, no model output).
    assert "[m] fakellm: listening on" in ours.text and "[INFO]" not in ours.text
    assert "[INFO] Request" in theirs.text and "fakellm" not in theirs.text


def test_unload(sides):
    ours, theirs = both(sides, "POST", "/api/models/unload/org/model")
    assert ours.status_code == theirs.status_code == 200
    assert ours.text == theirs.text == "OK"
    ours, theirs = both(sides, "POST", "/api/models/unload")
    assert ours.status_code == theirs.status_code == 200
    assert ours.json() == theirs.json() == {"msg": "ok"}
    ours, theirs = both(sides, "GET", "/unload")
    assert ours.status_code == theirs.status_code == 200
    assert ours.text == theirs.text == "OK"
    ours, theirs = both(sides, "GET", "/running")
    assert ours.json() == theirs.json() == {"running": []}


def _first_events(side: Side) -> dict[str, list]:
    """The messages /api/events sends on connect, by type (read until inflight's snapshot,
    the last of them on both sides)."""
    seen: dict[str, list] = {}
    buffer = b""
    with httpx.Client(timeout=10) as client, client.stream("GET", side.url + "/api/events") as r:
        assert r.status_code == 200
        assert media_type(r) == "text/event-stream" and r.headers["x-accel-buffering"] == "no"
        for chunk in r.iter_raw():
            buffer += chunk
            *done, buffer = buffer.split(b"\n\n")
            for block in done:
                kind, data = block.decode().split("\n")
                assert kind == "event:message" and data.startswith("data:")
                envelope = json.loads(data[5:])
                assert set(envelope) == {"type", "data"}
                seen.setdefault(envelope["type"], []).append(json.loads(envelope["data"]))
            if "inflight" in seen:
                return seen
    raise AssertionError(seen)


def test_events_on_connect(sides):
    """The same event names, framing and payload keys (docs/llama-swap-compat.md)."""
    mine, its = (_first_events(side) for side in sides)
    assert (
        set(mine)
        == set(its)
        == {
            "logData",
            "modelStatus",
            "uiConfig",
            "profileChanged",
            "inflight",
        }
    )
    assert [keys(m) for m in mine["logData"]] == [keys(m) for m in its["logData"]]
    assert [m["source"] for m in mine["logData"]] == [m["source"] for m in its["logData"]]
    assert mine["uiConfig"] == its["uiConfig"]
    assert mine["profileChanged"] == its["profileChanged"]
    assert mine["inflight"] == its["inflight"] == [{"operation": "snapshot"}]
    [my_models], [their_models] = mine["modelStatus"], its["modelStatus"]
    assert [m["id"] for m in my_models] == [m["id"] for m in their_models]
    for record, reference in zip(my_models, their_models, strict=True):
        assert keys(record) == keys(reference)
        assert record["state"] == reference["state"]


@pytest.mark.parametrize(
    ("method", "path", "reaches"),
    [
        ("POST", "/v1/messages/count_tokens", "/v1/messages/count_tokens"),
        ("POST", "/v1/messages", "/v1/messages"),
        ("POST", "/v1/responses", "/v1/responses"),
        ("POST", "/v1/completions", "/v1/completions"),
        ("POST", "/v1/embeddings", "/v1/embeddings"),
        ("POST", "/v1/rerank", "/v1/rerank"),
        ("POST", "/v1/reranking", "/v1/reranking"),
        ("POST", "/rerank", "/rerank"),
        ("POST", "/reranking", "/reranking"),
        ("POST", "/infill", "/infill"),
        ("POST", "/completion", "/completion"),
        ("POST", "/v1/audio/speech", "/v1/audio/speech"),
        ("POST", "/v1/images/generations", "/v1/images/generations"),
        ("POST", "/sdapi/v1/img2img", "/sdapi/v1/img2img"),
        ("POST", "/v/responses", "/responses"),
        ("POST", "/v/completions", "/completions"),
        ("POST", "/v/messages", "/messages"),
        ("POST", "/v/messages/count_tokens", "/messages/count_tokens"),
        ("POST", "/v/embeddings", "/embeddings"),
        ("POST", "/v/rerank", "/rerank"),
        ("POST", "/v/reranking", "/reranking"),
        ("POST", "/v/chat/completions", "/chat/completions"),
        ("POST", "/audioapi/v1/tasks/run", "/v1/tasks/run"),
        ("POST", "/sdapi/v1/txt2img", "/sdapi/v1/txt2img"),
        ("POST", "/v1/audio/voices", "/v1/audio/voices"),
        ("GET", "/v1/audio/voices?model=m", "/v1/audio/voices"),
        ("GET", "/props?model=m", "/props"),
        ("GET", "/sdapi/v1/loras?model=m", "/sdapi/v1/loras"),
    ],
)
def test_other_model_routes(sides, method, path, reaches):
    body = {"model": "m", "prompt": "x"} if method == "POST" else None
    ours, theirs = both(sides, method, path, json=body)
    assert ours.status_code == theirs.status_code, (ours.text, theirs.text)
    mine, its = (_last(side, "m") for side in sides)
    assert (mine["method"], mine["path"]) == (its["method"], its["path"]) == (method, reaches)
    assert mine["body"] == its["body"]


@pytest.mark.parametrize("path", ["/v1/images/edits", "/v1/audio/transcriptions"])
def test_multipart_routes_by_the_form_field(sides, path):
    form = {"data": {"model": "m", "prompt": "a cat"}, "files": {"image": ("a.png", b"PNG")}}
    ours, theirs = both(sides, "POST", path, **form)
    assert ours.status_code == theirs.status_code == 200
    mine, its = (_last(side, "m") for side in sides)
    assert mine["path"] == its["path"] == path
    assert mine["body"] == its["body"]


def test_activity_and_stats_shapes(sides):
    ours, theirs = both(sides, "GET", "/api/metrics/activity?limit=5&sort=id&order=desc")
    assert ours.status_code == theirs.status_code == 200
    mine, its = ours.json(), theirs.json()
    # Deliberate: ours adds "pages" and "has_more" (docs/llama-swap-compat.md).
    assert keys(its) <= keys(mine)
    assert its["data"] and mine["data"]
    row, reference = mine["data"][0], its["data"][0]
    # resp_content_type aside, every key of llama-swap's row; "metadata" is ours there.
    assert keys(reference) - {"metadata"} <= keys(row)
    assert keys(row["tokens"]) == keys(reference["tokens"])
    ours, theirs = both(sides, "GET", "/api/metrics/stats")
    assert ours.status_code == theirs.status_code == 200
    assert keys(ours.json()) == keys(theirs.json())
    ours, theirs = both(sides, "GET", "/api/metrics/activity?sort=nope")
    assert ours.status_code == theirs.status_code == 400


def test_wol_health(sides):
    ours, theirs = both(sides, "GET", "/wol-health")
    assert ours.status_code == theirs.status_code == 200
    assert media_type(ours) == media_type(theirs) == "text/plain"
    assert ours.text == theirs.text == "OK"


def test_models_alias(sides):
    """Deliberate: llama-swap's /models is its model list; here /models/ is the
    dashboard's models page (a browser's), and /models redirects to it."""
    ours, theirs = both(sides, "GET", "/models")
    assert theirs.status_code == 200 and media_type(theirs) == "application/json"
    assert ours.status_code in (301, 302) and ours.headers["location"].endswith("/models/")


def test_concurrency_limit_counts_the_waiting(sides):
    """fifo's concurrencyLimit (2 for org/model) counts waiting requests too: of a burst of
    four, two are served and two get 429 at once, on both sides."""
    from concurrent.futures import ThreadPoolExecutor

    body = {"model": "org/model", "messages": [], "fake_delay": 1}
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(httpx.post, side.url + "/v1/chat/completions", json=body, timeout=30)
            for side in sides
            for _ in range(4)
        ]
        answers = [f.result() for f in futures]
    mine, its = answers[:4], answers[4:]
    assert sorted(r.status_code for r in its) == [200, 200, 429, 429]
    assert sorted(r.status_code for r in mine) == [200, 200, 429, 429]
    refused = [r for r in mine + its if r.status_code == 429]
    assert all(media_type(r) == "application/json" for r in refused)
    assert all(r.json()["error"]["type"] for r in refused)
