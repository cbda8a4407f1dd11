"""Models die with the server: the guard (scheduler/guard.py).

Through the real server: a model started through a shell wrapper that does not exec it,
with a helper that ``setsid``s out of the model's group, dies within a second of a
SIGKILLed server; a killed guard is replaced; a normal stop leaves no guard behind. Then
the guard alone, over plain subprocesses: the pipe's EOF sweeps, a stand-down does not.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from scheduler.guard import Guard
from scheduler.sweep import OWNER_ENV, proc_stat
from tests.server import ROOT, Server, alive, chat, free_port_block

pytestmark = pytest.mark.timeout(60)

PY = sys.executable
ESCAPEE = "import os, time; os.setsid(); print('escaped', flush=True); time.sleep(60)"
DIES_WITHIN = 1.0
"""The finding: a model outlives a SIGKILLed server by at most this many seconds."""


def wrapped_model(port: int) -> dict:
    """A model behind ``sh -c "cd /tmp && python -m fakellm ..."``, which sh does not exec
    (a command follows it), plus a helper that leaves the model's process group."""
    fakellm = f"{PY} -m fakellm --host 127.0.0.1 --port {port}"
    script = (
        f"cd /tmp && {PY} -c {shlex.quote(ESCAPEE)} & "
        f"cd /tmp && {fakellm}; echo fakellm ended"
    )
    return {
        "cmd": f"sh -c {shlex.quote(script)}",
        "proxy": f"http://127.0.0.1:{port}",
        "env": [f"PYTHONPATH={ROOT}"],  # fakellm is not installed, only found from the tree
    }


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def guards(server: Server) -> list[int]:
    return sorted(server.guards())


def guard_of(server: Server) -> int:
    (guard,) = guards(server)
    return guard


def until(what: str, check, timeout: float) -> float:
    """Poll ``check()`` every 10 ms until it holds; seconds it took (AssertionError after
    ``timeout``)."""
    started = time.monotonic()
    for _ in range(int(timeout / 0.01) + 1):
        if check():
            return time.monotonic() - started
        time.sleep(0.01)
    raise AssertionError(f"{what}: not within {timeout:g}s")


def loaded_tree(server: Server) -> set[int]:
    """Load the wrapped model; its whole tree (the guard excluded) once the helper has left
    the model's group."""
    r = httpx.post(server.url + "/v1/chat/completions", json=chat("m"), timeout=30)
    assert r.status_code == 200, r.text

    def escaped() -> bool:
        return any(
            "os.setsid()" in cmdline(p) and os.getsid(p) == p
            for p in server.children()
            if alive(p)
        )

    until("the helper left the model's group", escaped, 5)
    tree = {p for p in server.children() if alive(p)}
    fakellm = [p for p in tree if "-m fakellm" in cmdline(p) and not cmdline(p).startswith("sh ")]
    assert fakellm, [cmdline(p) for p in tree]
    # The model server is a grandchild: PR_SET_PDEATHSIG (the direct child's) misses it.
    assert all(proc_stat(p).ppid != server.proc.pid for p in fakellm)
    return tree


def test_a_wrapped_model_dies_within_a_second_of_a_sigkilled_server(tmp_path):
    server = Server(tmp_path, {"m": wrapped_model(free_port_block(1))})
    try:
        server.wait_ready()
        tree = loaded_tree(server)
        watching = guards(server)
        os.kill(server.proc.pid, signal.SIGKILL)  # no code of the server runs any more
        took = until(
            f"the model tree {sorted(tree)} died",
            lambda: not [p for p in tree if alive(p)],
            DIES_WITHIN,
        )
        server.proc.wait(timeout=5)
        assert len(watching) == 1
        until("the guard exited", lambda: not alive(watching[0]), 5)  # nothing left behind
        until("the guard logged", lambda: "its guard killed" in server.log(), 5)
        assert took < DIES_WITHIN
        assert not list((tmp_path / "state").glob("owner-*.json"))  # the record went too
    finally:
        server.stop()


