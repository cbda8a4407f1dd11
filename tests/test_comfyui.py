"""llama-swap's ``/comfyui`` passthrough: the config it forces, the model it needs, and the
llama-swap web UI's polls on the lean path. Through the real ASGI app in-process; the
passthrough with a real model server is in tests/test_e2e_wsproxy.py, against llama-swap
itself in tests/test_llamaswap_diff.py."""

from __future__ import annotations

import json

import pytest

from scheduler.config import parse_config
from tests.asgi import Call, in_process

pytestmark = pytest.mark.timeout(60)


def model(**keys) -> dict:
    return {"cmd": "fake", "proxy": "http://127.0.0.1:1", **keys}


@pytest.mark.parametrize(
    ("keys", "limit"),
    [({}, 50), ({"concurrencyLimit": 3}, 50), ({"concurrencyLimit": 80}, 80)],
)
def test_comfyui_auto_gets_llama_swaps_forced_settings(keys, limit):
    config = parse_config(
        {
            "models": {
                "comfyui_auto": model(compat={"ignoreWebsockets": False}, **keys),
                "other": model(**keys),
            }
        }
    )
    comfy, other = config.models["comfyui_auto"], config.models["other"]
    assert comfy.concurrency_limit == limit and comfy.ignore_websockets
    assert other.concurrency_limit == keys.get("concurrencyLimit", 10)
    assert not other.ignore_websockets


@pytest.mark.parametrize(
    "models",
    [
        {"comfy": model()},  # no such model
        {"comfy": model(aliases=["comfyui_auto"])},  # an alias is not it: the exact id only
    ],
)
async def test_comfyui_without_its_model_is_a_404(models):
    async with in_process(parse_config({"models": models})) as world:
        call = Call(world.app, "/comfyui/", b"", method="GET")
        await call.done()
        assert call.status == 404
        error = json.loads(call.body)["error"]
        assert error["code"] == "model_not_found"
        assert error["message"] == "local model comfyui_auto not found"
        assert world.factory.journal == []  # nothing started


@pytest.mark.parametrize("path", ["/api/version", "/api/hardware", "/api/performance"])
async def test_llama_swaps_ui_polls_take_the_lean_path(path):
    """No pages middleware on the way (its headers are the sign: X-Frame-Options, ...)."""
    async with in_process(parse_config({"models": {"m": model()}})) as world:
        call = Call(world.app, path, b"", method="GET")
        await call.done()
        assert call.status in (200, 503)
        assert b"x-frame-options" not in call.headers
        page = Call(world.app, "/api/profiles", b"", method="GET")  # a pages-handler path
        await page.done()
        assert b"x-frame-options" in page.headers
