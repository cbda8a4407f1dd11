"""Spawning through ``setpriv --pdeathsig KILL`` (scheduler/spawn.py): what a user sees is
what a direct exec gives: the model's own pid and command line, and a start error naming a
command that cannot run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys

import pytest

from scheduler import spawn as spawn_module
from scheduler.config import ModelConfig
from scheduler.process import LogBuffer, ModelProcess, ModelStartError, set_state_dir
from tests.conftest import pick_free_port
from tests.test_process import alive, next_line

pytestmark = pytest.mark.timeout(15)


def config(cmd: tuple[str, ...]) -> ModelConfig:
    return ModelConfig(
        id="m",
        cmd=cmd,
        proxy=f"http://127.0.0.1:{pick_free_port()}",
        check_endpoint=None,
        unload_timeout=2,
    )


@pytest.fixture(autouse=True)
def state(tmp_path):
    set_state_dir(tmp_path / "state")
    yield
    set_state_dir(None)


@pytest.mark.parametrize("program", ["no-such-command-for-llamaswap", "/nonexistent/x"])
async def test_a_command_that_does_not_exist_is_a_start_error_naming_it(program):
    process = ModelProcess(config((program,)), LogBuffer())
    with pytest.raises(ModelStartError, match=f"could not run '{program}'"):
        await process.start()
    assert process.pid is None


async def test_a_file_that_is_not_executable_is_a_start_error(tmp_path):
    script = tmp_path / "model.sh"
    script.write_text("#!/bin/sh\nsleep 60\n")
    process = ModelProcess(config((str(script),)), LogBuffer())
    with pytest.raises(ModelStartError, match="could not run .*Permission denied"):
        await process.start()


async def test_the_pid_is_the_models_own_process():
    if spawn_module._setpriv() is None:
        pytest.skip("no setpriv with --pdeathsig here")
    code = "import os, time; print('pid', os.getpid(), flush=True); time.sleep(60)"
    logs = LogBuffer()
    process = ModelProcess(config((sys.executable, "-c", code)), logs)
    subscription = logs.subscribe("m")
    await process.start()
    try:
        line = await next_line(subscription, b"pid ", 5)
        assert int(line.split()[1]) == process.pid  # setpriv exec'd it: the same process
    finally:
        await process.stop()


ESCAPEE = "import os, time; os.setsid(); print('escaped', os.getpid(), flush=True); time.sleep(60)"


async def test_as_a_subreaper_the_teardown_finds_an_escapee_among_its_descendants(monkeypatch):
    """With the server a subreaper (as ``serve`` makes it), a reaped model's leftovers are
    looked for among the server's descendants only: a helper that setsid()s out of the
    model's group is still found (it was reparented to us) and killed with the model."""
    if spawn_module._prctl is None:
        pytest.skip("Linux only")
    scopes = []
    original = spawn_module._leftover_scope

    def spy():
        scope = original()
        scopes.append(scope)
        return scope

    monkeypatch.setattr(spawn_module, "_leftover_scope", spy)
    assert spawn_module.become_subreaper()
    logs = LogBuffer()
    escaped = None
    wrapper = f"{shlex.join([sys.executable, '-c', ESCAPEE])} & sleep 60 & wait"
    process = ModelProcess(config(("sh", "-c", wrapper)), logs)
    subscription = logs.subscribe("m")
    try:
        async with asyncio.timeout(10):
            await process.start()
            escaped = int((await next_line(subscription, b"escaped", 5)).split()[1])
            assert os.getpgid(escaped) == escaped != process.pid  # out of the model's group
            await process.stop()
        assert scopes == [spawn_module._descendants]  # the narrow scan, not every process
        assert not alive(escaped)
    finally:
        spawn_module._prctl(36, 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER off again
        if escaped is not None and alive(escaped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(escaped, signal.SIGKILL)
        await process.stop()
