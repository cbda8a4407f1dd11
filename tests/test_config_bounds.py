"""What loading a config may cost, and the URLs it holds: every mistake is a ConfigError
naming the key (or the file), never another exception, a traceback or a 500 later.

* URLs (``models.<id>.proxy``, ``peers.<id>.proxy``): http/https, a host, a port
  1..65535, IPv6 in brackets; what passes is a URL httpx sends to.
* A config that expands: YAML aliases (a billion laughs), recursive aliases, nesting,
  macros that use each other, ``${env.NAME}`` repeated, large files and many fragments.
  Each is refused within a bound of time and memory.
* Macro expansion applies only the macros a value uses; a property test checks it against
  the plain reading of llama-swap's rule (every macro in turn, last declared first).

The real server and ``llamaswap check`` on the same configs: tests/test_e2e_config_errors.py.
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import config as config_mod
from scheduler import sources
from scheduler.config import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    ConfigError,
    check_url,
    expand_macros,
    load_config,
    parse_config,
)
from scheduler.config.macros import Budget, macro_scope
from scheduler.config.values import format_value
from scheduler.sources import load_sources

pytestmark = pytest.mark.timeout(60)

MODEL = "models:\n  a:\n    cmd: /bin/serve --port 9\n    proxy: http://127.0.0.1:9\n"


def model_with(proxy: str) -> dict[str, Any]:
    return {"models": {"a": {"cmd": "/bin/serve", "proxy": proxy}}}


def error_of(data: Any, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, **kwargs)
    return caught.value


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    "proxy, why",
    [
        ("http://[::1", "not a valid URL"),  # urllib raised ValueError: a traceback
        ("http://[::1]x", "only ':PORT'"),
        ("http://[zz::1]:80", "not a valid URL"),
        ("http://[1::2::3]:80", "not a valid URL"),
        ("http://::1:8080", "IPv6 address goes in brackets"),
        ("http://127.0.0.1:99999", "port must be a number 1..65535"),  # a 500 per request
        ("http://127.0.0.1:0", "port must be a number 1..65535"),
        ("http://127.0.0.1:", "port must be a number 1..65535"),
        ("http://127.0.0.1:8o80", "port must be a number 1..65535"),
        ("http://127.0.0.1:+80", "port must be a number 1..65535"),
        ("http://127.0.0.1:" + "9" * 5000, "port must be a number 1..65535"),  # int() limit
        ("http://256.1.1.1:80", "not an IPv4 address"),
        ("http://1.2.3:80", "not an IPv4 address"),
        ("http://exa mple:80", "whitespace or control"),
        ("http://host\n:80", "whitespace or control"),
        ("http://a..b:80", "not a valid host name"),
        ("http://-a:80", "not a valid host name"),
        ("http://" + "a" * 64 + ":80", "not a valid host name"),
        ("http://:80", "must name a host"),
        ("http://user:pw@127.0.0.1:80", "credentials"),
        ("http://127.0.0.1:80/base?x=1", "without a query"),
        ("http://127.0.0.1:80/#top", "fragment"),
        ("ftp://127.0.0.1:80", "http(s) URL"),
        ("127.0.0.1:8080", "http(s) URL"),
        ("http:/127.0.0.1:80", "http(s) URL"),
        ("http://", "must name a host"),
        ("http://bücher.example:80", "xn-- form"),
    ],
)
def test_a_bad_model_or_peer_url_is_an_error_naming_the_key(proxy: str, why: str) -> None:
    error = error_of(model_with(proxy))
    assert error.key == "models.a.proxy" and why in error.message
    peer = {
        "models": {"a": {"cmd": "/bin/serve", "proxy": "http://127.0.0.1:9"}},
        "peers": {"p": {"proxy": proxy, "models": ["m"]}},
    }
    error = error_of(peer)
    assert error.key == "peers.p.proxy" and why in error.message


@pytest.mark.parametrize(
    "proxy",
    [
        "http://127.0.0.1:8080",
        "https://openrouter.ai/api",
        "https://openrouter.ai/api/v1/",
        "http://[::1]:8080",
        "http://[::1]",
        "http://[fe80::1%eth0]:80",
        "http://localhost",
        "http://my_service.internal:65535",
        "http://host.docker.internal.:1",
        "HTTP://EXAMPLE.COM:80",
        "http://xn--bcher-kva.example:80",
    ],
)
def test_good_urls_pass_and_are_urls_httpx_sends_to(proxy: str) -> None:
    config = parse_config(model_with(proxy))
    assert config.models["a"].proxy == proxy
    url = httpx.URL(proxy.rstrip("/") + "/v1/chat/completions")
    assert url.scheme in ("http", "https") and url.host
    assert url.port is None or 1 <= url.port <= 65535


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_whatever_passes_check_url_httpx_accepts(tail: str) -> None:
    for url in (f"http://{tail}", f"http://127.0.0.1:{tail}", f"http://[{tail}]:1"):
        try:
            checked = check_url(url, "k")
        except ConfigError:
            continue
        parsed = httpx.URL(checked + "/v1/models")  # raises on what it cannot send to
        assert parsed.host and (parsed.port is None or 1 <= parsed.port <= 65535)


def test_a_peer_api_key_that_cannot_be_a_header_is_an_error() -> None:
    data = model_with("http://127.0.0.1:9") | {
        "peers": {"p": {"proxy": "http://127.0.0.1:8", "models": ["m"], "apiKey": "sk-a\nX: b"}}
    }
    assert error_of(data).key == "peers.p.apiKey"


@pytest.mark.parametrize(
    "model, key",
    [
        ({"cmd": "/bin/serve \0"}, "models.a.cmd"),
        ({"cmd": "/bin/serve", "env": ["A=\0"]}, "models.a.env[0]"),
        ({"cmd": "/bin/serve", "checkEndpoint": "/health now"}, "models.a.checkEndpoint"),
    ],
)
def test_values_no_process_or_request_could_use_are_errors(model: dict, key: str) -> None:
    data = {"models": {"a": {"proxy": "http://127.0.0.1:9", **model}}}
    assert error_of(data).key == key


# --------------------------------------------------------------------------- expansion


def laughs(levels: int, width: int = 10) -> str:
    """A billion laughs: ``levels`` anchors, each a list of ``width`` uses of the last."""
    lines = ["l0: &l0 [lol]"]
    for i in range(1, levels + 1):
        uses = ", ".join([f"*l{i - 1}"] * width)
        lines.append(f"l{i}: &l{i} [{uses}]")
    return "\n".join(lines) + "\n"


def bounded(call: Any, seconds: float = 10.0, megabytes: float = 200) -> ConfigError:
    """``call()`` raises ConfigError within the time and memory bounds; the error."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ConfigError) as caught:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < seconds
    assert peak < megabytes * 1024 * 1024, f"peak {peak / 2**20:.0f} MB"
    return caught.value


