"""ModelProcess over real subprocesses and loopback HTTP; LogBuffer; the in-memory fake;
no leftovers: wrapped models, a SIGKILLed server, reap_leftovers, a squatted port."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shlex
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from scheduler import spawn as spawn_module
from scheduler import sweep
from scheduler.config import ModelConfig
from scheduler.process import (
    OWNER_ENV,
    SPAWN_ENV,
    LogBuffer,
    ModelProcess,
    ModelStartError,
    ModelState,
    owner_id,
    reap_leftovers,
    set_state_dir,
)
from scheduler.testing import FakeModelProcess, FakeProcessFactory
from tests.conftest import ROOT, fakellm_argv, pick_free_port

pytestmark = pytest.mark.timeout(15)

PY = sys.executable
SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"
IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)"
)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


async def wait_dead(pid: int, timeout: float = 3.0) -> None:
    """Wait for a process that is not our child to die, on its pidfd: no polling."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()
    loop.add_reader(fd, gone.set)
    try:
        async with asyncio.timeout(timeout):
            await gone.wait()
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return {}
    return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def marked(owner: str) -> list[int]:
    """Running processes whose environment carries ``LLAMASWAP_OWNER=<owner>``."""
    return [
        int(pid)
        for pid in os.listdir("/proc")
        if pid.isdigit() and alive(int(pid)) and environ(int(pid)).get(OWNER_ENV) == owner
    ]


def kill_quietly(*pids: int | None, groups: tuple[int | None, ...] = ()) -> None:
    """Test cleanup: SIGKILL these groups and processes, ignoring the ones already gone."""
    for pgid in groups:
        if pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
    for pid in pids:
        if pid is not None and alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


async def next_line(subscription, needle: bytes, timeout: float = 3.0) -> bytes:
    async with asyncio.timeout(timeout):
        async for line in subscription:
            if needle in line:
                return line
    raise AssertionError(f"subscription ended before {needle!r}")


def config(cmd, **overrides) -> ModelConfig:
    values = {
        "id": "m",
        "cmd": tuple(cmd),
        "proxy": f"http://127.0.0.1:{pick_free_port()}",
        "check_endpoint": None,
        "health_check_timeout": 5,
        "unload_timeout": 2,
    }
    values.update(overrides)
    return ModelConfig(**values)


@pytest.fixture
def logs() -> LogBuffer:
    return LogBuffer()


@pytest.fixture
def state_dir(tmp_path) -> Iterator[Path]:
    """This test process records its process groups under tmp_path, not <project>/var."""
    directory = set_state_dir(tmp_path / "state")
    try:
        yield directory
    finally:
        set_state_dir(None)


@pytest.fixture
async def spawn(logs, state_dir) -> AsyncIterator[Callable[..., ModelProcess]]:
    """Builds ModelProcesses; at teardown stops them all and checks nothing is left running
    and that every process group left this instance's record."""
    made: list[ModelProcess] = []

    def make(cfg: ModelConfig, **kwargs) -> ModelProcess:
        process = ModelProcess(cfg, logs, **kwargs)
        made.append(process)
        return process

    yield make

    async with asyncio.timeout(5):
        for process in made:
            await process.stop()
    for process in made:
        assert process.state is ModelState.STOPPED
        if process.pid is not None:
            assert not alive(process.pid), f"{process} left running"
    assert list(state_dir.glob("owner-*.json")) == []


def fakellm_config(*args: str, **overrides) -> ModelConfig:
    port = pick_free_port()
    return config(
        fakellm_argv(port, *args),
        proxy=f"http://127.0.0.1:{port}",
        check_endpoint="/health",
        **overrides,
    )


# -- start -----------------------------------------------------------------------------------


