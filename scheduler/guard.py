"""Supervision of the model processes: their markers, this instance's record of them, the
sweep that kills what is left of them, and the guard that sweeps the moment the server dies.

Markers and records (used by :mod:`scheduler.process`, which spawns): every spawned process
carries ``LLAMASWAP_OWNER=<server pid>:<server start time>`` and a per-spawn
``LLAMASWAP_SPAWN`` in its environment, and each server instance keeps a JSON record of the
process groups it started in the state directory (:func:`set_state_dir`). :func:`_sweep`
SIGKILLs every process of some groups or carrying some markers and waits for them to die;
:func:`reap_leftovers` runs it, at a server's start, for every *dead* instance's record.

The guard (:class:`Guard`, started by ``scheduler.process.prepare_server``): one small
process per server, in a session of its own, holding the read end of a pipe whose write end
only the server holds (close-on-exec, so no model inherits it). When the server dies, even
by SIGKILL, the kernel closes that write end; the guard reads EOF at once and runs
:func:`reap_instance` for its server: the recorded groups and everything carrying the
server's owner marker are SIGKILLed, so a model started through a shell wrapper, or one that
left its group with ``setsid``, dies within milliseconds of the server rather than at the
next start. A server that exits normally (its models stopped, its record empty) writes
:data:`STAND_DOWN` first, and the guard exits without sweeping. Being in its own session,
the guard gets neither the terminal's signals nor a signal a model sends to its own group.
If the guard itself dies, the server notices (a pidfd on its loop, and a check at every
spawn), logs an error and starts another; in between, the protection falls back to
``PR_SET_PDEATHSIG`` (the direct child) and the next start's :func:`reap_leftovers`.

This module imports only the standard library: the guard process starts in a fraction of
the server's start-up time and memory.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

# The process layer's logger: these lines are about model processes, whichever module or
# process (the server, its guard) writes them.
logger = logging.getLogger("scheduler.process")

OWNER_ENV = "LLAMASWAP_OWNER"
"""In every spawned process's environment: ``<server pid>:<server start time>`` (see
:func:`owner_id`). Descendants inherit it unless they clear their environment."""
SPAWN_ENV = "LLAMASWAP_SPAWN"
"""In every spawned process's environment: ``<owner id>:<n>``, unique per spawn, so what one
model left behind can be found even if it left the model's process group."""
STATE_DIR_ENV = "LLAMASWAP_STATE_DIR"
DEFAULT_STATE_DIR = Path(__file__).resolve().parent.parent / "var"
"""Where the records go unless :func:`set_state_dir` or ``$LLAMASWAP_STATE_DIR`` says
otherwise. Files are named ``owner-<pid>-<start time>.json``; a file exists only while its
instance has live process groups (or died with some)."""
REAP_TIMEOUT = 5.0
"""How long a group teardown or :func:`reap_leftovers` waits for SIGKILLed processes to die."""
REAP_POLL_INTERVAL = 0.01


class _Stat(NamedTuple):
    state: str
    ppid: int
    pgrp: int
    start: int
    """Field 22 of ``/proc/<pid>/stat``: clock ticks after boot. With the pid it names one
    process for good (pids are reused, start times of a pid are not)."""


def _stat(pid: int) -> _Stat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data.rsplit(b")", 1)[-1].split()
    try:
        return _Stat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _running(stat: _Stat | None) -> bool:
    """Exists and has not exited (a zombie has: it holds no memory, files or sockets)."""
    return stat is not None and stat.state not in ("Z", "X", "x")