def test_an_alias_bomb_is_refused_naming_the_key(tmp_path: Path) -> None:
    # 2 KB of YAML standing for 10^9 strings; used by a key the parser walks.
    path = write(tmp_path, laughs(9) + MODEL + "    metadata: {x: *l9}\n")
    error = bounded(lambda: load_config(path))
    # The smallest anchor past the bound (l5 holds 10^5 strings and 10^5 lists).
    assert error.key == "l5" and "once its YAML aliases are expanded" in error.message
    assert path in error.message


def test_an_alias_bomb_in_a_fragment_names_the_fragment(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    write(tmp_path, MODEL, "d/00-models.yaml")
    bomb = write(tmp_path, "metadata: " + laughs(9).replace("\n", "\n  ").rstrip(), "d/10-bomb.yaml")
    error = bounded(lambda: load_sources("", str(tmp_path / "d")))
    assert bomb in error.message or error.key == bomb


def test_fragments_that_are_each_small_but_together_too_big_are_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    write(tmp_path, MODEL, "d/00-models.yaml")
    # Each fragment is within the bounds; merged (lists concatenated) they would not be.
    for i in range(3):
        write(tmp_path, laughs(5, 8) + f"metadata{i}: *l5\n", f"d/{i + 1:02}-keys.yaml")
    error = bounded(lambda: load_sources("", str(tmp_path / "d")))
    assert error.key.endswith("-keys.yaml") and "sources up to this one" in error.message


@pytest.mark.parametrize(
    "text, key, why",
    [
        (MODEL + "    metadata: &r [*r]\n", "models.a.metadata[0]", "contains itself"),
        (MODEL + "    metadata: &r {a: *r}\n", "models.a.metadata.a", "contains itself"),
        (MODEL + "    metadata: " + "[" * 70 + "]" * 70 + "\n", None, "nested"),
        (MODEL + "    metadata: " + "[" * 5000 + "]" * 5000 + "\n", None, "nesting depth"),
        (MODEL + "    ttl: 2001-02-30\n", None, "day is out of range"),
        (MODEL + "    ttl: " + "9" * 5000 + "\n", None, "digits"),
        (MODEL + "    metadata: !!pairs [a: [1, 2]]\n", "models.a.metadata", "must be a mapping"),
    ],
)
def test_documents_python_cannot_walk_are_config_errors(
    tmp_path: Path, text: str, key: str | None, why: str
) -> None:
    path = write(tmp_path, text)
    error = bounded(lambda: load_config(path))
    assert why in error.message
    assert error.key == (key or path) or error.key.startswith("models.a.metadata")


def test_nesting_is_bounded() -> None:
    deep: Any = "x"
    for _ in range(MAX_CONFIG_DEPTH + 1):
        deep = [deep]
    error = error_of(model_with("http://127.0.0.1:9") | {"hooks": deep})
    assert "nested deeper than" in error.message and error.key.startswith("hooks")


def test_macros_that_double_each_other_are_refused_naming_the_key() -> None:
    macros = {"m0": "x" * 64} | {f"m{i}": f"${{m{i - 1}}}${{m{i - 1}}}" for i in range(1, 40)}
    data = {"macros": macros, "models": {"a": {"cmd": "/bin/serve ${m39}", "proxy": "http://127.0.0.1:9"}}}
    error = bounded(lambda: parse_config(data))
    assert error.key == "models.a.cmd" and "macro expansion" in error.message


def test_a_long_environment_variable_used_many_times_is_refused() -> None:
    data = {"models": {"a": {"cmd": "/bin/serve " + "${env.BIG} " * 10_000}}}
    error = bounded(lambda: parse_config(data, environ={"BIG": "y" * 100_000}))
    assert error.key == "models.a.cmd" and "macro expansion" in error.message


def test_a_long_chain_of_macros_is_bounded_in_time() -> None:
    chain = {"c0": "x"} | {f"c{i}": f"${{c{i - 1}}}" for i in range(1, 5000)}
    models = {f"m{j}": {"cmd": "/bin/serve ${c4999}", "proxy": "http://127.0.0.1:9"} for j in range(50)}
    error = bounded(lambda: parse_config({"macros": chain, "models": models}))
    assert error.key.startswith("models.m") and "macro expansion" in error.message


def test_a_file_over_the_size_bound_is_refused_unread(tmp_path: Path) -> None:
    path = write(tmp_path, MODEL + "#" * MAX_CONFIG_BYTES + "\n")
    error = bounded(lambda: load_config(path), megabytes=50)
    assert error.key == path and "larger than" in error.message
    # A device that never ends is read no further than the bound.
    error = bounded(lambda: load_config("/dev/zero"), megabytes=50)
    assert error.key == "/dev/zero"


def test_too_many_fragments_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "MAX_CONFIG_FILES", 3)
    (tmp_path / "d").mkdir()
    for i in range(4):
        write(tmp_path, "", f"d/{i}.yaml")
    error = error_of_sources("", str(tmp_path / "d"))
    assert error.key == str(tmp_path / "d") and "more than 3" in error.message


