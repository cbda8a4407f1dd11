"""The end-to-end suite against llama.cpp's real ``llama-server`` (``make e2e``).

``scripts/real-llama/build.sh`` builds the binary once (cached outside the repository) and
writes two tiny random-weight GGUF models; ``make e2e`` passes their paths in
``LLAMASWAP_E2E_LLAMA_SERVER`` and ``LLAMASWAP_E2E_MODELS``. Each test copies the models
into its own tmp dir, so the model path in a ``llama-server`` command line names the test
that started it: after the server is stopped, no process whose command line holds that
path may be left (checked for every test at teardown, see ``llamaswap``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server import Server, free_port_block

CACHE = Path(
    os.environ.get("LLAMASWAP_E2E_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llamaswap-e2e"
)
BUILD_HINT = "run `make e2e` (or scripts/real-llama/build.sh) first"
MODEL_FILES = ("tiny-a.gguf", "tiny-b.gguf")


def _binary() -> Path:
    given = os.environ.get("LLAMASWAP_E2E_LLAMA_SERVER")
    if given:
        return Path(given)
    builds = sorted(CACHE.glob("build-*/bin/llama-server"))
    return builds[-1] if builds else CACHE / "build" / "bin" / "llama-server"


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    path = _binary()
    if not os.access(path, os.X_OK):
        pytest.fail(f"no llama-server at {path}: {BUILD_HINT}", pytrace=False)
    return path


@pytest.fixture(scope="session")
def gguf_dir() -> Path:
    path = Path(os.environ.get("LLAMASWAP_E2E_MODELS") or CACHE / "models")
    missing = [name for name in MODEL_FILES if not (path / name).is_file()]
    if missing:
        pytest.fail(f"missing {missing} in {path}: {BUILD_HINT}", pytrace=False)
    return path


@pytest.fixture
def model_dir(tmp_path: Path, gguf_dir: Path) -> Path:
    """This test's own copies of the models (under 1 MB each)."""
    out = tmp_path / "models"
    out.mkdir()
    for name in MODEL_FILES:
        shutil.copyfile(gguf_dir / name, out / name)
    return out


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def model_processes(marker: str) -> list[tuple[int, str]]:
    """Live processes (not zombies) whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        cmdline = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        if marker in cmdline and alive(int(entry)):
            found.append((int(entry), cmdline))
    return found


@dataclass
class Llamaswap:
    """``manage.py serve`` in front of real ``llama-server`` processes."""

    server: Server
    model_dir: Path
    llama_server: Path

    @property
    def url(self) -> str:
        return self.server.url

    def model(self, name: str) -> Path:
        return self.model_dir / f"{name}.gguf"

    def processes(self, name: str | None = None) -> list[tuple[int, str]]:
        """The live llama-server processes of this test (of one model file if named)."""
        return model_processes(str(self.model(name) if name else self.model_dir))

    def running(self) -> list[dict]:
        return httpx.get(self.url + "/running", timeout=5).json()["running"]

    def activity(self, count: int, timeout: float = 20) -> dict[str, dict]:
        """Activity records by request id, once at least ``count`` were written."""
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.get(self.url + "/api/metrics/activity", params={"limit": 1000}, timeout=5)
            assert r.status_code == 200, r.text
            rows = r.json()["data"]
            if len(rows) >= count or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(rows) >= count, rows
        return {row["request_id"]: row for row in rows}

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM to the server process alone (as a service manager would); its exit code."""
        self.server.children()  # remember the model pids for Server.stop()'s backstop
        if self.server.proc.poll() is None:
            os.kill(self.server.proc.pid, signal.SIGTERM)
        return self.server.proc.wait(timeout=timeout)


def llama_model(binary: Path, model: Path, *flags: str) -> dict:
    """A model entry for llama-server; llamaswap assigns ``${PORT}`` from ``startPort``."""
    # --threads 1: the proxy, the test and the model share the machine's two cores.
    argv = [str(binary), "--host", "127.0.0.1", "--port", "${PORT}", "-m", str(model)]
    argv += ["--threads", "1", "--no-webui", *flags]
    return {"cmd": " ".join(argv), "proxy": "http://127.0.0.1:${PORT}"}


@pytest.fixture
def llamaswap(
    tmp_path: Path, model_dir: Path, llama_server_bin: Path
) -> Iterator[Callable[..., Llamaswap]]:
    """``llamaswap({"id": ["tiny-a", flag, ...]}, grace=5)`` starts the server, ready.

    At teardown the server gets SIGTERM, must exit 0, and must leave no llama-server
    process of this test behind (anything left is then killed, and the test errors).
    """
    started: list[Llamaswap] = []

    def start(
        models: dict[str, list[str]],
        extra: dict | None = None,
        keys: dict[str, dict] | None = None,
        **kwargs,
    ) -> Llamaswap:
        """``keys``: more config keys per model id (``{"tiny-p": {"slots": 4}}``)."""
        entries = {
            model_id: llama_model(llama_server_bin, model_dir / f"{spec[0]}.gguf", *spec[1:])
            | (keys or {}).get(model_id, {})
            for model_id, spec in models.items()
        }
        config = {"startPort": free_port_block(len(entries)), "healthCheckTimeout": 60}
        config.update(extra or {})
        environ = {"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"}  # not CI's PostgreSQL
        server = Server(tmp_path, entries, config, migrate=True, environ=environ, **kwargs)
        swap = Llamaswap(server, model_dir, llama_server_bin)
        started.append(swap)
        server.wait_ready(timeout=60)
        return swap

    yield start

    problems = []
    for swap in started:
        try:
            code = swap.terminate()
            if code != 0:
                problems.append(f"server exited {code}: {swap.server.log()}")
            left = swap.processes()
            if left:
                problems.append(f"llama-server processes left after shutdown: {left}")
        finally:
            swap.server.stop()  # kills whatever was left
            for pid, _ in swap.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert not problems, problems