def _environ(pid: int) -> set[bytes]:
    """The ``KEY=value`` entries of a process's initial environment; empty if unreadable
    (another user's process, a zombie, a kernel thread)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return set(f.read().split(b"\0"))
    except OSError:
        return set()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


_owner: tuple[int, str] | None = None


def owner_id() -> str:
    """``<pid>:<start time>`` of this server process: the value of ``LLAMASWAP_OWNER``."""
    global _owner
    pid = os.getpid()
    if _owner is None or _owner[0] != pid:  # computed again in a forked child
        stat = _stat(pid)
        _owner = (pid, f"{pid}:{stat.start if stat is not None else 0}")
    return _owner[1]



class _Records:
    """The JSON file of this instance: its identity and its live process groups.

    ``{"pid", "start_time", "owner", "groups": [{"pgid", "model", "role", "start_time",
    "spawn"}]}``, rewritten atomically whenever a group is added or found gone, and removed
    when there is none left. A write failure is logged, never raised: supervision must not
    stop a model from starting.
    """

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.groups: dict[int, dict[str, Any]] = {}
        self._pid = os.getpid()
        self._warned = False

    def state_dir(self) -> Path:
        if self.directory is not None:
            return self.directory
        return Path(os.environ.get(STATE_DIR_ENV) or DEFAULT_STATE_DIR)

    def path(self) -> Path:
        return self.state_dir() / f"owner-{owner_id().replace(':', '-')}.json"

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # a forked child: the groups are its parent's
            self._pid = os.getpid()
            self.groups = {}

    def add(self, pgid: int, model: str, role: str, start: int | None, spawn: str) -> None:
        self._check_fork()
        self.groups[pgid] = {
            "pgid": pgid,
            "model": model,
            "role": role,
            "start_time": start,
            "spawn": spawn,
        }
        self.save()

    def discard(self, pgid: int) -> None:
        self._check_fork()
        if self.groups.pop(pgid, None) is not None:
            self.save()

    def save(self) -> None:
        path = self.path()
        try:
            if not self.groups:
                path.unlink(missing_ok=True)
                return
            pid, start = owner_id().split(":")
            record = {
                "pid": int(pid),
                "start_time": int(start),
                "owner": owner_id(),
                "groups": list(self.groups.values()),
            }
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "cannot write the process record %s: %s",
                    path,
                    exc,
                    extra={"action": "record_failed", "path": str(path)},
                )


_records = _Records()


def set_state_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Where this instance records its process groups (and looks for dead instances').

    None: ``$LLAMASWAP_STATE_DIR``, else ``<project>/var/``. Returns the directory. A record
    already written moves to the new directory.
    """
    old = _records.path()
    _records.directory = Path(path) if path is not None else None
    directory = _records.state_dir()
    if _records.groups and old != _records.path():
        with contextlib.suppress(OSError):
            old.unlink()
        _records.save()
    return directory


def state_dir() -> Path:
    return _records.state_dir()


