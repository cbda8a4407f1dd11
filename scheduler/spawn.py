"""The OS side of a model process: spawned in a session of its own, marked and recorded
(:mod:`scheduler.sweep`), its output fed into a :class:`LogBuffer`, its group signalled and
swept once it is reaped; and the server's supervision set-up (:func:`prepare_server`).
:class:`scheduler.process.ModelProcess` drives these; see its module docstring for why.

Everything here must be used from one event loop; nothing is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import ipaddress
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from scheduler.guard import current_guard, start_guard
from scheduler.logbuffer import LogBuffer
from scheduler.sweep import (
    OWNER_ENV,
    REAP_TIMEOUT,
    SPAWN_ENV,
    kill_and_wait,
    owner_id,
    proc_stat,
    reap_leftovers,
    records,
    set_state_dir,
    spawn_marker,
)

logger = logging.getLogger("scheduler.process")

LOG_DRAIN_TIMEOUT = 1.0
"""How long to wait, after the process exits, for the rest of its output."""
MAX_LINE_BYTES = 16 * 1024
"""Longer output without a newline is cut into lines of this size."""


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


# -- supervision: this server a subreaper, leftovers swept, its guard started ---------------
# (the markers, records and sweep: scheduler/sweep.py; the guard: scheduler/guard.py; both
# standard library only, as the guard process imports them alone)

PORT_CHECK_TIMEOUT = 0.25
"""The connect attempt that tells whether something already listens on a model's port."""

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
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


def _is_subreaper() -> bool:
    if _prctl is None:
        return False
    flag = ctypes.c_int(0)
    return _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and bool(flag.value)


def _descendants() -> list[int]:
    """The pids of this process's descendants (``/proc/<pid>/task/<tid>/children``)."""
    found: list[int] = []
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    children = [int(child) for child in f.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found


def _leftover_scope() -> Callable[[], list[int]] | None:
    """Where a reaped model's leftovers can be: with this server a subreaper
    (:func:`prepare_server`), each one is its descendant (an orphan goes to the nearest
    subreaper above it), so a teardown looks at those few processes rather than reading
    every process's environment on the machine (~10 ms with ~130 processes, on every swap's
    path). None (every process) when not a subreaper or the kernel lacks the children lists."""
    pid = os.getpid()
    if _is_subreaper() and os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return _descendants
    return None


def prepare_server(directory: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """What ``manage.py serve`` calls once, before serving: :func:`set_state_dir`,
    :func:`become_subreaper`, :func:`reap_leftovers`, then start this server's guard
    (:func:`scheduler.guard.start_guard`: its models die with it). Returns what was killed."""
    set_state_dir(directory)
    become_subreaper()
    _setpriv()  # looked up now, not on the loop at the first spawn
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


async def port_in_use(url: str) -> tuple[str, int] | None:
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


@functools.cache
def _setpriv() -> str | None:
    """util-linux's ``setpriv`` if it has ``--pdeathsig`` (Linux, util-linux >= 2.33)."""
    path = shutil.which("setpriv") if _prctl is not None else None
    if path is None:
        return None
    try:
        out = subprocess.run(
            [path, "--help"], capture_output=True, timeout=5, check=False, env={}
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path if b"--pdeathsig" in out else None


def _with_death_signal(
    argv: tuple[str, ...], env: Mapping[str, str]
) -> tuple[tuple[str, ...], Callable[[], None] | None]:
    """``(argv, preexec_fn)`` that spawn ``argv`` to be SIGKILLed when its parent thread dies.

    With ``setpriv --pdeathsig KILL`` in front when it is there: no ``preexec_fn``, so the
    interpreter spawns with ``vfork`` rather than copying this whole process with ``fork``
    (~50 ms saved per spawn from a server of ~150 MB, more on a busy machine: it is on every
    swap's path). ``setpriv`` execs ``argv`` (same pid, group and environment). A missing or
    non-executable program is reported as ``exec`` would have (``OSError``), before
    spawning. Without ``setpriv``: :func:`_die_with_parent`. Either way a server killed
    before the child has set the signal leaves it to the guard (:mod:`scheduler.guard`).
    """
    setpriv = _setpriv()
    if setpriv is None:
        return argv, _die_with_parent()
    program = argv[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    elif shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    return (setpriv, "--pdeathsig", "KILL", "--", *argv), None


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
        self.spoke = asyncio.Event()
        """Set by output (cleared by whoever waits for the next): a starting server's health
        check looks at once (:mod:`scheduler.process`). Not by lines that hold
        :attr:`quiet`."""
        self.quiet: bytes | None = None
        """Lines holding it are no news: the health check's path, which a server that logs
        every request it answers writes for each check (else each check would prompt the
        next)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self.transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        *lines, pending = (self._pending + data).split(b"\n")
        if not self.spoke.is_set():
            quiet = self.quiet
            if quiet is None or any(
                quiet not in line for line in (*lines, pending) if line.strip()
            ):
                self.spoke.set()
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


class Child:
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
        carrying its spawn marker (one that ``setsid`` took out of the group; looked for among
        this server's descendants when it is a subreaper: :func:`_leftover_scope`), wait until they
        are dead (up to :data:`REAP_TIMEOUT`) and reap those that were reparented to us.

        A group id is not reused while any member lives, and the sweep ignores the group
        once a process has the leader's pid again. True when nothing is left; the group then
        leaves this instance's record.
        """
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        deadline = time.monotonic() + REAP_TIMEOUT
        killed, remaining = await asyncio.to_thread(
            kill_and_wait,
            {self.pid: None},
            [spawn_marker(self.spawn)],
            deadline,
            _leftover_scope(),
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
        records.discard(self.pid)
        return True


async def spawn(
    argv: tuple[str, ...],
    env: Mapping[str, str],
    model: str,
    logs: LogBuffer,
    *,
    role: str = "model",
) -> Child:
    """Spawn in a new session, marked and recorded (see the module docstring)."""
    loop = asyncio.get_running_loop()
    guard = current_guard()
    if guard is not None:  # the server's (prepare_server): replaced here if it died
        guard.watch(loop)
        guard.ensure()
    owner = owner_id()
    spawn = f"{owner}:{next(_spawn_numbers)}"
    child_env = {**os.environ, **env, OWNER_ENV: owner, SPAWN_ENV: spawn}
    argv, preexec = _with_death_signal(argv, child_env)
    transport, protocol = await loop.subprocess_exec(
        lambda: _ChildProtocol(model, logs, loop),
        *argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env,
        start_new_session=True,
        preexec_fn=preexec,
    )
    pid = transport.get_pid()
    stat = proc_stat(pid)
    child = Child(transport, protocol, spawn, stat.start if stat is not None else None)
    records.add(pid, model, role, child.start, spawn)
    return child


def describe_exit(returncode: int) -> str:
    """``"exited with code 1"`` or ``"killed by SIGKILL"``."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"
