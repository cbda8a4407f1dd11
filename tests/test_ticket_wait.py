"""``Ticket.wait``: what a view awaiting its turn sees, and what its cancellation leaves.

The grant settles the waiting view itself (``Ticket.pass_on``), one loop turn sooner than
a shield's callback would; every other end of ``granted`` still reaches the view, and a
view that stops waiting never touches the dispatcher's future.
"""

from __future__ import annotations

import asyncio

import pytest

from scheduler.dispatcher import QueueFull
from scheduler.tickets import Ticket, issue
from tests.helpers import make_config


def _ticket() -> Ticket:
    return issue(
        make_config("m").models["m"],
        0,
        "r1",
        "/v1/chat/completions",
        (10.0, 1_790_000_000.0),
        None,
        lambda ticket: None,
    )


async def _turns_until(task: asyncio.Task[str], limit: int = 10) -> int:
    """Loop turns this coroutine yields before ``task`` is done."""
    for turns in range(limit):
        if task.done():
            return turns
        await asyncio.sleep(0)
    raise AssertionError(f"not done after {limit} loop turns")


async def test_a_grant_passed_on_resumes_the_view_in_one_loop_turn() -> None:
    ticket = _ticket()
    view = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0)  # the view waits
    ticket.granted.set_result("http://127.0.0.1:9")
    ticket.pass_on()
    assert await _turns_until(view) == 1
    assert view.result() == "http://127.0.0.1:9"


async def test_a_grant_not_passed_on_still_reaches_the_view() -> None:
    ticket = _ticket()
    view = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0)
    ticket.granted.set_result("http://127.0.0.1:9")
    assert await view == "http://127.0.0.1:9"


async def test_a_refusal_reaches_the_view_as_its_exception() -> None:
    ticket = _ticket()
    view = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0)
    ticket.granted.set_exception(QueueFull("the queue is full"))
    with pytest.raises(QueueFull):
        await view


async def test_a_cancelled_grant_cancels_the_wait() -> None:
    ticket = _ticket()
    view = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0)
    ticket.granted.cancel()
    with pytest.raises(asyncio.CancelledError):
        await view


async def test_a_view_that_stops_waiting_leaves_the_grant_alone() -> None:
    ticket = _ticket()
    view = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0)
    view.cancel()
    with pytest.raises(asyncio.CancelledError):
        await view
    assert not ticket.granted.done()  # the dispatcher's future: still its to settle
    ticket.granted.set_result("http://127.0.0.1:9")
    ticket.pass_on()  # no waiter left: nothing to do, nothing raised
    assert await ticket.wait() == "http://127.0.0.1:9"  # a later wait gets the result at once


async def test_two_waits_at_once_both_get_the_grant() -> None:
    ticket = _ticket()
    first = asyncio.create_task(ticket.wait())
    second = asyncio.create_task(ticket.wait())
    await asyncio.sleep(0)
    ticket.granted.set_result("http://127.0.0.1:9")
    ticket.pass_on()
    assert await asyncio.gather(first, second) == ["http://127.0.0.1:9"] * 2
