"""A model process's states and its start/stop protocol, written once for the real process
(:class:`scheduler.process.ModelProcess`) and its in-memory fake
(:class:`scheduler.testing.FakeModelProcess`), so the fake cannot drift from the real one::

    STOPPED --start()--> STARTING --healthy--> READY --stop()--> STOPPING --reaped--> STOPPED
                            |                    |
                            +--fails/stop()------+--exits on its own (on_exit)------> STOPPED

:class:`Lifecycle` owns the rules a caller relies on: ``start()`` from READY returns at
once, from STARTING shares the start in progress, from STOPPING waits for the stop and then
starts; a failed or cancelled start raises :class:`ModelStartError` to every waiter;
``stop()`` is idempotent, abandons a start in progress (cause ``"stopped while starting"``),
goes STOPPING synchronously and runs the stop in a task of its own, so cancelling the
caller does not leave a half-stopped process. A subclass supplies what a process *does*:
``_start`` (spawn and wait until healthy, raising :class:`ModelStartError`) and
``_stop_process`` (end it and wait until it is reaped), and may watch every state change
(``_changed``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Coroutine


class ModelState(enum.Enum):
    STOPPED = "stopped"
    """No process: never started, stopped, failed to start, or exited."""
    STARTING = "starting"
    """Being spawned or waiting for its health check to pass."""
    READY = "ready"
    """Healthy: requests may be sent to ``config.proxy``."""
    STOPPING = "stopping"
    """Asked to stop; waiting for the process to exit and be reaped."""


class ModelStartError(Exception):
    """A model did not become ready; ``cause`` says why in words for a log or an error body."""

    def __init__(self, model: str, cause: str) -> None:
        super().__init__(f"model {model!r} failed to start: {cause}")
        self.model = model
        self.cause = cause


STOPPED_WHILE_STARTING = "stopped while starting"


class Lifecycle:
    """The start/stop state machine (see the module docstring). Used from one event loop."""

    def __init__(self) -> None:
        self._state = ModelState.STOPPED
        self._returncode: int | None = None
        self._exited = asyncio.Event()
        self._exited.set()
        self._abort = asyncio.Event()
        self._start_done: asyncio.Future[None] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def id(self) -> str:
        raise NotImplementedError

    @property
    def state(self) -> ModelState:
        return self._state

    @property
    def returncode(self) -> int | None:
        """None while the process runs (or before the first start); negative for a signal."""
        return self._returncode

    @property
    def exited(self) -> asyncio.Event:
        """Set once the current process has exited and been reaped, for any reason.

        Each :meth:`start` replaces it with a fresh, unset event; before the first start,
        and after a start that could not spawn anything, it is set.
        """
        return self._exited

    # -- what a subclass does --------------------------------------------------------------

    async def _start(self) -> None:
        """Spawn and return once healthy, or raise :class:`ModelStartError` with the process
        stopped and reaped (state STOPPED) or being stopped (:meth:`_begin_stop`)."""
        raise NotImplementedError

    async def _stop_process(self) -> None:
        """End the process and return once it is reaped (``exited`` set)."""
        raise NotImplementedError

    def _begin_start(self) -> None:
        """A start begins (before STARTING): reset what the last process left."""

    def _start_failed(self) -> None:
        """A start failed or was cancelled: clean up whatever :meth:`_start` left."""

    def _abort_start(self, cause: str) -> None:
        """Make the start in progress fail with ``cause``."""
        self._abort.set()

    def _changed(self, old: ModelState, new: ModelState) -> None:
        """Every state change, as it happens."""

    # -- the protocol ----------------------------------------------------------------------

    def _set_state(self, new: ModelState) -> None:
        old, self._state = self._state, new
        if old is not new:
            self._changed(old, new)

    def _spawn_task(self, coro: Coroutine[object, object, None], name: str) -> asyncio.Task[None]:
        # Strong references: the loop only keeps weak ones to running tasks.
        task = asyncio.create_task(coro, name=f"{name}:{self.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def start(self) -> None:
        """Start the model and return once it is READY.

        READY already: returns at once. STARTING: waits for the start in progress and shares
        its outcome. STOPPING: waits for the stop to finish, then starts.

        Raises :class:`ModelStartError` when the start fails or :meth:`stop` is called
        meanwhile (cause ``"stopped while starting"``); whatever was spawned is stopped and
        reaped before the error is raised. If the task awaiting ``start()`` is cancelled,
        the process is likewise stopped and reaped, then ``CancelledError`` propagates.
        """
        while True:
            if self._state is ModelState.READY:
                return
            if self._state is ModelState.STARTING:
                assert self._start_done is not None
                await asyncio.shield(self._start_done)
                return
            if self._state is ModelState.STOPPING:
                assert self._stopping is not None
                await asyncio.shield(self._stopping)
                continue
            break

        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._start_done = done
        self._abort = asyncio.Event()
        self._exited = asyncio.Event()
        self._returncode = None
        self._begin_start()
        self._set_state(ModelState.STARTING)
        try:
            await self._start()
        except BaseException as exc:
            self._start_failed()
            failure = exc if isinstance(exc, ModelStartError) else None
            done.set_exception(failure or ModelStartError(self.id, "start was cancelled"))
            done.exception()  # retrieved: nobody else need be waiting
            raise
        self._set_state(ModelState.READY)
        done.set_result(None)

    async def stop(self) -> None:
        """Stop the model and return once its process is reaped; the state is then STOPPED.

        Idempotent. While STARTING, the start is abandoned: the ``start()`` call raises
        :class:`ModelStartError` with cause ``"stopped while starting"`` and this returns once
        that start has cleaned up. The stop itself runs in a task of its own, so cancelling
        the caller does not leave a half-stopped process.
        """
        if self._state is ModelState.STARTING:
            assert self._start_done is not None
            self._abort_start(STOPPED_WHILE_STARTING)
            with contextlib.suppress(ModelStartError):
                await asyncio.shield(self._start_done)
        if self._state in (ModelState.READY, ModelState.STOPPING):
            await asyncio.shield(self._begin_stop())

    def _begin_stop(self) -> asyncio.Task[None]:
        """The one stop in progress, started if need be.

        STOPPING is set here, synchronously: an exit reported after this (even of a process
        that had already died) is the stop's, never an unexpected one (no ``on_exit``).
        """
        if self._stopping is None or self._stopping.done():
            self._set_state(ModelState.STOPPING)
            self._stopping = self._spawn_task(self._stop_process(), "stop")
        return self._stopping
