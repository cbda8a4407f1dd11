"""The only code that touches a model subprocess: spawn, health-check, stop, reap, capture logs.

One :class:`ModelProcess` per configured model. It runs at most one OS process at a time and
walks :class:`ModelState` like llama-swap's ``internal/process``::

    STOPPED --start()--> STARTING --healthy--> READY --stop()--> STOPPING --reaped--> STOPPED
                            |                    |
                            +--fails/stop()------+--exits on its own (on_exit)------> STOPPED

Process groups: each model runs in its own session (``start_new_session=True``), so a stop
signals the whole tree, e.g. a shell wrapper and the server it backgrounded. Once the leader
has been reaped, whatever is left in its group is SIGKILLed, and so is every process carrying
that spawn's environment marker (a descendant that left the group with ``setsid``); the
model counts as exited only once they are all dead (bounded by :data:`REAP_TIMEOUT`).

Parent death: on Linux each spawned process gets ``PR_SET_PDEATHSIG = SIGKILL``, so if this
server is SIGKILLed its model processes die with it. That reaches only the direct child: a
wrapper's grandchildren survive. For those, every spawned process (and so every descendant
that keeps its environment) carries ``LLAMASWAP_OWNER=<server pid>:<server start time>``,
and each server instance keeps a record of the process groups it started, one JSON file per
instance in the state directory (:func:`set_state_dir`; default ``$LLAMASWAP_STATE_DIR``,
else ``<project>/var/``). At start-up ``manage.py serve`` calls :func:`prepare_server`,
which makes the server a child subreaper and runs :func:`reap_leftovers`: the leftovers of
every *dead* instance are SIGKILLed; live instances are never touched. It then starts the
server's guard (:mod:`scheduler.guard`): a small process that reads EOF on a pipe the moment
the server dies, SIGKILLed or not, and sweeps the server's recorded groups and marked
processes at once, so a wrapped model dies with the server rather than at the next start.
The markers, records and sweep live in :mod:`scheduler.guard` (standard library only, so
the guard starts light) and are re-exported here.

The kernel fires the parent-death signal when the *thread* that forked the child exits, not
the process: spawn only from the long-lived event loop that owns the models (asyncio spawns
from the loop's own thread), never from a loop running in a short-lived worker thread such
as one made by ``async_to_sync``.

Everything here must be used from one event loop; nothing is thread-safe.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import enum
import ipaddress
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol

import httpx

from scheduler.config import ModelConfig
from scheduler.guard import (  # the supervision API is also the process layer's
    DEFAULT_STATE_DIR,  # noqa: F401
    OWNER_ENV,
    REAP_POLL_INTERVAL,  # noqa: F401
    REAP_TIMEOUT,
    SPAWN_ENV,
    STATE_DIR_ENV,  # noqa: F401
    _records,
    _spawn_marker,
    _stat,
    _sweep,
    current_guard,
    owner_id,
    reap_leftovers,
    set_state_dir,
    start_guard,
    state_dir,  # noqa: F401
)

logger = logging.getLogger(__name__)

HEALTH_POLL_INTERVAL = 0.1
"""Seconds between health checks; the first one is sent as soon as the process is spawned."""
HEALTH_REQUEST_TIMEOUT = 5.0
LOG_DRAIN_TIMEOUT = 1.0
"""How long to wait, after the process exits, for the rest of its output."""
MAX_LINE_BYTES = 16 * 1024
"""Longer output without a newline is cut into lines of this size."""


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


# -- logs ------------------------------------------------------------------------------------


def _prefixed(model: str, line: bytes) -> bytes:
    return b"[" + model.encode() + b"] " + line


class LogSubscription:
    """A live tail of a :class:`LogBuffer`: an async iterator of lines (bytes, newline-ended).

    Lines are queued per subscriber up to ``maxsize``; when the queue is full new lines are
    dropped and counted in :attr:`dropped`, so a slow reader never blocks the models. Ends
    (``StopAsyncIteration``) after :meth:`close`, once the lines already queued are read.
    """

    def __init__(self, buffer: LogBuffer, model: str | None, maxsize: int) -> None:
        self.model = model
        self.dropped = 0
        self.closed = False
        self._buffer = buffer
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize)

    def _offer(self, model: str, line: bytes) -> None:
        if self.closed or (self.model is not None and model != self.model):
            return
        try:
            self._queue.put_nowait(line if self.model is not None else _prefixed(model, line))
        except asyncio.QueueFull:
            self.dropped += 1

    def close(self) -> None:
        """Stop receiving; a reader waiting in ``async for`` finishes."""
        if self.closed:
            return
        self.closed = True
        self._buffer._subscribers.discard(self)
        if self._queue.full():  # make room for the end marker
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(None)

    def __aiter__(self) -> LogSubscription:
        return self

    async def __anext__(self) -> bytes:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # keep ending for any later call
            raise StopAsyncIteration
        return item

    async def __aenter__(self) -> LogSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class LogBuffer:
    """The recent output of every model, bounded by bytes, with live subscriptions.

    Lines are kept with the id of the model that wrote them. :meth:`history` without a model
    gives every line prefixed ``[model-id] `` (as llama-swap's combined upstream log does);
    with a model, that model's lines as written. When the total passes ``max_bytes`` the
    oldest lines are dropped.
    """

    def __init__(self, max_bytes: int = 1024 * 1024, *, subscriber_queue: int = 1024) -> None:
        self.max_bytes = max_bytes
        self.subscriber_queue = subscriber_queue
        self._lines: collections.deque[tuple[str, bytes]] = collections.deque()
        self._size = 0
        self._subscribers: set[LogSubscription] = set()
        self.echo: Callable[[str, bytes], None] | None = None
        """Also called with every line (``logToStdout: upstream`` or ``both`` writes them
        to stdout: :func:`llamaswap_site.logfmt.apply_log_config`)."""

    def write(self, model: str, line: bytes) -> None:
        """Append one line of ``model``'s output; a missing final newline is added."""
        if not line.endswith(b"\n"):
            line += b"\n"
        if self.echo is not None:
            self.echo(model, line)
        self._lines.append((model, line))
        self._size += len(line) + len(model) + 3
        while self._size > self.max_bytes and self._lines:
            old_model, old_line = self._lines.popleft()
            self._size -= len(old_line) + len(old_model) + 3
        for subscriber in tuple(self._subscribers):
            subscriber._offer(model, line)

    def history(self, model: str | None = None) -> bytes:
        if model is None:
            return b"".join(_prefixed(m, line) for m, line in self._lines)
        return b"".join(line for m, line in self._lines if m == model)

    def subscribe(self, model: str | None = None, *, maxsize: int | None = None) -> LogSubscription:
        """Lines written from now on (of one model, unprefixed, when ``model`` is given)."""
        subscription = LogSubscription(self, model, maxsize or self.subscriber_queue)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: LogSubscription) -> None:
        subscription.close()