async def test_start_waits_for_health_then_ready_and_stop(spawn):
    process = spawn(fakellm_config("--load-seconds", "0.3"))
    assert process.state is ModelState.STOPPED
    async with asyncio.timeout(5):
        await process.start()
        assert process.state is ModelState.READY
        assert process.returncode is None and not process.exited.is_set()
        async with httpx.AsyncClient(trust_env=False) as client:
            # READY means the health check passed, so the server answers at once.
            health = await client.get(f"{process.config.proxy}/health")
        assert health.status_code == 200
        await process.start()  # idempotent while READY
        await process.stop()
    assert process.state is ModelState.STOPPED
    assert process.exited.is_set()
    assert process.returncode == 0  # fakellm exits cleanly on SIGTERM
    assert not alive(process.pid)


async def test_a_starting_servers_output_prompts_its_health_check(spawn, monkeypatch):
    """However far the checks' backoff has grown, the line a server writes as it turns
    healthy (fakellm's ``model loaded``, as llama-server's) is followed by a check at once:
    here the schedule alone would wait a minute after the first, refused check."""
    from scheduler import process as process_module

    monkeypatch.setattr(process_module, "health_delays", lambda: itertools.repeat(60.0))
    process = spawn(fakellm_config("--load-seconds", "0.3"))
    async with asyncio.timeout(5):
        await process.start()
    assert process.state is ModelState.READY


CHATTY = "import time\nwhile True:\n    print('.', flush=True)\n    time.sleep(0.0005)"


async def test_a_server_that_writes_without_pause_is_checked_at_most_every_5_ms(spawn, monkeypatch):
    from scheduler import process as process_module

    checks = []

    async def health_once(self, client, url):
        checks.append(url)
        return False

    monkeypatch.setattr(process_module, "health_delays", lambda: itertools.repeat(60.0))
    monkeypatch.setattr(ModelProcess, "_health_once", health_once)
    port = pick_free_port()
    process = spawn(
        config(
            [PY, "-c", CHATTY],
            proxy=f"http://127.0.0.1:{port}",
            check_endpoint="/health",
            health_check_timeout=0.5,
        )
    )
    async with asyncio.timeout(5):
        with pytest.raises(ModelStartError, match="timed out"):
            await process.start()
    assert 2 <= len(checks) <= 0.5 / process_module.HEALTH_OUTPUT_SPACING + 2


LOGS_EVERY_REQUEST = """
import http.server, sys
class Loading(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # answered 503 while loading; logged as uvicorn and vLLM log it
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Loading)
print("loading", flush=True)
server.serve_forever()
"""


async def test_a_server_logging_each_health_check_does_not_prompt_the_next_one(spawn, monkeypatch):
    """A server that writes a line for every request it answers (Python's http.server,
    uvicorn) writes one for each health check: that line names the check's path and
    prompts no check of its own, or the checks would run at 200 a second while it loads."""
    from scheduler import process as process_module

    checks = []
    real = ModelProcess._health_once

    async def health_once(self, client, url):
        checks.append(url)
        return await real(self, client, url)

    monkeypatch.setattr(process_module, "health_delays", lambda: itertools.repeat(0.25))
    monkeypatch.setattr(ModelProcess, "_health_once", health_once)
    port = pick_free_port()
    process = spawn(
        config(
            [PY, "-c", LOGS_EVERY_REQUEST, str(port)],
            proxy=f"http://127.0.0.1:{port}",
            check_endpoint="/health",
            health_check_timeout=1.0,
        )
    )
    async with asyncio.timeout(5):
        with pytest.raises(ModelStartError, match="timed out"):
            await process.start()
    # one at the spawn, one for "loading", then every 0.25 s: 6 at the most
    assert 2 <= len(checks) <= 6, len(checks)


async def test_health_timeout_raises_and_leaves_no_process(spawn):
    process = spawn(fakellm_config("--load-seconds", "30", health_check_timeout=0.5))
    async with asyncio.timeout(5):
        with pytest.raises(ModelStartError) as info:
            await process.start()
    assert info.value.model == "m"
    assert info.value.cause == "health check timed out after 0.5s"
    assert process.state is ModelState.STOPPED
    assert process.exited.is_set()
    assert not alive(process.pid)


