"""Run the real server (``manage.py serve``) as a subprocess for end-to-end tests.

The model processes are the bundled simulated model server (fakellm). Everything a
test starts is killed when it ends, model processes included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

from scheduler.testing import alive, descendants, free_port  # noqa: F401  (tests import them from here too)

ROOT = Path(__file__).resolve().parent.parent


def free_port_block(size: int = 8) -> int:
    """A start port with ``size`` free ports after it (best effort)."""
    for _ in range(50):
        base = free_port()
        if base + size > 65535:
            continue
        ok = True
        for port in range(base, base + size):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block")


def fake_model(
    port: int,
    load_seconds: float = 0,
    tps: float = 0,
    extra: str = "",
    record: Path | None = None,
    **keys,
) -> dict:
    """A model entry running the simulated model server on ``port``.

    With ``record``, every request it receives is appended to that JSONL file, which
    outlives the process (a swapped-out model's history stays readable).
    """
    if record is not None:
        extra += f" --record-file {record}"
    return {
        "cmd": f"{sys.executable} -m fakellm --host 127.0.0.1 --port {port} "
        f"--load-seconds {load_seconds} --tokens-per-second {tps} {extra}",
        "proxy": f"http://127.0.0.1:{port}",
        **keys,
    }


_migrated: dict[str, Path] = {}
"""One freshly migrated SQLite file per test session, copied for each new database."""


def migrate_database(env: dict[str, str]) -> None:
    """``manage.py migrate`` for the database in ``env``. A new SQLite file is a copy of
    one migrated once per session (the same tables, ~2 s saved a server)."""
    url = env["DATABASE_URL"]
    target = Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None
    if target is not None and not target.exists():
        template = _migrated.get("sqlite")
        if template is None or not template.exists():
            template = Path(tempfile.mkdtemp(prefix="llamaswap-migrated-")) / "db.sqlite3"
            _run_migrate({**env, "DATABASE_URL": f"sqlite:///{template}"})
            _migrated["sqlite"] = template
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, target)
        return
    _run_migrate(env)


def _run_migrate(env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=60,
    )


class Server:
    def __init__(
        self,
        tmp: Path,
        models: dict,
        extra: dict | None = None,
        grace: float = 5,
        migrate: bool = False,
        environ: dict | None = None,
        args: tuple[str, ...] = (),
    ):
        self.port = free_port()
        config = {"healthCheckTimeout": 15, "models": models}
        config.update(extra or {})
        self.config_path = tmp / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / "server.log"
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        # Each server gets its own SQLite file unless a test says otherwise (environ=).
        env["DATABASE_URL"] = f"sqlite:///{tmp / 'db.sqlite3'}"
        env["PYTHONUNBUFFERED"] = "1"
        # Its record of model process groups (scheduler/sweep.py) stays with the test.
        env["LLAMASWAP_STATE_DIR"] = str(tmp / "state")
        env.update(environ or {})
        self.database_url = env["DATABASE_URL"]
        if migrate:  # the activity log's tables (and the rest), before the server starts
            migrate_database(env)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "serve",
                "--config",
                str(self.config_path),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--grace",
                str(grace),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.model_pids: set[int] = set()

    def wait_ready(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def children(self) -> set[int]:
        """The server's model processes (and what they started), not its guard."""
        found = {p for p in descendants(self.proc.pid) if p not in self.guards()}
        self.model_pids |= found
        return found

    def guards(self) -> set[int]:
        """The server's guard process (scheduler/guard.py), while it runs."""
        return {p for p in descendants(self.proc.pid) if alive(p) and _is_guard(p)}

    def queue(self) -> dict:
        return httpx.get(self.url + "/api/queue", timeout=5).json()

    def wait_for(self, what: str, check, timeout: float = 20) -> dict:
        """Poll /api/queue until ``check(state)`` holds; return that state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.queue()
            if check(state):
                return state
            time.sleep(0.02)
        raise AssertionError(f"{what} never happened: {self.queue()}")

    def wait_queue(self, depth: int, timeout: float = 10) -> dict:
        """Until at least ``depth`` requests wait."""
        return self.wait_for(f"depth >= {depth}", lambda s: s["depth"] >= depth, timeout)

    def wait_depth(self, depth: int, timeout: float = 10) -> dict:
        """Until exactly ``depth`` requests wait."""
        return self.wait_for(f"depth == {depth}", lambda s: s["depth"] == depth, timeout)

    def wait_running(self, count: int = 1, timeout: float = 20) -> dict:
        """Until at least ``count`` requests are in flight."""
        return self.wait_for(f"{count} running", lambda s: len(s["running"]) >= count, timeout)

    def stop(self) -> None:
        self.children()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        for pid in self.model_pids:
            with contextlib.suppress(ProcessLookupError):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        self._log.close()


def _is_guard(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"scheduler.guard" in f.read()
    except OSError:
        return False


@contextlib.contextmanager
def serve(tmp: Path, models: dict, extra: dict | None = None, **kwargs) -> Iterator[Server]:
    server = Server(tmp, models, extra, **kwargs)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def fake_requests(port: int) -> list[dict]:
    """What the simulated model server on ``port`` received, in order."""
    return httpx.get(f"http://127.0.0.1:{port}/fake/requests", timeout=5).json()


def recorded(path: Path) -> list[dict]:
    """Requests written by fake models started with ``record=path``, in arrival order."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["received_at"])


def chat(model: str, content: str = "hi", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def sse_events(body: str) -> list[str]:
    return [line[6:] for line in body.splitlines() if line.startswith("data: ")]


def dumps(obj: object) -> str:
    return json.dumps(obj)