# -- spawning --------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


_prctl = _load_prctl()


# -- supervision: markers, records of our process groups, leftovers, the guard ---------------
# (scheduler/guard.py: the guard process imports it alone, so it holds only the stdlib's)

PORT_CHECK_TIMEOUT = 0.25
"""The connect attempt that tells whether something already listens on a model's port."""

_PR_SET_CHILD_SUBREAPER = 36
_spawn_numbers = itertools.count(1)


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux): orphans of our model trees are reparented
    to us rather than to init, so they stay ours to kill and reap. True if it took effect.

    Called by :func:`prepare_server` only, not at the first spawn: in a process that is not
    the server (a test runner) it would leave every orphan of anything as a zombie there.
    """
    if _prctl is None:
        return False
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def prepare_server(directory: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """What ``manage.py serve`` calls once, before serving: :func:`set_state_dir`,
    :func:`become_subreaper`, :func:`reap_leftovers`, then start this server's guard
    (:func:`scheduler.guard.start_guard`: its models die with it). Returns what was killed."""
    set_state_dir(directory)
    become_subreaper()
    killed = reap_leftovers()
    try:
        start_guard()
    except OSError as exc:  # supervision must not keep the server from serving
        logger.error(
            "cannot start the guard (%s): models outlive a killed server until the next start",
            exc,
            extra={"action": "guard_failed"},
        )
    return killed


async def _port_in_use(url: str) -> tuple[str, int] | None:
    """``(host, port)`` if ``url`` is on a loopback host and something accepts connections
    there already; None otherwise (or when it cannot tell)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    if host == "localhost":
        addresses = [("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)]
    else:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return None
        if not ip.is_loopback:
            return None
        addresses = [(host, socket.AF_INET6 if ip.version == 6 else socket.AF_INET)]
    loop = asyncio.get_running_loop()
    for address, family in addresses:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, (address, port)), PORT_CHECK_TIMEOUT)
            if sock.getsockname() == sock.getpeername():
                continue  # TCP simultaneous open onto itself: nobody listens
            return host, port
        except (OSError, TimeoutError):
            continue
        finally:
            sock.close()
    return None


