"""The guard: the sweep (:mod:`scheduler.sweep`) run the moment the server dies.

The guard (:class:`Guard`, started by ``scheduler.spawn.prepare_server``): one small
process per server, in a session of its own, holding the read end of a pipe whose write end
only the server holds (close-on-exec, so no model inherits it). When the server dies, even
by SIGKILL, the kernel closes that write end; the guard reads EOF at once and runs
:func:`~scheduler.sweep.reap_instance` for its server: the recorded groups and everything
carrying the server's owner marker are SIGKILLed, so a model started through a shell
wrapper, or one that left its group with ``setsid``, dies within milliseconds of the server
rather than at the next start. A server that exits normally (its models stopped, its record
empty) writes :data:`STAND_DOWN` first, and the guard exits without sweeping. Being in its
own session, the guard gets neither the terminal's signals nor a signal a model sends to
its own group. If the guard itself dies, the server notices (a pidfd on its loop, and a
check at every spawn), logs an error and starts another; in between, the protection falls
back to ``PR_SET_PDEATHSIG`` (the direct child) and the next start's
:func:`~scheduler.sweep.reap_leftovers`.

This module imports only the standard library and :mod:`scheduler.sweep` (likewise): the
guard process starts in a fraction of the server's start-up time and memory.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scheduler.sweep import logger, owner_id, reap_instance, records, state_dir

STAND_DOWN = b"q"
"""What the server writes to the guard's pipe at a normal exit: go, sweep nothing."""
GUARD_RESTART_INTERVAL = 1.0
"""At most one guard start per this many seconds, should a new guard die at once."""
_ROOT = Path(__file__).resolve().parent.parent
_GUARD_CODE = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from scheduler.guard import main; raise SystemExit(main(sys.argv[2:]))"
)


class Guard:
    """The server's side of its guard process (see the module docstring).

    :meth:`start` it once; :meth:`watch` it from the server's event loop; :meth:`ensure`
    before each spawn; :meth:`stand_down` at exit (registered with :mod:`atexit` by
    :func:`start_guard`). Used from the server's main thread only.
    """

    def __init__(self, owner: str, directory: Path) -> None:
        self.owner = owner
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        """Guards started after the first one died."""
        self._pid = os.getpid()
        self._write: int | None = None
        self._pidfd: int | None = None
        self._loop: Any = None
        self._started_at = 0.0
        self._closed = False

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Spawn a guard holding the read end of a fresh pipe; keep its write end."""
        read, write = os.pipe()  # both close-on-exec: no model inherits either end
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-S",  # no site-packages: only the standard library and this module
                    "-c",
                    _GUARD_CODE,
                    str(_ROOT),
                    *(str(read), self.owner, str(self.directory)),
                ],
                pass_fds=(read,),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # no terminal signal, nor a model's killpg, reaches it
            )
        except BaseException:
            os.close(write)
            raise
        finally:
            os.close(read)
        old, self._write = self._write, write
        if old is not None:
            os.close(old)
        self._started_at = time.monotonic()
        logger.info(
            "guard pid %d watches llamaswap %s",
            self.process.pid,
            self.owner,
            extra={"action": "guard_started", "pid": self.process.pid, "owner": self.owner},
        )
        if self._loop is not None:
            self._watch()

    def watch(self, loop: Any) -> None:
        """Notice the guard's death at once on ``loop`` (the server's): a pidfd reader."""
        if self._loop is loop or self._closed:
            return
        self._unwatch()
        self._loop = loop
        self._watch()

    def _watch(self) -> None:
        self._unwatch()
        if self.process is None or not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(self.process.pid)
        except OSError:  # gone already (and reaped): ensure() replaces it
            return
        try:
            self._loop.add_reader(fd, self._died)
        except (RuntimeError, NotImplementedError, OSError):
            os.close(fd)
            return
        self._pidfd = fd

    def _unwatch(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is None:
            return
        with contextlib.suppress(Exception):  # a loop already closed at exit
            self._loop.remove_reader(fd)
        os.close(fd)

    def _died(self) -> None:
        self._unwatch()
        if self._closed or self.process is None or self.process.poll() is None:
            if not self._closed:
                self._watch()
            return
        delay = max(0.0, GUARD_RESTART_INTERVAL - (time.monotonic() - self._started_at))
        self._lost(self.process.returncode)
        self._loop.call_later(delay, self._restart)

    def _lost(self, returncode: int | None) -> None:
        assert self.process is not None
        logger.error(
            "guard pid %d exited (%s); starting another: until then a model that outlives "
            "a killed server is swept at the next start",
            self.process.pid,
            returncode,
            extra={"action": "guard_lost", "pid": self.process.pid, "returncode": returncode},
        )

    def ensure(self) -> None:
        """Before a spawn: replace a guard that died unnoticed (costs one ``waitpid``)."""
        if self._closed or self.process is None or self.process.poll() is None:
            return
        if time.monotonic() - self._started_at < GUARD_RESTART_INTERVAL:
            return  # dying at once: the watcher's timer retries
        self._lost(self.process.returncode)
        self._restart()

    def _restart(self) -> None:
        if self._closed or self.alive:
            return
        self.restarts += 1
        try:
            self.start()
        except OSError as exc:
            logger.error("cannot start a guard: %s", exc, extra={"action": "guard_failed"})

    def stand_down(self) -> None:
        """The server exits normally: the guard goes without sweeping, unless this instance
        still has process groups on record (a model that would not die), which it then
        sweeps as if the server had been killed."""
        if self._closed or os.getpid() != self._pid:  # a forked child's exit is not ours
            return
        self._closed = True
        self._unwatch()
        write, self._write = self._write, None
        if write is None:
            return
        try:
            if not records.groups:
                os.write(write, STAND_DOWN)
        except OSError:
            pass
        finally:
            os.close(write)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=1.0)


_guard: Guard | None = None


def start_guard() -> Guard:
    """This server's guard, started once (``scheduler.spawn.prepare_server`` calls it)."""
    global _guard
    if _guard is None or _guard._pid != os.getpid():
        _guard = Guard(owner_id(), state_dir())
        _guard.start()
        atexit.register(_guard.stand_down)
    return _guard


def current_guard() -> Guard | None:
    """The guard of this process, if :func:`start_guard` was called."""
    if _guard is None or _guard._pid != os.getpid():
        return None
    return _guard


def main(argv: list[str] | None = None) -> int:
    """The guard process: wait for the server's end, then sweep what it left (see above).

    ``argv``: the pipe's read end (an fd number), the server's owner id, its state directory.
    """
    fd_arg, owner, directory = sys.argv[1:] if argv is None else argv
    fd = int(fd_arg)
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s llamaswap.guard %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    while True:
        try:
            data = os.read(fd, 64)
        except OSError as exc:
            logger.error("guard cannot read its pipe: %s", exc)
            return 1
        if not data:
            break  # every write end is closed: the server is gone
        if STAND_DOWN in data:
            return 0
    started = time.monotonic()
    killed = reap_instance(owner, directory)
    logger.log(
        logging.WARNING if killed else logging.INFO,
        "llamaswap %s is gone; its guard killed %d process(es) it left, in %.0f ms",
        owner,
        len(killed),
        (time.monotonic() - started) * 1000,
    )
    return 0