def error_of_sources(config: str, config_dir: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_sources(config, config_dir)
    return caught.value


def test_an_unexpected_exception_while_loading_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, MODEL)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("a parser bug")

    monkeypatch.setattr(sources, "parse_config", broken)
    with caplog.at_level("DEBUG", logger="llamaswap.config"):
        error = error_of_sources(path, "")
    assert error.key == path and "TypeError: a parser bug" in error.message
    assert any(r.exc_info for r in caplog.records)  # the traceback, at debug


def test_a_real_config_is_far_within_the_bounds() -> None:
    root = Path(__file__).resolve().parent.parent
    for path in [root / "config.example.yaml", *sorted((root / "tests/configs").glob("*.yaml"))]:
        values, chars = config_mod.check_size(config_mod.read_yaml(str(path)))
        assert values < config_mod.MAX_CONFIG_VALUES / 100
        assert chars < config_mod.MAX_CONFIG_CHARS / 100


# --------------------------------------------------------------------------- macro order


def reference(text: str, macros: list[tuple[str, Any]]) -> Any:
    """llama-swap's rule read plainly: every macro in turn, last declared first."""
    value: Any = text
    for name, replacement in reversed(macros):
        slug = f"${{{name}}}"
        if isinstance(value, str):
            if value == slug:
                value = replacement
            elif slug in value:
                value = value.replace(slug, format_value(replacement))
    return value


NAMES = ["a", "b", "c", "d"]
pieces = st.sampled_from(["x", " ", "$", "{", "}", "${", *(f"${{{n}}}" for n in NAMES), "${e}"])
texts = st.lists(pieces, max_size=8).map("".join)
values = st.one_of(texts, st.integers(-5, 5), st.booleans())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(NAMES), values), max_size=6, unique_by=lambda m: m[0]),
    texts,
)
def test_expansion_matches_the_plain_reading(macros: list[tuple[str, Any]], text: str) -> None:
    scope = macro_scope(macros)
    assert expand_macros(text, scope, "k", Budget()) == reference(text, macros)
