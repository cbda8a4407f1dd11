"""Config mistakes on the real server and the real ``llamaswap check``: never a traceback,
never a 500 later, and a reload or the watcher that survive any file.

* SIGHUP with ``proxy: "http://[::1"`` (urllib raised ValueError in the reload task: the
  error was lost as "Task exception was never retrieved") or ``http://127.0.0.1:99999``
  (accepted, then every request a 500): refused, logged, on the dashboard; the old config
  keeps serving.
* ``--watch-config``: a broken file, then a valid one: the valid one is applied (the
  watcher used to die on the first).
* ``serve`` with either at start: exits with the key, no traceback.
* ``llamaswap check`` on each broken config, alias bombs and macro bombs included: exit 1,
  the key named, no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server import ROOT, Server, chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(60)

LAUGHS = "".join(
    f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]\n" for i in range(1, 10)
)
BROKEN = {
    "ipv6": ("models:\n  a:\n    cmd: /bin/serve\n    proxy: 'http://[::1'\n", "models.a.proxy"),
    "port": ("models:\n  a:\n    cmd: /bin/serve\n    proxy: http://127.0.0.1:99999\n", "models.a.proxy"),
    "peer": (
        "models:\n  a:\n    cmd: /bin/serve\n    proxy: http://127.0.0.1:9\n"
        "peers:\n  p:\n    proxy: 'http://[::1'\n    models: [m]\n",
        "peers.p.proxy",
    ),
    "alias-bomb": (
        "l0: &l0 [lol]\n" + LAUGHS + "models:\n  a:\n    cmd: /bin/serve\n    metadata: {x: *l9}\n",
        "l5",
    ),
    "macro-bomb": (
        "macros:\n  m0: xxxxxxxxxxxxxxxx\n"
        + "".join(f"  m{i}: ${{m{i - 1}}}${{m{i - 1}}}${{m{i - 1}}}\n" for i in range(1, 30))
        + "models:\n  a:\n    cmd: /bin/serve ${m29}\n",
        "models.a.cmd",
    ),
    "recursive-alias": ("models:\n  a:\n    cmd: /bin/serve\n    metadata: &r {x: *r}\n", "models.a.metadata.x"),
}


def until(what: str, check, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never happened")
        time.sleep(0.05)


def with_models(server: Server, models: dict) -> str:
    config = yaml.safe_load(server.config_path.read_text())
    config["models"] = models
    return yaml.safe_dump(config)


def refusals(server: Server) -> int:
    return server.log_path.read_text().count("config reload refused")


def assert_no_traceback(text: str) -> None:
    assert "Traceback" not in text and "Task exception was never retrieved" not in text, text[-3000:]


def test_sighup_with_a_bad_proxy_url_keeps_the_old_config(tmp_path: Path) -> None:
    port = free_port_block(2)
    with serve(tmp_path, {"a": fake_model(port)}) as server:
        assert httpx.post(server.url + "/v1/chat/completions", json=chat("a"), timeout=30).status_code == 200
        for n, proxy in enumerate(["http://[::1", "http://127.0.0.1:99999"], start=1):
            server.config_path.write_text(with_models(server, {"a": {**fake_model(port), "proxy": proxy}}))
            os.kill(server.proc.pid, signal.SIGHUP)
            until(f"refusal {n} logged", lambda n=n: refusals(server) == n)
            r = httpx.post(server.url + "/v1/chat/completions", json=chat("a", "still"), timeout=30)
            assert r.status_code == 200  # the old config: a's proxy is the one that works
            page = httpx.get(server.url + "/", timeout=10).text
            assert "Config reload refused" in page and "models.a.proxy: " in page
            assert proxy in page
        log = server.log_path.read_text()
        assert log.count("models.a.proxy") >= 2
        assert_no_traceback(log)


def test_watch_config_applies_the_valid_edit_after_a_broken_one(tmp_path: Path) -> None:
    port = free_port_block(2)
    models = {"a": fake_model(port)}
    server = Server(tmp_path, models, args=("--watch-config",))
    try:
        server.wait_ready()
        broken = {**models, "b": {**fake_model(port + 1), "proxy": "http://[::1"}}
        server.config_path.write_text(with_models(server, broken))
        until("the broken file refused", lambda: refusals(server) == 1)  # one poll: <= 2 s
        server.config_path.write_text(with_models(server, {**models, "b": fake_model(port + 1)}))
        until(
            "b listed",  # the next poll
            lambda: "config reload applied" in server.log_path.read_text(),
        )
        assert "b" in {m["id"] for m in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("b"), timeout=30)
        assert r.status_code == 200
        page = httpx.get(server.url + "/", timeout=10).text
        assert "models.b.proxy" not in page  # the error is gone once a config applies
        assert_no_traceback(server.log_path.read_text())
    finally:
        server.stop()


@pytest.mark.parametrize("proxy", ["http://[::1", "http://127.0.0.1:99999"])
def test_serve_refuses_to_start_with_a_bad_proxy_url(tmp_path: Path, proxy: str) -> None:
    port = free_port_block(1)
    server = Server(tmp_path, {"a": {**fake_model(port), "proxy": proxy}})
    try:
        # Before: it started, and every request to a was a 500 (or a traceback at start).
        server.proc.wait(timeout=30)
        output = server.log_path.read_text()
        assert server.proc.returncode != 0 and "models.a.proxy" in output, output[-3000:]
        assert_no_traceback(output)
    finally:
        server.stop()


def test_check_names_the_key_of_each_broken_config_without_a_traceback(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "LLAMASWAP_CONFIG"}
    runs = {}
    for name, (text, _) in BROKEN.items():  # in parallel: each is a Python start-up
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        runs[name] = (
            path,
            subprocess.Popen(
                [sys.executable, "-m", "llamaswap_site.cli", "check", str(path)],
                cwd=ROOT,
                env=environ,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    for name, (path, proc) in runs.items():
        out, err = proc.communicate(timeout=45)
        key = BROKEN[name][1]
        assert proc.returncode == 1, (name, out, err)
        assert f"{path}: error: {key}: " in err, (name, err)
        assert_no_traceback(out + err)