# -- spawning, continued ---------------------------------------------------------------------


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking the kernel to SIGKILL the child when its parent thread dies."""
    if _prctl is None:
        return None
    prctl = _prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class _ChildProtocol(asyncio.SubprocessProtocol):
    """Feeds a child's output into a :class:`LogBuffer` line by line; exit and EOF as futures.

    ``exited`` resolves when the child has been reaped, even if a grandchild still holds the
    output pipe open (``asyncio.subprocess.Process.wait`` waits for the pipes too).
    """

    def __init__(self, model: str, logs: LogBuffer, loop: asyncio.AbstractEventLoop) -> None:
        self._model = model
        self._logs = logs
        self._pending = b""
        self.transport: asyncio.SubprocessTransport | None = None
        self.exited: asyncio.Future[int] = loop.create_future()
        self.output_closed: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        *lines, pending = (self._pending + data).split(b"\n")
        for line in lines:
            self._logs.write(self._model, line + b"\n")
        while len(pending) > MAX_LINE_BYTES:
            self._logs.write(self._model, pending[:MAX_LINE_BYTES])
            pending = pending[MAX_LINE_BYTES:]
        self._pending = pending

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if self._pending:
            self._logs.write(self._model, self._pending)
            self._pending = b""
        if not self.output_closed.done():
            self.output_closed.set_result(None)

    def process_exited(self) -> None:
        assert self.transport is not None
        returncode = self.transport.get_returncode()
        if not self.exited.done() and returncode is not None:
            self.exited.set_result(returncode)


class _Child:
    """A spawned process: its transport, its protocol, and signals to its group."""

    def __init__(
        self,
        transport: asyncio.SubprocessTransport,
        protocol: _ChildProtocol,
        spawn: str,
        start: int | None,
    ) -> None:
        self.transport = transport
        self.protocol = protocol
        self.pid: int = transport.get_pid()
        self.spawn = spawn
        """The value of ``LLAMASWAP_SPAWN`` it and its descendants carry."""
        self.start = start
        """Its start time (``/proc/<pid>/stat``), None if it was gone before it was read."""

    @property
    def running(self) -> bool:
        """Not yet reaped and reported to the loop."""
        return not self.protocol.exited.done()

    @property
    def alive(self) -> bool:
        """The OS process has not exited: False from the moment it dies, while
        :attr:`running` stays True until asyncio has reaped it and the loop has been told."""
        if not self.running:
            return False
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT  # look, do not reap
            return os.waitid(os.P_PID, self.pid, flags) is None
        except ChildProcessError:
            return False  # already reaped by asyncio's watcher thread, not yet reported
        except (AttributeError, OSError):
            return True

    def signal_tree(self, sig: signal.Signals) -> None:
        """Signal the process group it leads, or the process alone if it left its group.

        Never once it has been reaped: its pid may belong to someone else by then.
        """
        if not self.running:
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                self.transport.send_signal(sig)

    async def wait(self) -> int:
        return await asyncio.shield(self.protocol.exited)

    async def teardown(self, model: str) -> bool:
        """Once it has been reaped: SIGKILL what is left of its group and every process
        carrying its spawn marker (one that ``setsid`` took out of the group), wait until they
        are dead (up to :data:`REAP_TIMEOUT`) and reap those that were reparented to us.

        A group id is not reused while any member lives, and the sweep ignores the group
        once a process has the leader's pid again. True when nothing is left; the group then
        leaves this instance's record.
        """
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + REAP_TIMEOUT
        killed, remaining = await asyncio.to_thread(
            _sweep, {self.pid: None}, [_spawn_marker(self.spawn)], deadline
        )
        for target in killed:
            logger.info(
                "model %s: killed pid %d left behind by pid %d: %s",
                model,
                target.pid,
                self.pid,
                target.cmd,
                extra={"action": "kill_leftover", "model": model, "pid": target.pid},
            )
        if remaining:
            logger.warning(
                "model %s: pids %s still run %gs after SIGKILL",
                model,
                [target.pid for target in remaining],
                REAP_TIMEOUT,
                extra={"action": "kill_failed", "model": model},
            )
            return False
        _records.discard(self.pid)
        return True


async def _spawn(
    argv: tuple[str, ...],
    env: Mapping[str, str],
    model: str,
    logs: LogBuffer,
    *,
    role: str = "model",
) -> _Child:
    """Spawn in a new session, marked and recorded (see the module docstring)."""
    loop = asyncio.get_running_loop()
    guard = current_guard()
    if guard is not None:  # the server's (prepare_server): replaced here if it died
        guard.watch(loop)
        guard.ensure()
    owner = owner_id()
    spawn = f"{owner}:{next(_spawn_numbers)}"
    transport, protocol = await loop.subprocess_exec(
        lambda: _ChildProtocol(model, logs, loop),
        *argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env, OWNER_ENV: owner, SPAWN_ENV: spawn},
        start_new_session=True,
        preexec_fn=_die_with_parent(),
    )
    pid = transport.get_pid()
    stat = _stat(pid)
    child = _Child(transport, protocol, spawn, stat.start if stat is not None else None)
    _records.add(pid, model, role, child.start, spawn)
    return child


def describe_exit(returncode: int) -> str:
    """``"exited with code 1"`` or ``"killed by SIGKILL"``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


