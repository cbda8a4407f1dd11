"""llama-swap's smaller keys, in-process through the ASGI app: ``includeAliasesInList``,
``upstream.ignorePaths``, ``capabilities``, ``metadata``, ``logToStdout``, ``logTimeFormat``."""

from __future__ import annotations

import datetime
import json
import logging
import textwrap

import httpx
import pytest
import yaml

from llamaswap_site.logfmt import KeyValueFormatter, apply_log_config, go_time
from scheduler.config import parse_config
from scheduler.process import LogBuffer, ModelState
from tests.asgi import Body, Call, in_process


def _config(text: str):
    return parse_config(yaml.safe_load(textwrap.dedent(text)), environ={})


MODELS = """
models:
  vision:
    cmd: fake
    proxy: http://127.0.0.1:9
    name: "  Vision 7B "
    aliases: [gpt-4o, eyes]
    capabilities: {in: [text, image], out: [text], tools: true, context: 32768}
    metadata:
      family: qwen
      context_length: 1          # the capabilities own this field: dropped
      tags: [a, b]
  whisper:
    cmd: fake
    proxy: http://127.0.0.1:9
    capabilities: {in: [audio], out: [text]}
  plain:
    cmd: fake
    proxy: http://127.0.0.1:9
    metadata: {port: 5, context_length: 7}   # no capabilities: kept as given
  hidden:
    cmd: fake
    proxy: http://127.0.0.1:9
    unlisted: true
    aliases: [secret]
"""


async def _get(app, path: str) -> Call:
    call = Call(app, path, b"", method="GET")
    await call.done(timeout=10)
    return call


def _answer(request: httpx.Request) -> httpx.Response:
    body = json.dumps({"path": request.url.path}).encode()
    return httpx.Response(200, headers={"content-type": "application/json"}, stream=Body(body))


# -- /v1/models: capabilities, metadata, includeAliasesInList ----------------------------------


async def test_models_publish_capabilities_and_metadata_as_llama_swap():
    async with in_process(_config(MODELS)) as world:
        call = await _get(world.app, "/v1/models")
    assert call.status == 200
    records = {r["id"]: r for r in json.loads(call.body)["data"]}
    assert list(records) == ["plain", "vision", "whisper"]  # sorted, unlisted hidden, no aliases
    vision = records["vision"]
    assert vision["name"] == "Vision 7B"  # trimmed
    assert vision["architecture"] == {
        "input_modalities": ["text", "image"],
        "output_modalities": ["text"],
        "modality": "text+image->text",
    }
    assert vision["capabilities"] == {"vision": True, "function_calling": True}
    assert vision["supported_parameters"] == ["tools", "tool_choice"]
    assert vision["context_length"] == 32768
    assert vision["meta"] == {
        "llamaswap": {
            "family": "qwen",
            "tags": ["a", "b"],
            "type": "model",
            "aliases": ["gpt-4o", "eyes"],
        },
        "n_ctx": 32768,
    }
    assert vision["status"] == {"value": "unloaded"}
    whisper = records["whisper"]
    assert whisper["capabilities"] == {"audio_transcriptions": True}
    assert "supported_parameters" not in whisper and "context_length" not in whisper
    assert whisper["meta"] == {"llamaswap": {"type": "model"}}
    plain = records["plain"]
    assert "architecture" not in plain and "capabilities" not in plain
    assert plain["meta"] == {"llamaswap": {"port": 5, "context_length": 7, "type": "model"}}


async def test_include_aliases_in_list_adds_a_record_per_alias():
    config = _config("includeAliasesInList: true\n" + textwrap.dedent(MODELS))
    async with in_process(config) as world:
        call = await _get(world.app, "/v1/models")
    records = {r["id"]: r for r in json.loads(call.body)["data"]}
    # Sorted by id; the unlisted model's alias stays hidden too.
    assert list(records) == ["eyes", "gpt-4o", "plain", "vision", "whisper"]
    alias = records["gpt-4o"]
    assert alias["meta"]["llamaswap"] == {
        "family": "qwen",
        "tags": ["a", "b"],
        "type": "alias",
        "modelID": "vision",
    }
    assert alias["capabilities"] == records["vision"]["capabilities"]
    assert alias["name"] == "Vision 7B"