async def test_process_exiting_before_healthy_names_exit_code(spawn, logs):
    script = "import sys; print('cannot load model', flush=True); sys.exit(1)"
    process = spawn(config([PY, "-c", script], check_endpoint="/health"))
    async with asyncio.timeout(5):
        with pytest.raises(ModelStartError) as info:
            await process.start()
    assert info.value.cause == "process exited with code 1 before becoming healthy"
    assert process.returncode == 1
    assert process.state is ModelState.STOPPED
    assert b"[m] cannot load model\n" in logs.history()  # its last words are kept


async def test_missing_binary_is_a_start_error(spawn):
    process = spawn(config(["/nonexistent/llama-server", "--port", "1"]))
    with pytest.raises(ModelStartError, match="could not run '/nonexistent/llama-server'"):
        await process.start()
    assert process.state is ModelState.STOPPED
    assert process.exited.is_set()


async def test_env_is_added_to_the_environment(spawn, logs):
    script = "import os; print(os.environ['MODEL_FLAG'], 'PATH' in os.environ, flush=True)"
    process = spawn(config([PY, "-c", script], env={"MODEL_FLAG": "on"}))
    async with asyncio.timeout(5):
        await process.start()  # check_endpoint None: ready once spawned
        await process.exited.wait()
    assert logs.history("m") == b"on True\n"


async def test_stop_while_starting_abandons_the_start(spawn, logs):
    process = spawn(fakellm_config("--load-seconds", "30"))
    subscription = logs.subscribe("m")
    async with asyncio.timeout(5):
        starting = asyncio.create_task(process.start())
        await next_line(subscription, b"listening on")
        assert process.state is ModelState.STARTING
        await process.stop()
        assert process.state is ModelState.STOPPED
        with pytest.raises(ModelStartError, match="stopped while starting"):
            await starting
    assert not alive(process.pid)


async def test_cancelling_start_kills_the_process(spawn, logs):
    process = spawn(fakellm_config("--load-seconds", "30"))
    subscription = logs.subscribe("m")
    async with asyncio.timeout(5):
        starting = asyncio.create_task(process.start())
        await next_line(subscription, b"listening on")
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
    assert process.state is ModelState.STOPPED
    assert not alive(process.pid)


async def test_concurrent_starts_share_one_process(spawn):
    process = spawn(fakellm_config("--load-seconds", "0.2"))
    async with asyncio.timeout(5):
        await asyncio.gather(process.start(), process.start())
    assert process.state is ModelState.READY
    first_pid = process.pid
    async with asyncio.timeout(5):
        await asyncio.gather(process.stop(), process.stop())
        await process.stop()  # idempotent
    assert process.state is ModelState.STOPPED
    assert not alive(first_pid)


# -- stop ------------------------------------------------------------------------------------


async def test_stop_sends_sigterm(spawn, logs):
    process = spawn(config([PY, "-c", SLEEPER]))
    subscription = logs.subscribe("m")
    async with asyncio.timeout(5):
        await process.start()
        await next_line(subscription, b"ready")
        await process.stop()
    assert process.returncode == -signal.SIGTERM


async def test_stop_escalates_to_sigkill(spawn, logs):
    process = spawn(config([PY, "-c", IGNORES_SIGTERM], unload_timeout=0.5))
    subscription = logs.subscribe("m")
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(5):
        await process.start()
        await next_line(subscription, b"ready")  # the handler is installed
        began = loop.time()
        await process.stop()
    assert process.returncode == -signal.SIGKILL
    assert loop.time() - began >= 0.5
    assert not alive(process.pid)


