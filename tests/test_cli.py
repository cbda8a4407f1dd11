"""The ``llamaswap`` console script: its commands, ``check``, ``--listen`` and the admin line.

Subprocesses run ``python -m llamaswap_site.cli`` (what the installed script calls), so
the tests need no reinstall; pyproject.toml is checked to declare the script.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from django.core.management import call_command, get_commands
from django.core.management.base import CommandError
from django.db import OperationalError

from dashboard.management.commands import ensure_admin
from llamaswap_site import cli
from llamaswap_site.management.commands.serve import exposure_warning, parse_listen
from tests.conftest import pick_free_port

ROOT = Path(__file__).resolve().parent.parent
GOOD = "models:\n  qwen:\n    cmd: /bin/false --port ${PORT}\n"
WARNED = "ui: {}\nlogRequests: true\n" + GOOD
BAD_TTL = "models:\n  qwen:\n    cmd: /bin/false --port ${PORT}\n    ttl: -5\n"


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "LLAMASWAP_CONFIG"}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "llamaswap_site.cli", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --------------------------------------------------------------------------- the script


def test_pyproject_declares_the_console_script() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["llamaswap"] == "llamaswap_site.cli:main"
    module, _, attr = project["scripts"]["llamaswap"].partition(":")
    assert callable(getattr(__import__(module, fromlist=[attr]), attr))


def test_help_lists_the_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    for name in (
        "serve",
        "check",
        "simulate",
        "prune-activity",
        "migrate",
        "createsuperuser",
        "ensure-admin",
        "manage",
    ):
        assert re.search(rf"^  {name} ", result.stdout, re.M), name


def test_no_command_or_an_unknown_one_is_a_usage_error() -> None:
    assert cli.main([]) == 2
    assert cli.main(["bogus"]) == 2


def test_every_command_is_a_django_command() -> None:
    known = get_commands()
    assert {django_name for django_name, _ in cli.COMMANDS.values()} <= set(known)


def test_a_command_help_names_the_script() -> None:
    result = run_cli("check", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: llamaswap check")


# --------------------------------------------------------------------------- check


@pytest.mark.parametrize(
    ("text", "code", "expected"),
    [
        (GOOD, 0, ["ok: 1 model(s), scheduler serial"]),
        # Warnings are printed with their key path and do not fail.
        (WARNED, 0, ["warning: ui: ", "warning: logRequests: ", "2 warning(s)"]),
        # An error names the key path and fails.
        (BAD_TTL, 1, ["config.yaml: error: models.qwen.ttl: must be >= 0", "hint: "]),
        ("models: [\n", 1, ["error: YAML syntax error at line 2"]),
    ],
)
def test_check(tmp_path: Path, text: str, code: int, expected: list[str]) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(text)
    result = run_cli("check", str(config))
    output = result.stdout + result.stderr
    assert result.returncode == code, output
    for part in expected:
        assert part in output, (part, output)
    assert "Traceback" not in output


def test_check_the_example_config() -> None:
    result = run_cli("check", "config.example.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    result = run_cli("check", str(missing))
    assert result.returncode == 1
    assert f"{missing}: error: config file not found" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_without_a_file(tmp_path: Path) -> None:
    result = run_cli("check")
    assert result.returncode != 0
    assert "no config" in result.stderr and "Traceback" not in result.stderr
    # LLAMASWAP_CONFIG names the default.
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    assert run_cli("check", env={"LLAMASWAP_CONFIG": str(config)}).returncode == 0


def test_check_command_in_process(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(BAD_TTL)
    err = io.StringIO()
    with pytest.raises(SystemExit) as info:
        call_command("check_config", str(config), stdout=io.StringIO(), stderr=err)
    assert info.value.code == 1
    assert "models.qwen.ttl" in err.getvalue()


# --------------------------------------------------------------------------- --listen


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (":8099", ("0.0.0.0", 8099)),  # llama-swap (Go): every interface
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
        ("localhost:8080", ("localhost", 8080)),
        ("gpu-box.lan:8080", ("gpu-box.lan", 8080)),
        ("[::1]:8080", ("::1", 8080)),
        ("[::]:8080", ("::", 8080)),
        (" 127.0.0.1:8080 ", ("127.0.0.1", 8080)),
        ("8080", CommandError),
        ("127.0.0.1", CommandError),
        ("127.0.0.1:", CommandError),
        ("127.0.0.1:http", CommandError),
        (":0", CommandError),
        (":65536", CommandError),
        ("[::1:8080", CommandError),
    ],
)
def test_parse_listen(value: str, expected) -> None:
    if expected is CommandError:
        with pytest.raises(CommandError, match="--listen"):
            parse_listen(value)
    else:
        assert parse_listen(value) == expected


@pytest.mark.parametrize(
    ("host", "warns"),
    [
        ("127.0.0.1", False),
        ("127.0.0.2", False),
        ("localhost", False),
        ("::1", False),
        ("0.0.0.0", True),
        ("::", True),
        ("192.168.1.5", True),
        ("gpu-box.lan", True),
    ],
)
def test_exposure_warning(host: str, warns: bool) -> None:
    warning = exposure_warning(host, 8099)
    if not warns:
        assert warning is None
        return
    assert warning is not None
    assert "anyone who can reach this port can use the models and unload them" in warning
    assert "API keys" in warning


def test_serve_on_every_interface_warns_on_stderr_and_in_the_log(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(GOOD)
    port = pick_free_port()
    env = {k: v for k, v in os.environ.items() if k != "LLAMASWAP_CONFIG"}
    env.update(
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        LLAMASWAP_STATE_DIR=str(tmp_path / "state"),
        PYTHONUNBUFFERED="1",
    )
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llamaswap_site.cli", "serve", "--config", str(config),
             "--listen", f":{port}", "--grace", "1"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while "llamaswap serving" not in log_path.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, log_path.read_text()
                time.sleep(0.05)
            output = log_path.read_text()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
    assert f"on http://0.0.0.0:{port}/" in output, output
    lines = [line for line in output.splitlines() if "anyone who can reach this port" in line]
    assert any(line.startswith("warning: listening on 0.0.0.0") for line in lines), output
    assert any("WARNING llamaswap.serve" in line for line in lines), output  # the log record
    # No migrations in this database: the admin hint says so instead of failing.
    assert "llamaswap migrate" in output


# --------------------------------------------------------------------------- ensure-admin


def _ensure_admin(monkeypatch, password: str | None, user: str | None = None) -> str:
    for name, value in (("LLAMASWAP_ADMIN_PASSWORD", password), ("LLAMASWAP_ADMIN_USER", user)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    out = io.StringIO()
    call_command("ensure_admin", stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_ensure_admin_messages_in_every_case(monkeypatch, django_user_model) -> None:
    # No password, no account: how to make one, and nothing claims one exists.
    out = _ensure_admin(monkeypatch, None)
    assert "no admin account yet" in out and "llamaswap createsuperuser" in out
    assert ensure_admin.account_hint() is not None
    # Password, no account: created.
    out = _ensure_admin(monkeypatch, "s3cret-pass", "ops")
    assert "created superuser 'ops'" in out and "no admin account" not in out
    assert django_user_model.objects.get(username="ops").check_password("s3cret-pass")
    # Password, the account exists: updated, new password.
    out = _ensure_admin(monkeypatch, "other-pass", "ops")
    assert "updated superuser 'ops'" in out and "created" not in out
    assert django_user_model.objects.get(username="ops").check_password("other-pass")
    # No password, an account exists: it is named, its password untouched.
    out = _ensure_admin(monkeypatch, None)
    assert "superuser 'ops' exists" in out and "password unchanged" in out
    assert "no admin account" not in out
    assert django_user_model.objects.get(username="ops").check_password("other-pass")
    # ...and serve's start-up line has nothing to add.
    assert ensure_admin.account_hint() is None


@pytest.mark.django_db
def test_ensure_admin_promotes_an_existing_plain_user(monkeypatch, django_user_model) -> None:
    django_user_model.objects.create_user("ops", password="old-pass")
    assert ensure_admin.account_hint() is not None  # not a superuser
    out = _ensure_admin(monkeypatch, "new-pass-123", "ops")
    assert "updated superuser 'ops'" in out
    assert django_user_model.objects.get(username="ops").is_superuser
    assert ensure_admin.account_hint() is None


def test_ensure_admin_before_migrate(monkeypatch) -> None:
    def no_table() -> list[str]:
        raise OperationalError("no such table: auth_user")

    monkeypatch.setattr(ensure_admin, "superuser_names", no_table)
    assert "llamaswap migrate" in (ensure_admin.account_hint() or "")
    with pytest.raises(CommandError, match="llamaswap migrate"):
        _ensure_admin(monkeypatch, None)


# --------------------------------------------------------------------------- README


def test_readme_uses_the_console_script() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "../shared" not in readme
    assert "manage.py" not in readme
    used = set(re.findall(r"\bllamaswap ([a-z][a-z_-]+)", readme))
    commands = set(cli.COMMANDS) | {"manage"}
    assert {"serve", "check"} <= used
    # Prose like "llamaswap sits in front of ..." is not a command; code spans are.
    spans = re.findall(r"`([^`]*)`", readme) + re.findall(r"```[a-z]*\n(.*?)```", readme, re.S)
    for span in spans:
        for name in re.findall(r"(?:^|[\s/])llamaswap ([a-z][a-z_-]+)", span, re.M):
            assert name in commands, (name, span)