async def test_models_say_which_model_is_loaded():
    transport = httpx.MockTransport(_answer)
    async with in_process(_config(MODELS), transport=transport) as world:
        call = Call(
            world.app,
            "/v1/chat/completions",
            json.dumps({"model": "eyes", "messages": []}).encode(),
        )
        await call.done(timeout=10)
        assert call.status == 200
        listed = await _get(world.app, "/v1/models")
    status = {r["id"]: r["status"]["value"] for r in json.loads(listed.body)["data"]}
    assert status == {"plain": "unloaded", "vision": "loaded", "whisper": "unloaded"}


# -- upstream.ignorePaths -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "/upstream/vision/assets/app.js",
        "/upstream/gpt-4o/favicon.ico",
        "/upstream/vision/x/robots.txt",
    ],
)
async def test_ignored_path_is_refused_while_the_model_is_not_loaded(path):
    served: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        served.append(request.url.path)
        return _answer(request)

    async with in_process(_config(MODELS), transport=httpx.MockTransport(answer)) as world:
        call = await _get(world.app, path)
        assert call.status == 409
        error = json.loads(call.body)["error"]
        assert error["message"] == "model vision is not loaded; path matches upstream.ignorePaths"
        assert error["code"] == "model_not_loaded"
        assert call.headers[b"content-type"] == b"application/json"
        # Nothing loaded, no turn taken, nothing sent.
        assert world.dispatcher.model_state() == (None, ModelState.STOPPED)
        assert world.factory.processes == {}
        assert world.recorder.finished == {}
        assert served == []


async def test_ignored_path_passes_once_the_model_is_ready():
    async with in_process(_config(MODELS), transport=httpx.MockTransport(_answer)) as world:
        loaded = await _get(world.app, "/upstream/vision/")  # not ignored: loads the model
        assert loaded.status == 200
        assert world.dispatcher.model_state() == ("vision", ModelState.READY)
        call = await _get(world.app, "/upstream/vision/static/app.js")
        assert call.status == 200
        assert json.loads(call.body) == {"path": "/static/app.js"}
        # Another model's asset still cannot swap the loaded one out.
        other = await _get(world.app, "/upstream/plain/app.css")
        assert other.status == 409
        assert world.dispatcher.model_state() == ("vision", ModelState.READY)


async def test_configured_ignore_paths_replace_the_default():
    config = _config('upstream: {ignorePaths: ["^/ui/"]}\n' + textwrap.dedent(MODELS))
    async with in_process(config, transport=httpx.MockTransport(_answer)) as world:
        refused = await _get(world.app, "/upstream/plain/ui/index.html")
        assert refused.status == 409
        assert world.factory.processes == {}
        allowed = await _get(world.app, "/upstream/plain/app.js")  # the default no longer applies
        assert allowed.status == 200
        assert world.dispatcher.model_state() == ("plain", ModelState.READY)


# -- logToStdout --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "echoed"), [("proxy", False), ("none", False), ("upstream", True), ("both", True)]
)
async def test_log_to_stdout_echoes_model_output(capsysbinary, setting, echoed):
    config = _config(f"logToStdout: {setting}\n" + textwrap.dedent(MODELS))
    async with in_process(config, transport=httpx.MockTransport(_answer)) as world:
        apply_log_config(config, world.dispatcher.logs)
        call = await _get(world.app, "/upstream/plain/")
        assert call.status == 200
        logs = world.dispatcher.logs
    history = logs.history()  # after the stop: its lines too
    out = capsysbinary.readouterr().out
    assert b"[plain] fake model" in history  # /logs has the lines either way
    assert (b"[plain] fake model" in out) is echoed
    if echoed:
        assert out == history  # the same lines, prefixed as the combined log


