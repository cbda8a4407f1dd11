"""Generic fixtures: free ports and fakellm servers that are always killed afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKELLM_START_TIMEOUT = 5.0


def pick_free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def free_port() -> Callable[[], int]:
    return pick_free_port


def fakellm_argv(port: int, *args: str) -> tuple[str, ...]:
    """The command line that runs fakellm with this interpreter."""
    return (sys.executable, "-m", "fakellm", "--port", str(port), *args)


@pytest.fixture
def fakellm_cmd() -> Callable[..., tuple[str, ...]]:
    return fakellm_argv


@dataclass
class FakeLLMServer:
    """A running fakellm; ``output`` collects its stderr lines as they arrive."""

    proc: asyncio.subprocess.Process
    port: int
    output: list[str] = field(default_factory=list)
    new_line: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def line_with(self, text: str) -> str:
        """The first output line containing ``text``, once it has been read (its stderr is
        read by another task, which may lag behind what the server already answered)."""
        while True:
            for line in self.output:
                if text in line:
                    return line
            self.new_line.clear()
            await self.new_line.wait()


@pytest.fixture
async def fakellm() -> AsyncIterator[Callable[..., Awaitable[FakeLLMServer]]]:
    """``await fakellm("--load-seconds", "1")`` starts a server and returns once it listens.

    Every server started is SIGKILLed (with its process group) and reaped at teardown.
    """
    servers: list[FakeLLMServer] = []
    readers: list[asyncio.Task[None]] = []

    async def start(*args: str) -> FakeLLMServer:
        port = pick_free_port()
        proc = await asyncio.create_subprocess_exec(
            *fakellm_argv(port, *args),
            cwd=ROOT,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        server = FakeLLMServer(proc, port)
        servers.append(server)
        listening = asyncio.Event()

        async def read_output() -> None:
            assert proc.stderr is not None
            async for raw in proc.stderr:
                line = raw.decode(errors="replace").rstrip("\n")
                server.output.append(line)
                server.new_line.set()
                if "listening on" in line:
                    listening.set()
            listening.set()  # EOF: it died; let start() notice
            server.new_line.set()

        readers.append(asyncio.create_task(read_output()))
        async with asyncio.timeout(FAKELLM_START_TIMEOUT):
            await listening.wait()
        if proc.returncode is not None or not any("listening on" in s for s in server.output):
            raise RuntimeError(f"fakellm did not start: {server.output}")
        return server

    yield start

    for server in servers:
        if server.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server.proc.pid, signal.SIGKILL)
        async with asyncio.timeout(5):
            await server.proc.wait()
    for reader in readers:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


@pytest.fixture
async def dispatchers():
    """``await dispatchers(config, **Dispatcher options)``: a started dispatcher, stopped
    (grace 0) when the test ends."""
    from scheduler.dispatcher import Dispatcher

    started = []

    async def build(config, **options):
        dispatcher = Dispatcher(config, **options)
        await dispatcher.start()
        started.append(dispatcher)
        return dispatcher

    yield build
    for dispatcher in started:
        await dispatcher.stop(grace=0)
