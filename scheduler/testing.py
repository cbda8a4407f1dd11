"""In-memory stand-ins for :mod:`scheduler.process`, for tests of the code that drives models.

:class:`FakeModelProcess` has :class:`~scheduler.process.ModelProcess`'s public surface and
runs the same state machine (:class:`scheduler.lifecycle.Lifecycle`: both subclass it, so a
change to the start/stop rules reaches both), with no subprocess and no socket. A start can be made slow (``start_delay``), held until the test says so
(``hold_start`` / :meth:`FakeModelProcess.release`), or made to fail (``start_error``); a
running model can be made to crash (:meth:`FakeModelProcess.crash`), which, like a real
process, dies at once but is reported (reaped) only later, from the loop. Every effect is
recorded in ``journal`` as ``(action, model id)`` so a test can assert the order of starts
and stops across models, the way llama-swap's scheduler tests use a recording fake.
``tests/test_fake_process.py`` runs one scenario table against this and the real
ModelProcess, to keep the two alike.

:class:`FakeProcessFactory` is called like the ``ModelProcess`` class, so the code under test
can take a process factory and get the real class in production and this in tests.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
from typing import Any

from scheduler.config import ModelConfig
from scheduler.lifecycle import Lifecycle, ModelStartError, ModelState
from scheduler.logbuffer import LogBuffer
from scheduler.process import ExitCallback
from scheduler.spawn import describe_exit

_pids = itertools.count(100_000)


class FakeModelProcess(Lifecycle):
    """A model process that lives in memory, on the same state machine as ``ModelProcess``
    (:class:`scheduler.lifecycle.Lifecycle`): only what a start and a stop do is its own.

    * ``start()`` from STOPPED goes STARTING -> READY, or back to STOPPED raising
      :class:`ModelStartError` (``start_error``, a :meth:`crash` while starting, or
      ``stop()`` meanwhile with cause ``"stopped while starting"``). From READY it returns at
      once; from STARTING it shares the start in progress.
    * ``stop()`` goes READY -> STOPPING (at once, synchronously) -> STOPPED; it is idempotent
      and abandons a start in progress. A live process takes ``stop_delay`` to exit; one
      that already died (:meth:`crash`) is only waited for until it is reaped.
    * Death and reaping are two moments, as with an OS process: :meth:`crash` makes
      :attr:`alive` False at once, and the exit is reported only later, from the loop
      (``reap_delay``): then ``exited`` is set, and a process still READY goes STOPPED and
      ``on_exit`` is called. An exit reported after ``stop()`` was called is the stop's:
      no ``on_exit``.
    * ``exited`` is a fresh event per start, set when the fake process has been reaped.
    """

    def __init__(
        self,
        config: ModelConfig,
        logs: LogBuffer | None = None,
        *,
        http_client: Any = None,
        on_exit: ExitCallback | None = None,
        start_delay: float = 0.0,
        stop_delay: float = 0.0,
        start_error: str | None = None,
        hold_start: bool = False,
        journal: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.logs = logs
        self.on_exit = on_exit
        self.start_delay = start_delay
        self.stop_delay = stop_delay
        self.start_error = start_error
        """When set, every start fails with this cause."""
        self.journal: list[tuple[str, str]] = journal if journal is not None else []
        """``(action, id)`` in order. ``"start"``, then ``"ready"`` or ``"start_failed"``;
        ``"stop"`` (STOPPING) and ``"stopped"``; ``"died"`` when :meth:`crash` kills it and
        ``"crash"`` when that exit is reported as unexpected (READY, ``on_exit`` called)."""
        self.calls: list[str] = []
        """The public methods called, in order: ``"start"``, ``"stop"``."""
        self._gate = asyncio.Event()
        if not hold_start:
            self._gate.set()
        self._pid: int | None = None
        self._alive = False
        self._kill_returncode: int | None = None
        """How the live process ends when a start fails: -SIGTERM after a stop, 1 after
        ``start_error``; -SIGKILL (a cancelled start) when unset."""
        self._reaping: asyncio.TimerHandle | None = None
        self._death_returncode: int | None = None
        self._abort_cause = ""

    def __repr__(self) -> str:
        return f"<FakeModelProcess {self.config.id} {self._state.value}>"

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def alive(self) -> bool:
        """The fake OS process exists: from the start until it dies (crash, or the end of a
        stop), which may be before its exit is reported (``state`` still READY)."""
        return self._alive

    def release(self) -> None:
        """Let a start held by ``hold_start=True`` (this one and later ones) proceed."""
        self._gate.set()

    def _record(self, action: str) -> None:
        self.journal.append((action, self.id))
        if self.logs is not None:
            self.logs.write(self.id, f"fake model {action}".encode())

    def _reaped(self, returncode: int) -> None:
        """The process has exited and been reaped: ``returncode`` and ``exited``, no state."""
        if self._reaping is not None:
            self._reaping.cancel()
            self._reaping = None
        self._alive = False
        self._returncode = returncode
        self._exited.set()

    def _report_death(self) -> None:
        """The loop reaps a process that died on its own, as ModelProcess's watcher does."""
        self._reaping = None
        assert self._death_returncode is not None
        returncode = self._death_returncode
        self._reaped(returncode)
        if self._state is ModelState.READY:
            self._set_state(ModelState.STOPPED)  # recorded as "crash"
            if self.on_exit is not None:
                self.on_exit(self)  # type: ignore[arg-type]
        elif self._state is ModelState.STARTING:
            self._abort_cause = f"process {describe_exit(returncode)} before becoming healthy"
            self._abort.set()
        # STOPPING: the stop in progress sees ``exited`` and finishes.

    _RECORDED = {
        (ModelState.STOPPED, ModelState.STARTING): "start",
        (ModelState.STARTING, ModelState.READY): "ready",
        (ModelState.STARTING, ModelState.STOPPED): "start_failed",
        (ModelState.READY, ModelState.STOPPED): "crash",
        (ModelState.READY, ModelState.STOPPING): "stop",
        (ModelState.STOPPING, ModelState.STOPPED): "stopped",
    }
    """The journal's entry for each state change."""

    def _changed(self, old: ModelState, new: ModelState) -> None:
        action = self._RECORDED.get((old, new))
        if action is not None:
            self._record(action)

    async def start(self) -> None:
        self.calls.append("start")
        await super().start()

    def _begin_start(self) -> None:
        self._kill_returncode = None
        self._death_returncode = None
        self._pid = next(_pids)
        self._alive = True

    def _start_failed(self) -> None:
        if not self._exited.is_set():
            if self._alive:  # killed by the failed start's cleanup
                killed = self._kill_returncode
                self._reaped(-int(signal.SIGKILL) if killed is None else killed)
            else:  # died already: cleaning up waits for nothing more than the reap
                assert self._death_returncode is not None
                self._reaped(self._death_returncode)
        self._set_state(ModelState.STOPPED)  # recorded as "start_failed"

    async def _start(self) -> None:
        async def ready_after_delay() -> None:
            await self._gate.wait()
            await asyncio.sleep(self.start_delay)

        waiting = asyncio.ensure_future(ready_after_delay())
        aborted = asyncio.ensure_future(self._abort.wait())
        try:
            await asyncio.wait([waiting, aborted], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            aborted.cancel()
        if self._abort.is_set():
            raise ModelStartError(self.id, self._abort_cause)
        if self.start_error is not None:
            self._kill_returncode = 1
            raise ModelStartError(self.id, self.start_error)

    async def stop(self) -> None:
        self.calls.append("stop")
        await super().stop()

    def _abort_start(self, cause: str) -> None:
        self._abort_cause = cause
        self._kill_returncode = -int(signal.SIGTERM)
        super()._abort_start(cause)

    async def _stop_process(self) -> None:
        try:
            if self._alive:
                # SIGTERM: it exits after stop_delay, unless it dies sooner (crash()).
                exited = asyncio.ensure_future(self._exited.wait())
                try:
                    await asyncio.wait([exited], timeout=self.stop_delay)
                finally:
                    exited.cancel()
                if self._alive:
                    self._reaped(-int(signal.SIGTERM))
            await self._exited.wait()  # dead already: until the loop reaps it
        finally:
            if not self._exited.is_set():  # cancelled (loop shutting down)
                self._reaped(-int(signal.SIGKILL))
            self._set_state(ModelState.STOPPED)  # recorded as "stopped"

    def crash(self, returncode: int = 1, reap_delay: float = 0.0) -> None:
        """The process dies on its own, now: :attr:`alive` goes False and ``("died", id)`` is
        recorded, nothing else changes yet.

        Its exit is reported ``reap_delay`` seconds later (at least one loop iteration, even
        with 0), from the loop, as ModelProcess's watcher reports a reaped process: READY ->
        STOPPED, ``("crash", id)`` and ``on_exit``; STARTING -> the start fails with
        ``"process exited with code N before becoming healthy"``; STOPPING (a stop raced the
        crash) -> the stop returns, with this ``returncode`` and no ``on_exit``.
        """
        if not self._alive:
            raise RuntimeError(f"cannot crash {self.id}: no live process ({self._state.value})")
        self._alive = False
        self._death_returncode = returncode
        self._record("died")
        loop = asyncio.get_running_loop()
        self._reaping = loop.call_later(reap_delay, self._report_death)


class FakeProcessFactory:
    """Builds one :class:`FakeModelProcess` per model id, all sharing one ``journal``.

    ``defaults`` are FakeModelProcess options for every model; :meth:`configure` sets them
    per model id, before or after the process is built.
    """

    def __init__(self, **defaults: Any) -> None:
        self.defaults = defaults
        self.options: dict[str, dict[str, Any]] = {}
        self.processes: dict[str, FakeModelProcess] = {}
        self.journal: list[tuple[str, str]] = []

    def configure(self, model_id: str, **options: Any) -> None:
        self.options.setdefault(model_id, {}).update(options)
        process = self.processes.get(model_id)
        if process is not None:
            for name, value in options.items():
                if name == "hold_start":
                    if value:
                        process._gate.clear()
                    else:
                        process.release()
                else:
                    setattr(process, name, value)

    def __call__(
        self,
        config: ModelConfig,
        logs: LogBuffer | None = None,
        *,
        http_client: Any = None,
        on_exit: ExitCallback | None = None,
    ) -> FakeModelProcess:
        options = {**self.defaults, **self.options.get(config.id, {})}
        process = FakeModelProcess(config, logs, on_exit=on_exit, journal=self.journal, **options)
        self.processes[config.id] = process
        return process


# -- processes and ports, for tests and benchmarks that run the real server -----------------


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(pid: int) -> set[int]:
    """All live descendant pids of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.add(child)
            stack.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
