"""What a relayed request does not pay for: a URL parsed anew per request, loop turns handed
over when no request waits for the GPU."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from proxy.relay import URL_CACHE_MAX_CHARS, URL_CACHE_SIZE, hand_over, upstream_url


def test_the_url_is_the_one_httpx_parses_and_shared_between_requests():
    url = upstream_url("http://127.0.0.1:5800/", "/v1/chat/completions", "a=1&b=%20")
    assert url == httpx.URL("http://127.0.0.1:5800/v1/chat/completions?a=1&b=%20")
    assert upstream_url("http://127.0.0.1:5800/", "/v1/chat/completions", "a=1&b=%20") is url
    assert upstream_url("http://127.0.0.1:5800", "/health", "") == httpx.URL(
        "http://127.0.0.1:5800/health"
    )


def test_an_invalid_url_is_refused_every_time():
    for _ in range(2):
        with pytest.raises((httpx.InvalidURL, ValueError)):
            upstream_url("http://127.0.0.1:5800", "/v1/\x00models", "")


def test_what_clients_send_cannot_grow_the_cache():
    from proxy.relay import _cached_url  # noqa: PLC2701 - the bound under test

    for i in range(URL_CACHE_SIZE * 3):
        upstream_url("http://127.0.0.1:5800", f"/v1/models/{i}", "")
    assert _cached_url.cache_info().currsize <= URL_CACHE_SIZE
    long_path = "/v1/" + "x" * URL_CACHE_MAX_CHARS
    first = upstream_url("http://127.0.0.1:5800", long_path, "")
    assert upstream_url("http://127.0.0.1:5800", long_path, "") is not first  # never kept
    assert first == httpx.URL("http://127.0.0.1:5800" + long_path)


async def test_the_answer_waits_for_the_next_grant_only_when_a_request_waits():
    """``hand_over`` lets the dispatcher grant the next request before this answer goes
    out; with nothing in the queue (or a peer's request: no queue) it takes no loop turn."""
    ran: list[str] = []
    loop = asyncio.get_running_loop()
    for dispatcher in (SimpleNamespace(queue=[]), SimpleNamespace()):
        loop.call_soon(ran.append, "other work")
        await hand_over(SimpleNamespace(dispatcher=dispatcher))
        assert ran == []  # the answer did not wait for the loop
        await asyncio.sleep(0)
        ran.clear()
    loop.call_soon(ran.append, "the dispatcher's step")
    await hand_over(SimpleNamespace(dispatcher=SimpleNamespace(queue=["waiting"])))
    assert ran == ["the dispatcher's step"]


async def test_with_a_request_waiting_its_request_reaches_the_model_before_this_answer_goes(
    dispatchers,
):
    """The real dispatcher (serial, one model): a finished request's ``hand_over`` lasts
    until the next request's view has resumed and written to its model, and no longer
    than one loop turn beyond it (so the answer is not held back without cause)."""
    from scheduler.dispatcher import Outcome
    from scheduler.testing import FakeProcessFactory
    from tests.helpers import make_config

    d = await dispatchers(make_config("m"), process_factory=FakeProcessFactory())
    model = d.config.models["m"]
    first = d.submit(model, 0, "first", "/v1/chat/completions")
    await first.wait()
    second = d.submit(model, 0, "second", "/v1/chat/completions")
    order: list[str] = []

    async def view() -> None:
        await second.wait()
        order.append("second request written to the model")  # the view's step: its write
        await asyncio.sleep(0)
        order.append("one loop turn later")

    waiting = asyncio.create_task(view())
    for _ in range(5):  # the second is in the queue, its view waiting
        await asyncio.sleep(0)
    assert d.queue and not waiting.done()
    d.finish(first, Outcome.COMPLETED, 200)
    await hand_over(SimpleNamespace(dispatcher=d))
    order.append("first answer sent")
    await waiting
    assert order == [
        "second request written to the model",
        "first answer sent",
        "one loop turn later",
    ]