# -- the model process -----------------------------------------------------------------------

ExitCallback = Callable[["ModelProcess"], None]


class ModelProcessLike(Protocol):
    """What the dispatcher relies on (its ``process_factory`` returns one, and mypy checks
    the dispatcher against this, not against :class:`ModelProcess`);
    :class:`scheduler.testing.FakeModelProcess` has it too."""

    config: ModelConfig

    @property
    def state(self) -> ModelState: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def exited(self) -> asyncio.Event: ...
    @property
    def alive(self) -> bool: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class ModelProcess:
    """One model's server process. See the module docstring for states and signals.

    ``on_exit(self)`` is called (synchronously, on the loop) when a READY process exits on
    its own, after it has been reaped and its state set to STOPPED. It is not called for
    exits caused by :meth:`stop` or during a start: those are reported by their own return
    or exception. Nor is it called when :meth:`stop` was called after the process died but
    before its exit was reported (:attr:`alive` already False, state still READY): the stop
    wins, goes STOPPING at once, returns once the process is reaped, and ``returncode`` is
    the process's own.
    """

    def __init__(
        self,
        config: ModelConfig,
        logs: LogBuffer,
        *,
        http_client: httpx.AsyncClient | None = None,
        on_exit: ExitCallback | None = None,
    ) -> None:
        self.config = config
        self.logs = logs
        self.on_exit = on_exit
        self._http_client = http_client
        self._state = ModelState.STOPPED
        self._child: _Child | None = None
        self._returncode: int | None = None
        self._exited = asyncio.Event()
        self._exited.set()
        self._abort = asyncio.Event()
        self._start_done: asyncio.Future[None] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def __repr__(self) -> str:
        return f"<ModelProcess {self.config.id} {self._state.value} pid={self.pid}>"

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def state(self) -> ModelState:
        return self._state

    @property
    def pid(self) -> int | None:
        """The pid of the current process, or of the last one once it has exited."""
        return self._child.pid if self._child is not None else None

    @property
    def returncode(self) -> int | None:
        """None while the process runs (or before the first start); negative for a signal."""
        return self._returncode

    @property
    def alive(self) -> bool:
        """True while the current OS process exists and has not exited.

        It turns False the moment the process dies, before anything else changes: until
        asyncio has reaped it and this object has torn down its group (a few loop iterations,
        up to :data:`REAP_TIMEOUT` when a leftover will not die), ``state`` may still be READY
        and ``exited`` unset, and ``on_exit`` has not been called yet.
        """
        return self._child is not None and self._child.alive

    @property
    def exited(self) -> asyncio.Event:
        """Set once the current process has exited and been reaped, for any reason.

        Each :meth:`start` replaces it with a fresh, unset event; before the first start,
        and after a start that could not spawn anything, it is set.
        """
        return self._exited

    def _set_state(self, new: ModelState) -> None:
        old, self._state = self._state, new
        if old is not new:
            logger.info(
                "model %s: %s -> %s",
                self.id,
                old.value,
                new.value,
                extra={"action": "state", "model": self.id, "old": old.value, "new": new.value},
            )

    def _spawn_task(self, coro: Coroutine[object, object, None], name: str) -> asyncio.Task[None]:
        # Strong references: the loop only keeps weak ones to running tasks.
        task = asyncio.create_task(coro, name=f"{name}:{self.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the model and return once it is READY.

        READY already: returns at once. STARTING: waits for the start in progress and shares
        its outcome. STOPPING: waits for the stop to finish, then starts.

        Raises :class:`ModelStartError` when the command cannot be run, the process exits
        before it is healthy, the health check does not pass within
        ``config.health_check_timeout``, or :meth:`stop` is called meanwhile (cause
        ``"stopped while starting"``). Whatever was spawned is stopped and reaped before
        the error is raised. If the task awaiting ``start()`` is cancelled, the process is
        likewise stopped and reaped, then ``CancelledError`` propagates.
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
        self._set_state(ModelState.STARTING)
        try:
            await self._start()
        except BaseException as exc:
            if isinstance(exc, ModelStartError):
                done.set_exception(exc)
            else:
                done.set_exception(ModelStartError(self.id, "start was cancelled"))
            done.exception()  # retrieved: nobody else need be waiting
            raise
        done.set_result(None)

    async def _start(self) -> None:
        config = self.config
        if not config.cmd:
            self._exited.set()
            self._set_state(ModelState.STOPPED)
            raise ModelStartError(self.id, "cmd is empty")
        try:
            # Its health check must not be answered by a process it did not start.
            squatter = await _port_in_use(config.proxy)
            if squatter is not None:
                host, port = squatter
                cause = (
                    f"port {host}:{port} is already in use by another process "
                    f"(something accepts connections at {config.proxy} before the model runs)"
                )
                logger.warning(
                    "model %s: %s",
                    self.id,
                    cause,
                    extra={"action": "port_in_use", "model": self.id, "host": host, "port": port},
                )
                raise ModelStartError(self.id, cause)
            if self._abort.is_set():
                raise ModelStartError(self.id, "stopped while starting")
            child = await _spawn(config.cmd, config.env, self.id, self.logs)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self._exited.set()
            self._set_state(ModelState.STOPPED)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ModelStartError(self.id, f"could not run {config.cmd[0]!r}: {reason}") from exc
        except BaseException:  # the port check's error, a stop or a cancel: nothing runs
            self._exited.set()
            self._set_state(ModelState.STOPPED)
            raise
        self._child = child
        logger.info(
            "model %s: spawned pid %d",
            self.id,
            child.pid,
            extra={"action": "spawn", "model": self.id, "pid": child.pid, "cmd": config.cmd},
        )
        self._spawn_task(self._watch(child, self._exited), "watch")

        try:
            failure = await self._wait_healthy()
        except BaseException:
            await asyncio.shield(self._begin_stop())
            raise
        if failure is not None:
            logger.warning(
                "model %s: start failed: %s",
                self.id,
                failure,
                extra={"action": "start_failed", "model": self.id, "cause": failure},
            )
            await asyncio.shield(self._begin_stop())
            raise ModelStartError(self.id, failure)
        self._set_state(ModelState.READY)

    async def _wait_healthy(self) -> str | None:
        """None once healthy, else why not. Stop and exit win over a simultaneous success."""
        config = self.config
        waits: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self._abort.wait()),
            asyncio.ensure_future(self._exited.wait()),
        ]
        checker = None
        if config.check_endpoint is not None:
            url = config.proxy.rstrip("/") + "/" + config.check_endpoint.lstrip("/")
            checker = asyncio.ensure_future(self._poll_health(url))
            waits.append(checker)
        try:
            if checker is not None:
                await asyncio.wait(
                    waits,
                    timeout=config.health_check_timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            else:
                await asyncio.sleep(0)  # let an already-set abort or a spawn failure show
        finally:
            for task in waits:
                task.cancel()
        if self._abort.is_set():
            return "stopped while starting"
        if self._exited.is_set():
            assert self._returncode is not None
            return f"process {describe_exit(self._returncode)} before becoming healthy"
        if checker is None:
            return None
        if checker.done() and not checker.cancelled():
            exc = checker.exception()
            if exc is None:
                return None
            return f"health check failed: {exc}"
        return f"health check timed out after {config.health_check_timeout:g}s"

    async def _poll_health(self, url: str) -> None:
        """Return once ``url`` answers 200; connection errors and other statuses are retried."""
        client = self._http_client
        owned = client is None
        if client is None:
            client = httpx.AsyncClient(trust_env=False)
        try:
            while True:
                try:
                    response = await client.get(url, timeout=HEALTH_REQUEST_TIMEOUT)
                    if response.status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(HEALTH_POLL_INTERVAL)
        finally:
            if owned:
                await client.aclose()

    async def _watch(self, child: _Child, exited: asyncio.Event) -> None:
        returncode = await child.wait()
        # The leader is reaped; anything left in its group (a wrapper's background child),
        # or carrying its marker, goes too: the model has exited once its whole tree is dead
        # (so its port is free for whatever starts next).
        try:
            await child.teardown(self.id)
        except Exception:  # never leave exited unset: stop() waits for it
            logger.exception("model %s: group teardown failed", self.id, extra={"model": self.id})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(child.protocol.output_closed), LOG_DRAIN_TIMEOUT)
        child.transport.close()
        if self._child is child:
            self._returncode = returncode
        exited.set()
        logger.info(
            "model %s: pid %d %s",
            self.id,
            child.pid,
            describe_exit(returncode),
            extra={"action": "exit", "model": self.id, "pid": child.pid, "returncode": returncode},
        )
        if self._child is child and self._state is ModelState.READY:
            logger.warning(
                "model %s: exited unexpectedly (%s)",
                self.id,
                describe_exit(returncode),
                extra={"action": "crash", "model": self.id, "returncode": returncode},
            )
            self._set_state(ModelState.STOPPED)
            if self.on_exit is not None:
                try:
                    self.on_exit(self)
                except Exception:
                    logger.exception("on_exit callback failed", extra={"model": self.id})

    # -- stop ----------------------------------------------------------------------------------

    async def stop(self) -> None:
        """Stop the model and return once its process is reaped; the state is then STOPPED.

        Idempotent. While STARTING, the start is abandoned: the ``start()`` call raises
        :class:`ModelStartError` with cause ``"stopped while starting"`` and this returns once
        that start has cleaned up. The stop itself runs in a task of its own, so cancelling
        the caller does not leave a half-stopped process.
        """
        if self._state is ModelState.STARTING:
            assert self._start_done is not None
            self._abort.set()
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

    async def _stop_process(self) -> None:
        child = self._child
        self._set_state(ModelState.STOPPING)
        try:
            if child is not None and child.running:
                await self._terminate(child)
            await self._exited.wait()
        finally:
            self._set_state(ModelState.STOPPED)

    async def _terminate(self, child: _Child) -> None:
        """cmd_stop or SIGTERM to the group; SIGKILL to the group after ``unload_timeout``."""
        config = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.unload_timeout
        stopper = None
        if config.cmd_stop:
            argv = tuple(arg.replace("${PID}", str(child.pid)) for arg in config.cmd_stop)
            logger.info(
                "model %s: running cmd_stop",
                self.id,
                extra={"action": "cmd_stop", "model": self.id, "cmd": argv},
            )
            try:
                stopper = await _spawn(argv, config.env, self.id, self.logs, role="cmd_stop")
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                logger.warning(
                    "model %s: cmd_stop failed (%s), sending SIGTERM",
                    self.id,
                    exc,
                    extra={"action": "cmd_stop_failed", "model": self.id},
                )
        if stopper is None:
            child.signal_tree(signal.SIGTERM)
        try:
            if stopper is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopper.wait(), max(0.0, deadline - loop.time()))
            try:
                await asyncio.wait_for(child.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                logger.warning(
                    "model %s: still running after %gs, sending SIGKILL",
                    self.id,
                    config.unload_timeout,
                    extra={"action": "kill", "model": self.id, "pid": child.pid},
                )
                child.signal_tree(signal.SIGKILL)
                await child.wait()
        finally:
            if stopper is not None:
                stopper.signal_tree(signal.SIGKILL)
                await stopper.wait()
                try:
                    await stopper.teardown(self.id)
                except Exception:
                    logger.exception("model %s: cmd_stop teardown failed", self.id)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        asyncio.shield(stopper.protocol.output_closed), LOG_DRAIN_TIMEOUT
                    )
                stopper.transport.close()
