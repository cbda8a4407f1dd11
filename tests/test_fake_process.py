"""The in-memory FakeModelProcess is faithful where the races live.

One scenario table runs against both the fake and the real ModelProcess (over
``fakellm`` subprocesses): start -> ready, stop while starting, stop during the
stop delay, a crash reported asynchronously, and stop racing a crash. Whatever the
dispatcher tests conclude with the fake would hold with real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from scheduler.config import ModelConfig
from scheduler.process import LogBuffer, ModelProcess, ModelStartError, ModelState, set_state_dir
from scheduler.testing import FakeModelProcess
from tests.conftest import fakellm_argv, pick_free_port

pytestmark = pytest.mark.timeout(30)

PY = sys.executable
STOP_DELAY = 0.3
"""How long a stop of a live process takes: the fake's ``stop_delay``; for the real one,
a ``cmd_stop`` that waits this long before sending SIGTERM."""
DELAYED_SIGTERM = (
    "import os, signal, sys, time; "
    f"time.sleep({STOP_DELAY}); os.kill(int(sys.argv[1]), signal.SIGTERM)"
)
KILLED = -int(signal.SIGKILL)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll an in-memory condition that no event announces (``alive``), bounded."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


def until_dead_without_yielding(process: Any, timeout: float = 2.0) -> None:
    """Wait for ``alive`` to turn False while *not* letting the event loop run: whatever
    is then observed is the state between the death and its report."""
    deadline = time.monotonic() + timeout
    while process.alive and time.monotonic() < deadline:
        time.sleep(0.001)  # lets asyncio's watcher thread reap it, not the loop report it
    assert not process.alive


@dataclass
class Backend:
    """Builds processes of one kind and kills them the way a crash would."""

    name: str
    build: Callable[..., Any]
    kill: Callable[[Any], None]
    made: list[Any] = field(default_factory=list)

    def make(self, *, slow_start: bool = False, slow_stop: bool = False) -> Any:
        """A process whose ``on_exit`` calls land in ``process.exits``; ``slow_start``
        keeps it STARTING for good, ``slow_stop`` makes a stop of it take STOP_DELAY."""
        exits: list[Any] = []
        reported = asyncio.Event()

        def on_exit(process: Any) -> None:
            # What the callback sees is part of the contract.
            exits.append((process, process.state, process.exited.is_set(), process.alive))
            reported.set()

        process = self.build(slow_start, slow_stop, on_exit)
        process.exits = exits
        process.reported = reported
        self.made.append(process)
        return process


def build_fake(slow_start: bool, slow_stop: bool, on_exit: Callable[[Any], None]) -> Any:
    config = ModelConfig(id="m", cmd=("fake",), proxy="http://fake")
    return FakeModelProcess(
        config,
        on_exit=on_exit,
        start_delay=60 if slow_start else 0.05,
        stop_delay=STOP_DELAY if slow_stop else 0.0,
    )


def build_real(slow_start: bool, slow_stop: bool, on_exit: Callable[[Any], None]) -> Any:
    port = pick_free_port()
    config = ModelConfig(
        id="m",
        cmd=fakellm_argv(port, "--load-seconds", "60" if slow_start else "0.05"),
        proxy=f"http://127.0.0.1:{port}",
        check_endpoint="/health",
        health_check_timeout=90,
        unload_timeout=5,
        cmd_stop=(PY, "-c", DELAYED_SIGTERM, "${PID}") if slow_stop else None,
    )
    return ModelProcess(config, LogBuffer(), on_exit=on_exit)


def kill_fake(process: FakeModelProcess) -> None:
    process.crash(returncode=KILLED)


def kill_real(process: ModelProcess) -> None:
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)


@pytest.fixture
def state_dir(tmp_path) -> Iterator[None]:
    set_state_dir(tmp_path / "state")
    try:
        yield
    finally:
        set_state_dir(None)


@pytest.fixture(params=["fake", "real"])
async def backend(request, state_dir) -> AsyncIterator[Backend]:
    if request.param == "fake":
        made = Backend("fake", build_fake, kill_fake)
    else:
        made = Backend("real", build_real, kill_real)
    try:
        yield made
    finally:
        async with asyncio.timeout(10):
            for process in made.made:
                await process.stop()
        for process in made.made:
            assert process.state is ModelState.STOPPED and not process.alive
            if made.name == "real" and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, 0)
                    raise AssertionError(f"{process} left running")


# -- the scenario table ----------------------------------------------------------------------


async def start_then_ready_then_stop(backend: Backend) -> None:
    process = backend.make()
    assert process.state is ModelState.STOPPED and not process.alive
    assert process.exited.is_set()
    await process.start()
    assert process.state is ModelState.READY and process.alive
    assert not process.exited.is_set() and process.returncode is None
    await process.start()  # READY: at once
    await process.stop()
    assert process.state is ModelState.STOPPED and not process.alive
    assert process.exited.is_set() and process.returncode is not None
    assert process.exits == []


async def stop_while_starting(backend: Backend) -> None:
    process = backend.make(slow_start=True)
    starting = asyncio.create_task(process.start())
    await until(lambda: process.alive)  # spawned, not healthy
    assert process.state is ModelState.STARTING
    await process.stop()
    assert process.state is ModelState.STOPPED and not process.alive
    assert process.exited.is_set()
    with pytest.raises(ModelStartError, match="stopped while starting"):
        await starting
    assert process.exits == []


async def stop_during_stop_delay(backend: Backend) -> None:
    process = backend.make(slow_stop=True)
    await process.start()
    first_pid = process.pid
    loop = asyncio.get_running_loop()
    began = loop.time()
    first = asyncio.create_task(process.stop())
    await until(lambda: process.state is ModelState.STOPPING)
    assert process.alive  # asked to stop, still exiting
    second = asyncio.create_task(process.stop())  # shares the stop in progress
    restart = asyncio.create_task(process.start())  # waits for it, then starts afresh
    await asyncio.gather(first, second)
    assert loop.time() - began >= STOP_DELAY * 0.9
    await restart
    assert process.state is ModelState.READY and process.alive
    assert process.pid != first_pid
    assert process.exits == []


async def crash_is_reported_later(backend: Backend) -> None:
    process = backend.make()
    await process.start()
    backend.kill(process)
    # Right after the kill nothing has changed but the process itself...
    assert process.state is ModelState.READY and not process.exited.is_set()
    until_dead_without_yielding(process)
    # ...and once it is dead, still nothing until the loop gets to report the exit.
    assert process.state is ModelState.READY and not process.exited.is_set()
    assert process.exits == []
    async with asyncio.timeout(5):
        await process.reported.wait()
    assert process.exits == [(process, ModelState.STOPPED, True, False)]
    assert process.returncode == KILLED
    await process.stop()  # an exited process: at once
    assert len(process.exits) == 1


async def stop_racing_a_crash(backend: Backend) -> None:
    process = backend.make()
    await process.start()
    backend.kill(process)
    until_dead_without_yielding(process)
    assert process.state is ModelState.READY  # dead, not reported yet
    stopping = asyncio.create_task(process.stop())
    await asyncio.sleep(0)  # stop() has run up to its first wait
    assert process.state is ModelState.STOPPING  # from now on the exit is the stop's
    await stopping
    # The stop won: STOPPING at once, returned once the dead process was reaped, and
    # its exit is the stop's, with the process's own status.
    assert process.state is ModelState.STOPPED and process.exited.is_set()
    assert process.returncode == KILLED
    assert process.exits == []


SCENARIOS: dict[str, Callable[[Backend], Awaitable[None]]] = {
    "start_ready_stop": start_then_ready_then_stop,
    "stop_while_starting": stop_while_starting,
    "stop_during_stop_delay": stop_during_stop_delay,
    "crash_reported_later": crash_is_reported_later,
    "stop_racing_crash": stop_racing_a_crash,
}


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_scenario(backend: Backend, scenario: str) -> None:
    async with asyncio.timeout(15):
        await SCENARIOS[scenario](backend)


# -- what only the fake can show: its journal and its delays ---------------------------------


def fake(**options: Any) -> FakeModelProcess:
    return FakeModelProcess(ModelConfig(id="f", cmd=("fake",), proxy="http://fake"), **options)


async def test_fake_crash_journal_died_then_crash_on_report():
    exits: list[FakeModelProcess] = []
    process = fake(on_exit=exits.append)
    async with asyncio.timeout(2):
        await process.start()
        process.crash(returncode=3, reap_delay=0.05)
        assert process.journal[-1] == ("died", "f") and exits == []
        await asyncio.sleep(0)  # one loop iteration is not the reap_delay
        assert process.state is ModelState.READY and exits == []
        await process.exited.wait()
    assert exits == [process] and process.returncode == 3
    assert process.journal == [("start", "f"), ("ready", "f"), ("died", "f"), ("crash", "f")]
    with pytest.raises(RuntimeError):
        process.crash()  # nothing left to kill


async def test_fake_crash_with_zero_delay_is_still_reported_from_the_loop():
    exits: list[FakeModelProcess] = []
    process = fake(on_exit=exits.append)
    await process.start()
    process.crash()
    assert exits == [] and process.state is ModelState.READY
    async with asyncio.timeout(1):
        await process.exited.wait()
    assert exits == [process] and process.state is ModelState.STOPPED


async def test_fake_stop_of_a_dead_process_waits_for_the_reap_not_the_stop_delay():
    exits: list[FakeModelProcess] = []
    process = fake(on_exit=exits.append, stop_delay=30)
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(5):
        await process.start()
        process.crash(returncode=KILLED, reap_delay=0.1)
        began = loop.time()
        stopping = asyncio.create_task(process.stop())
        await asyncio.sleep(0)
        assert process.state is ModelState.STOPPING
        await stopping
    assert 0.05 <= loop.time() - began < 5
    assert exits == [] and process.returncode == KILLED
    assert process.journal[2:] == [("died", "f"), ("stop", "f"), ("stopped", "f")]


async def test_fake_crash_during_the_stop_delay_ends_the_stop_with_its_status():
    process = fake(stop_delay=30, on_exit=lambda p: pytest.fail("no on_exit after stop()"))
    async with asyncio.timeout(5):
        await process.start()
        stopping = asyncio.create_task(process.stop())
        await asyncio.sleep(0)
        assert process.state is ModelState.STOPPING and process.alive
        process.crash(returncode=0)  # it handled SIGTERM quicker than stop_delay
        await stopping
    assert process.state is ModelState.STOPPED and process.returncode == 0


async def test_fake_crash_while_starting_fails_the_start_after_the_report():
    process = fake(hold_start=True)
    async with asyncio.timeout(2):
        starting = asyncio.create_task(process.start())
        await asyncio.sleep(0)
        process.crash(returncode=1, reap_delay=0.05)
        await asyncio.sleep(0)
        assert process.state is ModelState.STARTING and not starting.done()
        with pytest.raises(ModelStartError) as info:
            await starting
    assert info.value.cause == "process exited with code 1 before becoming healthy"
    assert process.returncode == 1 and process.state is ModelState.STOPPED
    assert process.journal == [("start", "f"), ("died", "f"), ("start_failed", "f")]


@pytest.mark.parametrize("process_class", [ModelProcess, FakeModelProcess])
def test_the_fake_and_the_real_process_run_one_state_machine(process_class):
    """The rules a caller relies on (how start and stop wait for each other, STOPPING at
    once, one stop task, every state change) are written once, in Lifecycle: neither the
    real process nor the fake may restate them, or the fake could drift from the real."""
    from scheduler.lifecycle import Lifecycle

    assert issubclass(process_class, Lifecycle)
    for name in ("_set_state", "_begin_stop", "_spawn_task", "state", "returncode", "exited"):
        assert getattr(process_class, name) is getattr(Lifecycle, name), name
    for name in ("start", "stop"):  # the fake may count calls, then must hand over
        method = getattr(process_class, name)
        assert method is getattr(Lifecycle, name) or "super()" in inspect.getsource(method)