def test_a_killed_guard_is_replaced_and_the_models_still_die_with_the_server(tmp_path):
    server = Server(tmp_path, {"m": wrapped_model(free_port_block(1))})
    try:
        server.wait_ready()
        tree = loaded_tree(server)
        first = guard_of(server)
        os.kill(first, signal.SIGKILL)
        until("a new guard", lambda: guards(server) not in ([], [first]), 5)
        (second,) = guards(server)
        assert second != first
        os.kill(server.proc.pid, signal.SIGKILL)
        until(
            f"the model tree {sorted(tree)} died",
            lambda: not [p for p in tree if alive(p)],
            DIES_WITHIN,
        )
        assert "exited (-9); starting another" in server.log()
    finally:
        server.stop()


def test_a_normal_stop_stands_the_guard_down(tmp_path):
    server = Server(tmp_path, {"m": wrapped_model(free_port_block(1))})
    try:
        server.wait_ready()
        tree = loaded_tree(server)
        guard = guard_of(server)
        os.killpg(server.proc.pid, signal.SIGTERM)  # the terminal's signal: not the guard's
        assert server.proc.wait(timeout=15) == 0
        assert not alive(guard)
        assert not [p for p in tree if alive(p)]
        assert "its guard killed" not in server.log()  # stood down: nothing left to sweep
    finally:
        server.stop()


# -- the guard alone ------------------------------------------------------------------------


def sleeper(owner: str | None = None, *, setsid: bool = False) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if owner is not None:
        env[OWNER_ENV] = owner
    proc = subprocess.Popen(
        [PY, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        env=env,
        stdout=subprocess.PIPE,
        start_new_session=setsid,
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    return proc


def dead(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is not None


@pytest.fixture
def procs():
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)


def test_the_pipes_eof_sweeps_the_recorded_groups_and_the_marked_processes(tmp_path, procs):
    owner = f"1:{time.monotonic_ns()}"  # a server that is gone
    marked = sleeper(owner)
    grouped = sleeper(setsid=True)  # no marker: found by its recorded group only
    bystander = sleeper()
    procs += [marked, grouped, bystander]
    record = tmp_path / f"owner-{owner.replace(':', '-')}.json"
    groups = [{"pgid": grouped.pid, "model": "m", "role": "model",
               "start_time": proc_stat(grouped.pid).start, "spawn": f"{owner}:1"}]
    record.write_text(json.dumps({"pid": 1, "start_time": int(owner[2:]), "groups": groups}))
    guard = Guard(owner, tmp_path)
    guard.start()
    procs.append(guard.process)
    os.close(guard._write)  # what the kernel does when the server dies
    guard._write = None
    until("the marked and the grouped process died", lambda: dead(marked) and dead(grouped), 3)
    assert guard.process.wait(timeout=5) == 0
    assert not dead(bystander)
    assert not record.exists()


def test_a_stand_down_sweeps_nothing(tmp_path, procs):
    owner = f"1:{time.monotonic_ns()}"
    marked = sleeper(owner)
    procs.append(marked)
    guard = Guard(owner, tmp_path)
    guard.start()
    procs.append(guard.process)
    guard.stand_down()
    assert guard.process.wait(timeout=5) == 0
    assert not dead(marked)


async def test_a_guard_that_dies_is_replaced_at_once(tmp_path, procs):
    guard = Guard(f"1:{time.monotonic_ns()}", tmp_path)
    guard.start()
    procs.append(guard.process)
    guard._started_at -= 10  # as if it had run for a while: no restart delay
    guard.watch(asyncio.get_running_loop())
    first = guard.process
    first.kill()
    async with asyncio.timeout(5):
        while guard.process is first:
            await asyncio.sleep(0.01)
    procs.append(guard.process)
    assert guard.alive and guard.restarts == 1
    guard.stand_down()
    assert guard.process.wait(timeout=5) == 0
