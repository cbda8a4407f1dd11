"""Config reload on the real server: SIGHUP and --watch-config, with requests in flight.

What a user notices: nothing waiting or running is lost, a model whose definition did not
change keeps its process (the same process id), a new model is served at once, and a
config with errors is refused while the old one keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server import Server, chat, fake_model, free_port_block, serve

pytestmark = pytest.mark.timeout(90)


def pid_of(server: Server, port: int) -> int:
    """The process id of the model server listening on ``port``."""
    for pid in server.children():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"--port {port} " in cmdline:
            return pid
    raise AssertionError(f"no model process on port {port}")


def rewrite(server: Server, models: dict) -> None:
    config = yaml.safe_load(server.config_path.read_text())
    config["models"] = models
    server.config_path.write_text(yaml.safe_dump(config))


def until(what: str, check, timeout: float = 15, why=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} never happened: {why()}")
        time.sleep(0.05)


def test_sighup_reload_keeps_the_queue_and_unchanged_models(tmp_path):
    port = free_port_block(3)
    models = {"a": fake_model(port), "b": fake_model(port + 1)}
    with serve(tmp_path, models) as server:

        async def scenario():
            async with httpx.AsyncClient(timeout=30) as client:
                await client.post(server.url + "/v1/chat/completions", json=chat("a", "warm"))
                before = pid_of(server, port)
                running = asyncio.create_task(
                    client.post(server.url + "/v1/chat/completions", json=chat("a", "running", fake_delay=1.5))
                )
                await asyncio.to_thread(server.wait_running)
                waiting = [
                    asyncio.create_task(client.post(server.url + "/v1/chat/completions", json=chat(m, m)))
                    for m in ("a", "b")
                ]
                await asyncio.to_thread(server.wait_queue, 2)
                rewrite(server, {**models, "c": fake_model(port + 2)})
                os.kill(server.proc.pid, signal.SIGHUP)
                await asyncio.to_thread(
                    until, "c listed", lambda: "c" in httpx.get(server.url + "/v1/models").text
                )
                assert pid_of(server, port) == before  # a was not restarted under its request
                responses = await asyncio.gather(running, *waiting)
                new = await client.post(server.url + "/v1/chat/completions", json=chat("c", "new"))
                return responses, new

        responses, new = asyncio.run(scenario())
        assert [r.status_code for r in responses] == [200, 200, 200]
        assert new.status_code == 200

        # A broken config is refused; the old one keeps serving.
        server.config_path.write_text("models: [this is not a mapping\n")
        os.kill(server.proc.pid, signal.SIGHUP)
        until("the refusal logged", lambda: "config reload refused" in server.log_path.read_text())
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("c", "still"), timeout=30)
        assert r.status_code == 200
        page = httpx.get(server.url + "/", timeout=10).text
        assert "Config reload refused" in page and "YAML syntax error" in page


def test_watch_config_picks_up_an_edit(tmp_path):
    port = free_port_block(2)
    models = {"a": fake_model(port)}
    server = Server(tmp_path, models, args=("--watch-config",))
    try:
        server.wait_ready()
        assert httpx.post(server.url + "/v1/chat/completions", json=chat("a")).status_code == 200
        rewrite(server, {**models, "b": fake_model(port + 1)})
        answers: list[str] = []

        def b_served() -> bool:
            r = httpx.post(server.url + "/v1/chat/completions", json=chat("b"), timeout=30)
            answers[:] = [f"{r.status_code} {r.text[:200]}"]
            return r.status_code == 200

        until("b served", b_served, timeout=30, why=lambda: (answers, server.log()[-2000:]))
        r = httpx.post(server.url + "/v1/chat/completions", json=chat("a"), timeout=30)
        assert r.status_code == 200
        assert "config reload applied" in server.log_path.read_text()
    finally:
        server.stop()