async def test_cmd_stop_gets_the_pid(spawn, logs):
    model = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda *a: (print('got usr1', flush=True), sys.exit(7)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    stopper = "import os, signal, sys; print('stopping', sys.argv[1]); os.kill(int(sys.argv[1]), signal.SIGUSR1)"
    process = spawn(config([PY, "-c", model], cmd_stop=(PY, "-c", stopper, "${PID}")))
    subscription = logs.subscribe("m")
    async with asyncio.timeout(5):
        await process.start()
        await next_line(subscription, b"ready")
        await process.stop()
    assert process.returncode == 7  # SIGUSR1 from cmd_stop, not our SIGTERM
    history = logs.history("m")
    assert f"stopping {process.pid}\n".encode() in history
    assert b"got usr1\n" in history


async def test_stop_takes_the_whole_process_group(spawn, logs):
    wrapper = "sleep 60 & echo child $!; wait"
    process = spawn(config(["sh", "-c", wrapper]))
    subscription = logs.subscribe("m")
    grandchild = None
    try:
        async with asyncio.timeout(5):
            await process.start()
            grandchild = int((await next_line(subscription, b"child ")).split()[1])
            assert alive(grandchild)
            await process.stop()
        assert not alive(grandchild)  # dead by the time stop() returns
    finally:
        kill_quietly(grandchild)


ESCAPEE = (
    "import os, time; os.setsid(); print('escaped', os.getpid(), os.getpgrp(), flush=True); "
    "time.sleep(60)"
)


async def test_stop_kills_a_wrapped_server_and_a_grandchild_that_left_the_group(
    spawn, logs, free_port
):
    """A shell wrapper backgrounds the model server (health answered by the grandchild)
    and a helper that setsid()s out of the group: stop() kills both; the process group
    alone would miss the second one, its environment marker does not."""
    port = free_port()
    server = shlex.join(fakellm_argv(port))
    escapee = shlex.join([PY, "-c", ESCAPEE])
    wrapper = f"{server} & echo child $!; {escapee} & wait"
    process = spawn(
        config(
            ["sh", "-c", wrapper],
            proxy=f"http://127.0.0.1:{port}",
            check_endpoint="/health",
        )
    )
    subscription = logs.subscribe("m")
    grandchild = escaped = None
    try:
        async with asyncio.timeout(10):
            starting = asyncio.create_task(process.start())
            grandchild = int((await next_line(subscription, b"child ", 5)).split()[1])
            _, escaped_pid, escaped_group = (await next_line(subscription, b"escaped", 5)).split()
            escaped = int(escaped_pid)
            await starting
            assert process.state is ModelState.READY
            assert int(escaped_group) == escaped != process.pid  # out of the model's group
            marker = environ(escaped)
            assert marker[OWNER_ENV] == owner_id()
            assert marker[SPAWN_ENV] == environ(process.pid)[SPAWN_ENV]
            await process.stop()
        assert not alive(grandchild) and not alive(escaped)
    finally:
        kill_quietly(grandchild, escaped)


async def test_spawns_are_marked_and_recorded_until_their_group_is_gone(spawn, state_dir, logs):
    process = spawn(config([PY, "-c", SLEEPER]))
    subscription = logs.subscribe("m")
    async with asyncio.timeout(5):
        await process.start()
        # Once the program has printed, setpriv has exec'd it: during that exec the
        # kernel shows an empty /proc/<pid>/environ for a moment.
        await next_line(subscription, b"ready")
        env = environ(process.pid)
        assert env[OWNER_ENV] == owner_id()
        assert env[SPAWN_ENV].startswith(owner_id() + ":")
        (path,) = state_dir.glob("owner-*.json")
        record = json.loads(path.read_text())
        pid, start = owner_id().split(":")
        assert (record["pid"], record["start_time"]) == (int(pid), int(start))
        assert int(start) == sweep.proc_stat(int(pid)).start
        (group,) = record["groups"]
        assert group["pgid"] == process.pid and group["model"] == "m"
        assert group["start_time"] == sweep.proc_stat(process.pid).start
        assert group["spawn"] == env[SPAWN_ENV]
        assert process.alive
        await process.stop()
    assert not process.alive
    assert not path.exists()


# -- unexpected exit -------------------------------------------------------------------------


async def test_crash_while_ready_sets_exited_and_calls_on_exit(spawn):
    exits: list[ModelProcess] = []
    process = spawn(fakellm_config(), on_exit=exits.append)
    request = {"messages": [], "stream": True, "fake_tokens": 5, "fake_crash_after": 1}
    async with asyncio.timeout(5):
        await process.start()
        async with httpx.AsyncClient(trust_env=False) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                url = f"{process.config.proxy}/v1/chat/completions"
                async with client.stream("POST", url, json=request) as response:
                    await response.aread()
        await process.exited.wait()
    assert process.state is ModelState.STOPPED
    assert process.returncode == 3
    assert exits == [process]


async def test_leader_exit_takes_its_group_with_it(spawn, logs):
    exits: list[ModelProcess] = []
    process = spawn(config(["sh", "-c", "sleep 60 & echo child $!; wait"]), on_exit=exits.append)
    subscription = logs.subscribe("m")
    grandchild = None
    try:
        async with asyncio.timeout(5):
            await process.start()
            grandchild = int((await next_line(subscription, b"child ")).split()[1])
            os.kill(process.pid, signal.SIGKILL)  # the wrapper dies, its child survives it...
            await process.exited.wait()
        assert not alive(grandchild)  # ...until the model's exit is reported
        assert exits == [process]
        assert process.returncode == -signal.SIGKILL
    finally:
        kill_quietly(grandchild)


PARENT = """
import asyncio, sys
sys.path.insert(0, {root!r})
from scheduler.config import ModelConfig
from scheduler.process import LogBuffer, ModelProcess

async def main():
    cfg = ModelConfig(id="m", cmd=({py!r}, "-c", "import time; time.sleep(60)"),
                      proxy="http://127.0.0.1:1", check_endpoint=None)
    process = ModelProcess(cfg, LogBuffer())
    await process.start()
    print(process.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_model_dies_when_the_server_is_sigkilled(tmp_path):
    parent = await asyncio.create_subprocess_exec(
        PY,
        "-c",
        PARENT.format(root=str(ROOT), py=PY),
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "LLAMASWAP_STATE_DIR": str(tmp_path)},
    )
    child = None
    try:
        async with asyncio.timeout(5):
            assert parent.stdout is not None
            child = int(await parent.stdout.readline())
            assert alive(child)
            parent.kill()  # no cleanup code runs in the parent
            await parent.wait()
            await wait_dead(child)  # PR_SET_PDEATHSIG did it
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


SERVER = """
import asyncio, json, shlex, sys
sys.path.insert(0, sys.argv[1])
from scheduler.config import ModelConfig
from scheduler.process import LogBuffer, ModelProcess, owner_id, set_state_dir
from scheduler.spawn import become_subreaper

async def main():
    root, state, port, escapee = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    set_state_dir(state)
    become_subreaper()  # as manage.py serve does
    server = shlex.join([sys.executable, "-m", "fakellm", "--port", str(port)])
    wrapper = f"{server} & echo child $!; {shlex.join([sys.executable, '-c', escapee])} & wait"
    cfg = ModelConfig(id="wrapped", cmd=("sh", "-c", wrapper), proxy=f"http://127.0.0.1:{port}",
                      check_endpoint="/health", health_check_timeout=10)
    logs = LogBuffer()
    lines = logs.subscribe("wrapped")
    process = ModelProcess(cfg, logs)
    await process.start()
    found = {}
    async for line in lines:
        if line.startswith((b"child ", b"escaped ")):
            word, pid = line.split()[:2]
            found[word.decode()] = int(pid)
        if len(found) == 2:
            break
    print(json.dumps({"owner": owner_id(), "leader": process.pid, **found}), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def start_server(state: Path, port: int) -> asyncio.subprocess.Process:
    """A stand-in for ``manage.py serve``: one wrapped model, READY, then it waits to die."""
    return await asyncio.create_subprocess_exec(
        *(PY, "-c", SERVER, str(ROOT), str(state), str(port), ESCAPEE),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )


async def read_info(server: asyncio.subprocess.Process) -> dict:
    assert server.stdout is not None
    line = await server.stdout.readline()
    assert line, "the server script died before its model was ready"
    return json.loads(line)


async def test_reap_leftovers_kills_what_a_dead_server_left_and_spares_a_live_one(
    tmp_path, free_port
):
    state = tmp_path / "state"
    dead = await start_server(state, free_port())
    live = await start_server(state, free_port())
    infos: list[dict] = []
    try:
        async with asyncio.timeout(20):
            dead_info = await read_info(dead)
            live_info = await read_info(live)
            infos += [dead_info, live_info]
            assert len(list(state.glob("owner-*.json"))) == 2
            assert await asyncio.to_thread(reap_leftovers, state) == []  # both alive

            dead.kill()  # no cleanup code runs in it
            await dead.wait()
            await wait_dead(dead_info["leader"])  # PR_SET_PDEATHSIG took the shell...
            child, escaped = dead_info["child"], dead_info["escaped"]
            assert alive(child) and alive(escaped)  # ...not what the shell had started
            assert sorted(marked(dead_info["owner"])) == sorted([child, escaped])

            killed = await asyncio.to_thread(reap_leftovers, state)

            assert sorted((k["pid"], k["matched"], k["model"]) for k in killed) == sorted(
                [(child, "group", "wrapped"), (escaped, "marker", "wrapped")]
            )
            assert all(k["owner"] == dead_info["owner"] for k in killed)
            assert not alive(child) and not alive(escaped)
            assert marked(dead_info["owner"]) == []
            live_pid, live_start = live_info["owner"].split(":")
            assert [p.name for p in state.glob("owner-*.json")] == [
                f"owner-{live_pid}-{live_start}.json"
            ]
            # The live instance and its model tree were not touched.
            assert live.returncode is None
            for pid in (live_info["leader"], live_info["child"], live_info["escaped"]):
                assert alive(pid)
            (group,) = json.loads(next(state.glob("owner-*.json")).read_text())["groups"]
            assert (group["pgid"], group["model"]) == (live_info["leader"], "wrapped")
    finally:
        for server in (dead, live):
            if server.returncode is None:
                server.kill()
            await server.wait()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(reap_leftovers, state)
        for info in infos:
            kill_quietly(info["leader"], info["child"], info["escaped"])
    assert all(marked(info["owner"]) == [] for info in infos)


async def test_port_in_use_fails_the_start_and_spares_the_squatter(spawn, fakellm):
    squatter = await fakellm()  # not ours: it answers /health as the model would
    cmd = fakellm_argv(squatter.port)  # the model would listen where the squatter does
    process = spawn(config(cmd, proxy=squatter.url, check_endpoint="/health"))
    async with asyncio.timeout(5):
        with pytest.raises(ModelStartError) as info:
            await process.start()
        cause = info.value.cause
        assert f"port 127.0.0.1:{squatter.port} is already in use by another process" in cause
        assert process.state is ModelState.STOPPED and process.exited.is_set()
        assert process.pid is None  # nothing was spawned
        async with httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(f"{squatter.url}/health")).status_code == 200
    assert squatter.proc.returncode is None


async def test_port_check_covers_localhost_and_skips_other_hosts(spawn):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        process = spawn(config([PY, "-c", SLEEPER], proxy=f"http://localhost:{port}"))
        async with asyncio.timeout(5):
            with pytest.raises(ModelStartError, match=f"port localhost:{port} is already in use"):
                await process.start()
    assert process.pid is None
    loop = asyncio.get_running_loop()
    began = loop.time()
    for url in ("http://192.0.2.1:80", "http://example.invalid:1", "not a url"):
        assert await spawn_module.port_in_use(url) is None  # never probed
    assert loop.time() - began < 0.2


# -- LogBuffer -------------------------------------------------------------------------------


def test_log_history_prefixes_lines_and_filters_by_model():
    logs = LogBuffer()
    logs.write("a", b"one\n")
    logs.write("b", b"two")  # a newline is added
    assert logs.history() == b"[a] one\n[b] two\n"
    assert logs.history("b") == b"two\n"
    assert logs.history("c") == b""


def test_log_buffer_is_bounded_by_bytes_dropping_oldest():
    logs = LogBuffer(max_bytes=40)
    for i in range(10):
        logs.write("m", f"line {i}".encode())  # 11 bytes each with "[m] " and newline
    assert logs.history() == b"[m] line 7\n[m] line 8\n[m] line 9\n"


async def test_live_subscription_gets_new_lines_from_a_process(spawn, logs):
    script = "import sys; print('hello'); print('from the model', file=sys.stderr)"
    logs.write("other", b"before subscribing")
    process = spawn(config([PY, "-c", script]))
    async with asyncio.timeout(5), logs.subscribe() as subscription:
        await process.start()
        assert await anext(subscription) == b"[m] hello\n"
        assert await anext(subscription) == b"[m] from the model\n"
    assert subscription.closed


async def test_slow_subscriber_drops_instead_of_blocking():
    logs = LogBuffer()
    slow = logs.subscribe(maxsize=2)
    for i in range(5):
        logs.write("m", f"{i}".encode())  # never blocks
    assert slow.dropped == 3
    logs.unsubscribe(slow)
    async with asyncio.timeout(1):
        received = [line async for line in slow]
    assert received == [b"[m] 1\n"]  # the oldest queued line made room for the end
    logs.write("m", b"after")  # no longer delivered, no error
    assert logs.history().endswith(b"[m] after\n")


async def test_per_model_subscription_is_unprefixed():
    logs = LogBuffer()
    subscription = logs.subscribe("b")
    logs.write("a", b"not mine")
    logs.write("b", b"mine")
    subscription.close()
    async with asyncio.timeout(1):
        assert [line async for line in subscription] == [b"mine\n"]


# -- the in-memory fake follows the same protocol --------------------------------------------


def fake_config(model_id: str = "f") -> ModelConfig:
    return ModelConfig(id=model_id, cmd=("fake",), proxy="http://fake")


async def test_fake_walks_the_same_states():
    exits = []
    fake = FakeModelProcess(fake_config(), hold_start=True, on_exit=exits.append)
    async with asyncio.timeout(1):
        starting = asyncio.create_task(fake.start())
        await asyncio.sleep(0)
        assert fake.state is ModelState.STARTING and not fake.exited.is_set()
        fake.release()
        await starting
        assert fake.state is ModelState.READY
        fake.crash(returncode=2)
        # Dead at once, reported from the loop later, as a real process is.
        assert not fake.alive and fake.state is ModelState.READY and exits == []
        await fake.exited.wait()
    assert fake.state is ModelState.STOPPED and fake.returncode == 2
    assert fake.exited.is_set() and exits == [fake]
    assert fake.journal == [("start", "f"), ("ready", "f"), ("died", "f"), ("crash", "f")]


async def test_fake_start_failures_and_stop_while_starting():
    failing = FakeModelProcess(fake_config(), start_error="health check timed out after 1s")
    with pytest.raises(ModelStartError, match="timed out"):
        await failing.start()
    assert failing.state is ModelState.STOPPED

    held = FakeModelProcess(fake_config(), hold_start=True)
    async with asyncio.timeout(1):
        starting = asyncio.create_task(held.start())
        await asyncio.sleep(0)
        await held.stop()
        with pytest.raises(ModelStartError, match="stopped while starting"):
            await starting
    assert held.state is ModelState.STOPPED and held.calls == ["start", "stop"]


async def test_fake_factory_records_effects_across_models():
    factory = FakeProcessFactory()
    factory.configure("b", start_error="boom")
    a = factory(fake_config("a"), None)
    b = factory(fake_config("b"), None)
    await a.start()
    with contextlib.suppress(ModelStartError):
        await b.start()
    await a.stop()
    assert factory.processes == {"a": a, "b": b}
    assert factory.journal == [
        ("start", "a"),
        ("ready", "a"),
        ("start", "b"),
        ("start_failed", "b"),
        ("stop", "a"),
        ("stopped", "a"),
    ]