@pytest.mark.parametrize(
    ("setting", "level"),
    [
        ("proxy", logging.NOTSET),
        ("both", logging.NOTSET),
        ("upstream", logging.WARNING),
        ("none", logging.WARNING),
    ],
)
def test_log_to_stdout_quiets_our_own_log_without_losing_errors(setting, level):
    handlers = logging.getLogger("llamaswap").handlers
    assert handlers
    config = _config(f"logToStdout: {setting}\n" + textwrap.dedent(MODELS))
    try:
        apply_log_config(config, LogBuffer())
        assert [h.level for h in handlers] == [level] * len(handlers)
    finally:
        apply_log_config(_config(MODELS))
    assert [h.level for h in handlers] == [logging.NOTSET] * len(handlers)


# -- logTimeFormat ------------------------------------------------------------------------------

UTC = datetime.UTC
MOMENT = datetime.datetime(2026, 1, 2, 15, 4, 5, 123400, tzinfo=UTC)  # Go's reference, in 2026
EAST = MOMENT.astimezone(datetime.timezone(datetime.timedelta(hours=5, minutes=30)))


@pytest.mark.parametrize(
    ("layout", "moment", "expected"),
    [
        ("ansic", MOMENT, "Fri Jan  2 15:04:05 2026"),
        ("unixdate", MOMENT, "Fri Jan  2 15:04:05 UTC 2026"),
        ("rubydate", MOMENT, "Fri Jan 02 15:04:05 +0000 2026"),
        ("rfc822", MOMENT, "02 Jan 26 15:04 UTC"),
        ("rfc822z", EAST, "02 Jan 26 20:34 +0530"),
        ("rfc850", MOMENT, "Friday, 02-Jan-26 15:04:05 UTC"),
        ("rfc1123", MOMENT, "Fri, 02 Jan 2026 15:04:05 UTC"),
        ("rfc1123z", MOMENT, "Fri, 02 Jan 2026 15:04:05 +0000"),
        ("rfc3339", MOMENT, "2026-01-02T15:04:05Z"),
        ("rfc3339", EAST, "2026-01-02T20:34:05+05:30"),
        ("rfc3339nano", MOMENT, "2026-01-02T15:04:05.1234Z"),
        ("rfc3339nano", MOMENT.replace(microsecond=0), "2026-01-02T15:04:05Z"),
        ("kitchen", MOMENT, "3:04PM"),
        ("kitchen", MOMENT.replace(hour=0), "12:04AM"),
        ("stamp", MOMENT, "Jan  2 15:04:05"),
        ("stampmilli", MOMENT, "Jan  2 15:04:05.123"),
        ("stampmicro", MOMENT, "Jan  2 15:04:05.123400"),
        ("stampnano", MOMENT, "Jan  2 15:04:05.123400000"),
    ],
)
def test_go_time_layouts(layout, moment, expected):
    assert go_time(layout, moment) == expected


def test_log_time_format_stamps_our_log_lines():
    formatters = [
        h.formatter
        for h in logging.getLogger("llamaswap").handlers
        if isinstance(h.formatter, KeyValueFormatter)
    ]
    assert formatters
    record = logging.makeLogRecord({"name": "llamaswap.proxy", "levelname": "INFO", "msg": "hello"})
    try:
        apply_log_config(_config("logTimeFormat: Kitchen\n" + textwrap.dedent(MODELS)))
        expected = go_time("kitchen", datetime.datetime.fromtimestamp(record.created).astimezone())
        assert formatters[0].format(record) == f"{expected} INFO llamaswap.proxy hello"
    finally:
        apply_log_config(_config(MODELS))
    default = formatters[0].format(record)
    assert (
        default.endswith(" INFO llamaswap.proxy hello") and default[:4].isdigit()
    )  # Python's stamp