def _kill_exact(pid: int, start: int) -> bool:
    """SIGKILL the process ``pid`` only if it is still the one that started at ``start``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (OSError, AttributeError):
        fd = None
    try:
        stat = _stat(pid)
        if stat is None or stat.start != start:
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _reap_zombie(pid: int, start: int) -> None:
    """Reap ``pid`` if it is a zombie child of ours: an orphan reparented to us (subreaper).

    Only for processes found carrying a model's marker, never spawned by asyncio, so no
    exit status asyncio waits for is taken.
    """
    stat = _stat(pid)
    if stat is None or stat.start != start or stat.ppid != os.getpid() or _running(stat):
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def _reap_group(pgid: int) -> None:
    """Reap the zombie members of a group whose leader is already reaped, if ours."""
    while True:
        try:
            if os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG) is None:
                return
        except (ChildProcessError, OSError):
            return


class _Target(NamedTuple):
    pid: int
    start: int
    why: str
    """``"group"`` or ``"marker"``."""
    key: Any
    """The pgid, or the marker entry that matched."""
    cmd: str
    spawn: str | None
    """Its ``LLAMASWAP_SPAWN`` (marker matches only): which spawn it descends from."""


def _sweep(
    groups: Mapping[int, int | None],
    markers: Iterable[bytes],
    deadline: float,
) -> tuple[list[_Target], list[_Target]]:
    """SIGKILL every running process in ``groups`` (pgid -> leader start time, or None for a
    leader already reaped) or whose environment has one of ``markers``; wait, until
    ``deadline`` (``time.monotonic``), for them and whatever they fork meanwhile to die.

    A group counts only while its pgid is not someone else's: no process has that pid, or
    the recorded leader does. Returns ``(killed, still running)``. Runs in a thread.
    """
    markers = frozenset(markers)
    me = os.getpid()
    spare = {1, me}  # never init, ourselves or an ancestor
    ancestor = _stat(me)
    while ancestor is not None and ancestor.ppid not in spare and ancestor.ppid > 0:
        spare.add(ancestor.ppid)
        ancestor = _stat(ancestor.ppid)
    valid: set[int] = set()
    for pgid, leader_start in groups.items():
        leader = _stat(pgid)
        if leader is None or (leader_start is not None and leader.start == leader_start):
            valid.add(pgid)
    killed: dict[tuple[int, int], _Target] = {}
    while True:
        found: list[_Target] = []
        for pid in _pids():
            if pid in spare:
                continue
            stat = _stat(pid)
            if not _running(stat):
                continue
            assert stat is not None
            if stat.pgrp in valid:
                found.append(_Target(pid, stat.start, "group", stat.pgrp, _cmdline(pid), None))
            elif markers:
                env = _environ(pid)
                hits = markers & env
                if hits:
                    spawn = next((e for e in env if e.startswith(_SPAWN_PREFIX)), b"")
                    spawn_id = spawn[len(_SPAWN_PREFIX) :].decode(errors="replace") or None
                    found.append(
                        _Target(pid, stat.start, "marker", min(hits), _cmdline(pid), spawn_id)
                    )
        for target in found:
            if (target.pid, target.start) not in killed and _kill_exact(target.pid, target.start):
                killed[(target.pid, target.start)] = target
        for pgid in valid:
            _reap_group(pgid)
        for target in killed.values():
            _reap_zombie(target.pid, target.start)
        if not found:
            return list(killed.values()), []
        for pgid in tuple(valid):  # an emptied group's id taken by someone else meanwhile
            leader = _stat(pgid)
            if leader is not None and leader.start != groups[pgid]:
                valid.discard(pgid)
        if time.monotonic() >= deadline:
            return list(killed.values()), found
        time.sleep(REAP_POLL_INTERVAL)


_SPAWN_PREFIX = f"{SPAWN_ENV}=".encode()


def _owner_marker(owner: str) -> bytes:
    return f"{OWNER_ENV}={owner}".encode()


def _spawn_marker(spawn: str) -> bytes:
    return f"{SPAWN_ENV}={spawn}".encode()


def _read_record(path: Path) -> dict[str, Any] | None:
    """A record with ``owner`` and well-formed ``groups``; None if gone or unreadable (logged)."""
    try:
        record: dict[str, Any] = json.loads(path.read_text())
        pid, start = int(record["pid"]), int(record["start_time"])
        record["owner"] = f"{pid}:{start}"
        record["groups"] = [
            g for g in record.get("groups", ()) if isinstance(g, dict) and "pgid" in g
        ]
    except FileNotFoundError:
        return None  # another instance reaped it meanwhile
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning(
            "unreadable process record %s: %s",
            path,
            exc,
            extra={"action": "record_unreadable", "path": str(path)},
        )
        return None
    return record


def _record_path(directory: Path, owner: str) -> Path:
    return directory / f"owner-{owner.replace(':', '-')}.json"


def reap_leftovers(
    directory: str | os.PathLike[str] | None = None, *, timeout: float = REAP_TIMEOUT
) -> list[dict[str, Any]]:
    """Kill what dead llamaswap instances left running; returns what was killed.

    For each record in the state directory (``directory``, else :func:`state_dir`) whose
    server is gone (its pid is dead, or belongs to a process with another start time):
    SIGKILL every process still in one of its recorded groups and every process whose
    environment carries its ``LLAMASWAP_OWNER`` marker, wait up to ``timeout`` seconds for
    them to die, log each one, then delete the record (kept, with an error logged, if some
    would not die). Records of live instances are left alone, and so are their processes.
    Blocking; run it before serving (or in a thread).
    """
    root = Path(directory) if directory is not None else state_dir()
    try:
        paths = sorted(root.glob("owner-*.json"))
    except OSError:
        return []
    dead: list[tuple[Path, dict[str, Any]]] = []
    for path in paths:
        record = _read_record(path)
        if record is None:
            continue
        pid, start = (int(part) for part in record["owner"].split(":"))
        server = _stat(pid)
        if _running(server) and server is not None and server.start == start:
            continue  # a live instance: its processes are its own business
        dead.append((path, record))
    return _reap_records(dead, timeout)


def reap_instance(
    owner: str, directory: str | os.PathLike[str], *, timeout: float = REAP_TIMEOUT
) -> list[dict[str, Any]]:
    """Kill what the instance ``owner`` (``<pid>:<start time>``) left running: its recorded
    groups, if it has a record in ``directory``, and every process carrying its owner marker;
    as :func:`reap_leftovers` does for a dead instance, without asking whether it is dead
    (the guard knows it is: the pipe's EOF comes while the kernel tears the server down,
    before its pid reads as a zombie). Blocking."""
    path = _record_path(Path(directory), owner)
    record = _read_record(path) or {"groups": []}
    record["owner"] = owner
    return _reap_records([(path, record)], timeout)


def _reap_records(
    dead: list[tuple[Path, dict[str, Any]]], timeout: float
) -> list[dict[str, Any]]:
    """SIGKILL what the instances of ``dead`` (record path, record) left, log it, and delete
    their records once nothing is left (kept for the next start otherwise)."""
    if not dead:
        return []

    groups: dict[int, int | None] = {}
    by_group: dict[int, tuple[str, str]] = {}
    by_marker: dict[bytes, tuple[str, str]] = {}
    by_spawn: dict[str, str] = {}
    for _, record in dead:
        owner = record["owner"]
        by_marker[_owner_marker(owner)] = (owner, "?")
        for group in record["groups"]:
            pgid = int(group["pgid"])
            leader_start = group.get("start_time")
            groups[pgid] = int(leader_start) if leader_start is not None else None
            by_group[pgid] = (owner, str(group.get("model", "?")))
            by_spawn[str(group.get("spawn"))] = str(group.get("model", "?"))

    def describe(target: _Target) -> tuple[str, str]:
        """(owner, model) of a leftover; the model is "?" for a spawn no longer recorded."""
        if target.why == "group":
            return by_group.get(target.key, ("?", "?"))
        owner, _ = by_marker.get(target.key, ("?", "?"))
        return owner, by_spawn.get(str(target.spawn), "?")

    killed, remaining = _sweep(groups, by_marker, time.monotonic() + timeout)
    result = []
    for target in killed:
        owner, model = describe(target)
        entry = {
            "pid": target.pid,
            "owner": owner,
            "model": model,
            "matched": target.why,
            "pgid": target.key if target.why == "group" else None,
            "cmd": target.cmd,
        }
        result.append(entry)
        logger.warning(
            "killed pid %d left running by dead llamaswap %s (model %s, matched by %s): %s",
            target.pid,
            owner,
            model,
            target.why,
            target.cmd,
            extra={"action": "reap_leftover", **entry},
        )
    if remaining:
        for target in remaining:
            owner, model = describe(target)
            logger.error(
                "pid %d left by dead llamaswap %s (model %s) still runs after SIGKILL; "
                "its record is kept for the next start",
                target.pid,
                owner,
                model,
                extra={"action": "reap_leftover_failed", "pid": target.pid, "owner": owner},
            )
        return result
    for path, record in dead:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        logger.info(
            "removed the process record of dead llamaswap %s",
            record["owner"],
            extra={"action": "record_removed", "owner": record["owner"], "path": str(path)},
        )
    return result


# -- the guard -------------------------------------------------------------------------------

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
            if not _records.groups:
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
    """This server's guard, started once (``scheduler.process.prepare_server`` calls it)."""
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
