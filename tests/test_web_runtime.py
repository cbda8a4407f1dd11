"""The runtime reaches the views with the request (web/runtime.py), not through a global:
the router of ``build_application`` puts it in every connection's scope, and a request
built without one is refused with a message that says why."""

from __future__ import annotations

import json

import pytest
from django.test import RequestFactory

from scheduler import runtime
from scheduler.config import parse_config
from tests.asgi import Call, in_process
from web.runtime import NoRuntime, carrying, maybe_runtime_of, runtime_of, scope_runtime


def _config():
    return parse_config({"models": {"m": {"cmd": "fake", "proxy": "http://127.0.0.1:9"}}})


def test_a_request_built_without_a_runtime_is_refused_with_the_reason():
    request = RequestFactory().get("/v1/models")
    assert maybe_runtime_of(request) is None
    with pytest.raises(NoRuntime, match=r"no llamaswap server serves /v1/models"):
        runtime_of(request)


def test_a_test_request_carries_the_runtime_it_is_handed():
    rt = runtime.Runtime(config=_config(), dispatcher=None, upstreams=None)  # type: ignore[arg-type]
    request = RequestFactory(**carrying(rt)).get("/v1/models")
    assert runtime_of(request) is rt
    assert scope_runtime({"type": "websocket", **carrying(rt)}) is rt
    assert scope_runtime({"type": "websocket", **carrying(None)}) is None


async def test_views_answer_for_the_runtime_the_app_was_built_with_not_the_installed_one():
    async with in_process(_config()) as world:
        runtime.install(None)  # no global to fall back on: the app hands its own over
        try:
            call = Call(world.app, "/v1/models", b"", method="GET")
            await call.done()
            assert call.status == 200
            assert [m["id"] for m in json.loads(call.body)["data"]] == ["m"]
            page = Call(world.app, "/models/feed/", b"", method="GET")
            await page.done()
            assert page.status == 200
            assert [m["id"] for m in json.loads(page.body)["models"]] == ["m"]
        finally:
            runtime.install(world.runtime)
