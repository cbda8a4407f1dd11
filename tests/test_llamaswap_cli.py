"""llama-swap's command line and logging keys, through the real ``llamaswap`` script.

A systemd unit written for llama-swap (``llama-swap -config F -listen :8080``) must start
llamaswap with only the binary renamed; ``logLevel``, ``logToStdout`` and
``logTimeFormat`` must hold for what ``serve`` prints. Every server here is a real
subprocess (``python -m llamaswap_site.cli``, what the installed script runs).
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from llamaswap_site import cli
from tests.conftest import pick_free_port
from tests.server import fake_model

ROOT = Path(__file__).resolve().parent.parent


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMASWAP_CONFIG", "LOG_LEVEL")}
    env.update(
        DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}",
        LLAMASWAP_STATE_DIR=str(tmp / "state"),
        PYTHONUNBUFFERED="1",
    )
    return env


class Served:
    def __init__(self, proc: subprocess.Popen, out: Path, err: Path, url: str) -> None:
        self.proc, self.out_path, self.err_path, self.url = proc, out, err, url

    @property
    def out(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def err(self) -> str:
        return self.err_path.read_text(errors="replace")


@contextmanager
def llamaswap(
    tmp: Path, *args: str, url: str, verify: ssl.SSLContext | bool = False
) -> Iterator[Served]:
    """``llamaswap ARGS`` until its ``/health`` answers at ``url``; SIGTERM at the end
    (the files then hold everything it printed)."""
    out, err = tmp / "stdout", tmp / "stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llamaswap_site.cli", *args],
            cwd=ROOT,
            env=_env(tmp),
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    served = Served(proc, out, err, url)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, served.out + served.err
            try:
                if httpx.get(url + "/health", verify=verify, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, served.out + served.err
            time.sleep(0.05)
        yield served
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


def _config(tmp: Path, **top) -> Path:
    port = pick_free_port()
    models = {
        "m": fake_model(port),
        "broken": {"cmd": "/bin/false ${PORT}", "proxy": "http://127.0.0.1:${PORT}"},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump({"healthCheckTimeout": 15, "models": models, **top}))
    return path


def _chat(url: str, model: str, verify: ssl.SSLContext | bool = False) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(url + "/v1/chat/completions", json=body, verify=verify, timeout=30)


# -- the flags, parsed as Go's flag package does (pure) -------------------------------------


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["-config", "c.yaml", "-listen", ":8080"], {"config": "c.yaml", "listen": ":8080"}),
        (["--config=c.yaml", "--listen=:1"], {"config": "c.yaml", "listen": ":1"}),
        (["-watch-config", "-config-dir", "d"], {"watch-config": True, "config-dir": "d"}),
        (["-watch-config=false", "-config", "c"], {"watch-config": False, "config": "c"}),
        (["-config", "-odd-name.yaml"], {"config": "-odd-name.yaml"}),  # Go takes it as the value
        (["-version"], {"version": True}),
        # Parsing stops at `--` or the first non-flag; the rest is ignored (as llama-swap).
        (["-config", "c", "--", "-listen", "x"], {"config": "c"}),
        (["-config", "c", "extra", "-listen", "x"], {"config": "c"}),
        (
            ["-tls-cert-file", "c.pem", "-tls-key-file=k.pem"],
            {"tls-cert-file": "c.pem", "tls-key-file": "k.pem"},
        ),
    ],
)
def test_go_flags(argv, flags):
    assert cli.parse_go_flags(argv) == flags


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-nope"], "flag provided but not defined: -nope"),
        (["-config"], "flag needs an argument: -config"),
        (["-watch-config=maybe"], 'invalid boolean value "maybe" for -watch-config'),
        (["---config", "x"], "bad flag syntax: ---config"),
        (["-=x"], "bad flag syntax: -=x"),
    ],
)
def test_go_flag_errors(argv, message):
    with pytest.raises(cli.FlagError, match=re.escape(message)):
        cli.parse_go_flags(argv)


def test_go_flags_become_serve_options():
    flags = cli.parse_go_flags(["-config", "c", "-listen", ":9", "-watch-config", "-version"])
    assert cli.serve_argv(flags) == ["--config", "c", "--listen", ":9", "--watch-config"]


# -- the script, as a subprocess ---------------------------------------------------------------


def test_version_exits_zero_with_llama_swaps_line_shape():
    for flag in ("-version", "--version", "-version=true"):
        result = subprocess.run(
            [sys.executable, "-m", "llamaswap_site.cli", flag],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert re.fullmatch(r"version: \S+ \(llamaswap\), built at \S+\n", result.stdout), flag


def test_an_unknown_flag_is_a_usage_error_as_in_go(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "llamaswap_site.cli", "-config", "x.yaml", "-bogus"],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "flag provided but not defined: -bogus" in result.stderr
    assert "-tls-cert-file" in result.stderr  # the usage follows, as Go prints it
    assert "Traceback" not in result.stderr


def test_tls_files_both_or_neither_and_the_endpoint(tmp_path):
    from django.core.management.base import CommandError

    from llamaswap_site.management.commands.serve import endpoint, tls_files

    cert, key = tmp_path / "c:1.pem", tmp_path / "k=1.pem"
    cert.write_text("x")
    key.write_text("x")
    with pytest.raises(CommandError, match="both --tls-cert-file and --tls-key-file"):
        tls_files(str(cert), "")
    with pytest.raises(CommandError, match="no such file"):
        tls_files(str(cert), str(tmp_path / "missing.pem"))
    assert tls_files("", "") is None
    files = tls_files(str(cert), str(key))
    assert endpoint("::", 8443, None) == "tcp:port=8443:interface=\\:\\::backlog=1024"
    ssl_endpoint = endpoint("127.0.0.1", 8443, files)
    assert ssl_endpoint.startswith("ssl:port=8443:interface=127.0.0.1:backlog=1024:certKey=")
    assert "c\\:1.pem:privateKey=" in ssl_endpoint and ssl_endpoint.endswith("k\\=1.pem")


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_flags_serve_https(tmp_path):
    cert, key = _self_signed(tmp_path)
    config = _config(tmp_path)
    port = pick_free_port()
    trust = ssl.create_default_context(cafile=str(cert))  # the client trusts this cert only
    with llamaswap(
        tmp_path,
        f"-config={config}",
        "-listen",
        f"localhost:{port}",
        "--tls-cert-file",
        str(cert),
        "-tls-key-file",
        str(key),
        url=f"https://localhost:{port}",
        verify=trust,
    ) as served:
        answer = _chat(served.url, "m", verify=trust)
        assert answer.status_code == 200, answer.text
        with pytest.raises(httpx.HTTPError):  # no plain HTTP on that port
            httpx.get(f"http://localhost:{port}/health", timeout=5)
    assert f"on https://localhost:{port}/" in served.out


# -- logging keys, honoured under serve ------------------------------------------------------

RFC3339 = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(Z|[+-]\d\d:\d\d)"
PY_STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"


def _serve_and_log(tmp: Path, listen: str = "127.0.0.1", **top) -> Served:
    """Serve a config with llama-swap's command line (``-config F -listen ADDR``), answer
    one request (an INFO dispatch line, the model's output) and fail one model start
    (warnings), then stop."""
    config = _config(tmp, **top)
    port = pick_free_port()
    url = f"http://127.0.0.1:{port}"
    with llamaswap(tmp, "-config", str(config), "-listen", f"{listen}:{port}", url=url) as s:
        answer = _chat(url, "m")
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        assert _chat(url, "broken").status_code >= 500
    return s


def _log_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " llamaswap." in line or " scheduler." in line]


def test_a_llama_swap_systemd_command_line_serves_and_logs_by_default(tmp_path):
    """`llama-swap -config F -listen :PORT`, binary renamed: serves on every interface;
    the default logging: INFO lines with Python's stamp on stderr, no model output on
    stdout (logToStdout: proxy). A reload (SIGHUP) applies new logging keys at once."""
    config = _config(tmp_path)
    port = pick_free_port()
    url = f"http://127.0.0.1:{port}"
    with llamaswap(tmp_path, "-config", str(config), "-listen", f":{port}", url=url) as served:
        answer = _chat(url, "m")
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        lines = _log_lines(served.err)
        assert any(" INFO llamaswap.dispatcher dispatch" in line for line in lines), served.err
        assert all(re.match(PY_STAMP, line) for line in lines), served.err
        assert " on http://0.0.0.0:" in served.out
        assert "[m] " not in served.out

        settings = yaml.safe_load(config.read_text())
        config.write_text(
            yaml.safe_dump({**settings, "logLevel": "warn", "logTimeFormat": "kitchen"})
        )
        before = len(served.err)
        os.kill(served.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "config reload applied" not in served.err[before:]:
            assert time.monotonic() < deadline, served.err
            time.sleep(0.05)
        applied = len(served.err)
        assert _chat(url, "m").status_code == 200
        assert _chat(url, "broken").status_code >= 500
    after = _log_lines(served.err[applied:])
    assert after and not [line for line in after if " INFO " in line], served.err[applied:]
    assert all(re.match(r"\d{1,2}:\d\d[AP]M (WARNING|ERROR) ", line) for line in after), after


def test_log_level_warn_time_format_and_model_output_under_serve(tmp_path):
    served = _serve_and_log(tmp_path, logLevel="warn", logTimeFormat="rfc3339", logToStdout="both")
    lines = _log_lines(served.err)
    assert lines, served.err
    assert not [line for line in lines if " INFO " in line or " DEBUG " in line], served.err
    assert any("model broken: start failed" in line for line in lines), served.err
    assert all(re.match(RFC3339 + " (WARNING|ERROR) ", line) for line in lines), served.err
    assert "[m] fakellm: listening on" in served.out  # logToStdout: both


def test_log_to_stdout_none_under_serve(tmp_path):
    served = _serve_and_log(tmp_path, logToStdout="none")
    lines = _log_lines(served.err)
    assert lines, served.err  # warnings and errors only (llama-swap: nothing)
    assert not [line for line in lines if " INFO " in line], served.err
    assert "[m] " not in served.out


# -- `llamaswap check`: every error in one run -------------------------------------------------

SCRIPT = Path(sys.executable).parent / "llamaswap"
"""The installed console script (what a user and a systemd unit run)."""


def test_check_lists_every_error_each_with_its_key(tmp_path):
    """Three mistakes in different places (a model's ttl, another model's missing cmd, a
    CORS setting) and a list entry: all reported in one run, each naming its key; exit 1."""
    port = pick_free_port()
    config = {
        "models": {
            "a": {**fake_model(port), "ttl": -5},
            "b.v2": {"proxy": "http://127.0.0.1:1"},  # no cmd; a dot in the id
            "c": fake_model(port + 1),
        },
        "security": {"cors": {"maxAge": "a day"}},
        "apiKeys": ["fine", "has space"],
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [str(SCRIPT), "check", str(path)],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    keys = sorted(line.split(": error: ", 1)[1].split(": ", 1)[0] for line in errors)
    assert keys == ["apiKeys[1]", "models.a.ttl", "models.b.v2.cmd", "security.cors.maxAge"], (
        result.stderr
    )


def test_check_of_a_config_dir_lists_every_error_across_its_fragments(tmp_path):
    """``check --config-dir D`` (llama-swap's fragments, merged as ``serve`` merges them):
    mistakes in two fragments and the main file, all in one run, each naming its key."""
    port = pick_free_port()
    main = tmp_path / "config.yaml"
    main.write_text(yaml.safe_dump({"security": {"cors": {"maxAge": "a day"}}}))
    fragments = tmp_path / "conf.d"
    fragments.mkdir()
    (fragments / "10-a.yaml").write_text(
        yaml.safe_dump({"models": {"a": {**fake_model(port), "ttl": -5}}})
    )
    (fragments / "20-b.yml").write_text(
        yaml.safe_dump(
            {
                "models": {"b": {"proxy": "http://127.0.0.1:1"}, "c": fake_model(port + 1)},
                "apiKeys": ["fine", "has space"],
            }
        )
    )
    result = subprocess.run(
        [str(SCRIPT), "check", str(main), "--config-dir", str(fragments)],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    keys = sorted(line.split(": error: ", 1)[1].split(": ", 1)[0] for line in errors)
    assert keys == ["apiKeys[1]", "models.a.ttl", "models.b.cmd", "security.cors.maxAge"], (
        result.stderr
    )


def test_check_of_a_good_config_exits_zero(tmp_path):
    path = _config(tmp_path)
    result = subprocess.run(
        [str(SCRIPT), "check", str(path)],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert ": ok: 2 model(s)" in result.stdout


# -- a systemd unit written for llama-swap -----------------------------------------------------


@pytest.mark.parametrize(
    "exec_start",
    [
        "llama-swap -config {config} -listen :{port}",
        "llama-swap --config {config} --listen 127.0.0.1:{port}",
        "llama-swap -config={config} -listen=:{port} -watch-config",
    ],
)
def test_a_llama_swap_systemd_unit_starts_llamaswap_with_the_binary_renamed(tmp_path, exec_start):
    """The unit's ``ExecStart=`` as llama-swap's docs write it, split as systemd splits it
    (shell-style words, no shell), the binary replaced by the installed script."""
    import shlex

    config = _config(tmp_path)
    port = pick_free_port()
    argv = shlex.split(exec_start.format(config=config, port=port))
    argv[0] = str(SCRIPT)
    url = f"http://127.0.0.1:{port}"
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            argv, cwd="/", env=_env(tmp_path), stdout=o, stderr=e, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, err.read_text()
            try:
                health = httpx.get(url + "/health", timeout=1)
                if health.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.05)
        assert health.text == "OK"
        models = httpx.get(url + "/v1/models", timeout=5)
        assert models.status_code == 200
        assert [m["id"] for m in models.json()["data"]] == ["broken", "m"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
    assert proc.returncode in (0, -signal.SIGTERM), err.read_text()
