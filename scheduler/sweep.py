"""Supervision of the model processes: their markers, this instance's record of them, and
the sweep that kills what is left of them.

Markers and records (used by :mod:`scheduler.spawn`, which spawns): every spawned process
carries ``LLAMASWAP_OWNER=<server pid>:<server start time>`` and a per-spawn
``LLAMASWAP_SPAWN`` in its environment, and each server instance keeps a JSON record of the
process groups it started in the state directory (:func:`set_state_dir`). :func:`kill_and_wait`
SIGKILLs every process of some groups or carrying some markers and waits for them to die;
:func:`reap_leftovers` runs it, at a server's start, for every *dead* instance's record,
and :func:`reap_instance` for one instance (the guard, :mod:`scheduler.guard`, when its
server dies).

This module imports only the standard library: the guard process starts in a fraction of
the server's start-up time and memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
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


def proc_stat(pid: int) -> _Stat | None:
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
        stat = proc_stat(pid)
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


records = _Records()


def set_state_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Where this instance records its process groups (and looks for dead instances').

    None: ``$LLAMASWAP_STATE_DIR``, else ``<project>/var/``. Returns the directory. A record
    already written moves to the new directory.
    """
    old = records.path()
    records.directory = Path(path) if path is not None else None
    directory = records.state_dir()
    if records.groups and old != records.path():
        with contextlib.suppress(OSError):
            old.unlink()
        records.save()
    return directory


def state_dir() -> Path:
    return records.state_dir()


def _kill_exact(pid: int, start: int) -> bool:
    """SIGKILL the process ``pid`` only if it is still the one that started at ``start``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (OSError, AttributeError):
        fd = None
    try:
        stat = proc_stat(pid)
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
    stat = proc_stat(pid)
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


def kill_and_wait(
    groups: Mapping[int, int | None],
    markers: Iterable[bytes],
    deadline: float,
    pids: Callable[[], list[int]] | None = None,
) -> tuple[list[_Target], list[_Target]]:
    """SIGKILL every running process in ``groups`` (pgid -> leader start time, or None for a
    leader already reaped) or whose environment has one of ``markers``; wait, until
    ``deadline`` (``time.monotonic``), for them and whatever they fork meanwhile to die.

    A group counts only while its pgid is not someone else's: no process has that pid, or
    the recorded leader does. Returns ``(killed, still running)``. Runs in a thread.
    ``pids`` lists the processes to look at, each time round (default: every process).
    """
    markers = frozenset(markers)
    me = os.getpid()
    spare = {1, me}  # never init, ourselves or an ancestor
    ancestor = proc_stat(me)
    while ancestor is not None and ancestor.ppid not in spare and ancestor.ppid > 0:
        spare.add(ancestor.ppid)
        ancestor = proc_stat(ancestor.ppid)
    valid: set[int] = set()
    for pgid, leader_start in groups.items():
        leader = proc_stat(pgid)
        if leader is None or (leader_start is not None and leader.start == leader_start):
            valid.add(pgid)
    killed: dict[tuple[int, int], _Target] = {}
    while True:
        found: list[_Target] = []
        for pid in (pids or _pids)():
            if pid in spare:
                continue
            stat = proc_stat(pid)
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
            leader = proc_stat(pgid)
            if leader is not None and leader.start != groups[pgid]:
                valid.discard(pgid)
        if time.monotonic() >= deadline:
            return list(killed.values()), found
        time.sleep(REAP_POLL_INTERVAL)


_SPAWN_PREFIX = f"{SPAWN_ENV}=".encode()


def _owner_marker(owner: str) -> bytes:
    return f"{OWNER_ENV}={owner}".encode()


def spawn_marker(spawn: str) -> bytes:
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
        server = proc_stat(pid)
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


def _reap_records(dead: list[tuple[Path, dict[str, Any]]], timeout: float) -> list[dict[str, Any]]:
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

    killed, remaining = kill_and_wait(groups, by_marker, time.monotonic() + timeout)
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
