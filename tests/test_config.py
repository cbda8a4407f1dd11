"""config.yaml -> Config, with llama-swap's semantics (see the docstring of scheduler/config/__init__.py)."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command
from django.core.management.base import SystemCheckError

from scheduler import checks
from scheduler.config import (
    DEFAULT_UPSTREAM_IGNORE_PATHS,
    Capabilities,
    Config,
    ConfigError,
    ModelConfig,
    ModelTimeouts,
    QueueBounds,
    RequestLimits,
    load_config,
    parse_config,
    split_command,
)
from scheduler.core.policy import KEY_AGING, KEY_BONUS, KEY_FIFO, KEY_USE, Policy, SchedulerSettings
from scheduler.keys import ApiKey, KeyPolicy

REPO = Path(__file__).resolve().parent.parent

MINIMAL = """
models:
  m:
    cmd: server --port ${PORT}
"""


def parse(text: str, environ: dict[str, str] | None = None) -> Config:
    return parse_config(yaml.safe_load(textwrap.dedent(text)), environ=environ or {})


def model(text: str, environ: dict[str, str] | None = None, model_id: str = "m") -> ModelConfig:
    return parse(text, environ).models[model_id]


def with_model(settings: str, top: str = "") -> str:
    """A config with one model ``m`` (cmd uses ${PORT}) plus extra model and top-level keys."""
    settings = textwrap.dedent(settings).strip()
    if not settings.startswith("cmd:"):  # the case supplies its own cmd
        settings = "cmd: server --port ${PORT}\n" + settings
    body = textwrap.indent(settings, "    ")
    return f"{textwrap.dedent(top).strip()}\nmodels:\n  m:\n{body}\n"


def error_of(text: str, environ: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text, environ)
    return info.value


# --------------------------------------------------------------------------- defaults


@pytest.mark.parametrize(
    ("attribute", "expected"),
    [
        ("health_check_timeout", 120),  # llama-swap's default
        ("start_port", 5800),
        ("global_ttl", 0),  # never unload
        ("unload_timeout", 10),
        ("log_level", "info"),
        ("preload", ()),
        ("warnings", ()),  # a plain config says nothing
        ("aliases", {}),
        ("scheduler", SchedulerSettings()),  # serial, agingDivisor 60, swapAffinityBonus 10
        ("bounds", QueueBounds()),  # no queue bound
        ("limits", RequestLimits()),
    ],
)
def test_global_defaults(attribute: str, expected: Any) -> None:
    assert getattr(parse(MINIMAL), attribute) == expected


@pytest.mark.parametrize(
    ("attribute", "expected"),
    [
        ("cmd", ("server", "--port", "5800")),  # first model gets startPort
        ("proxy", "http://localhost:5800"),  # default proxy, localhost kept as written
        ("cmd_stop", None),  # SIGTERM then SIGKILL
        ("check_endpoint", "/health"),
        ("ttl", 0),  # globalTTL
        ("unload_timeout", 10),  # global unloadTimeout
        ("health_check_timeout", 120),  # copied from the global value
        ("concurrency_limit", 10),  # llama-swap's internal default
        ("aliases", ()),
        ("env", {}),
        ("use_model_name", ""),
        ("name", ""),
        ("description", ""),
        ("unlisted", False),
        ("metadata", {}),
        ("strip_params", ()),
        ("set_params", {}),
        ("timeouts", ModelTimeouts()),
    ],
)
def test_model_defaults(attribute: str, expected: Any) -> None:
    assert getattr(model(MINIMAL), attribute) == expected


@pytest.mark.parametrize(
    ("settings", "top", "attribute", "expected"),
    [
        # globalTTL is the default ttl ...
        ("", "globalTTL: 30", "ttl", 30),
        # ... a model's own ttl wins ...
        ("ttl: 5", "globalTTL: 30", "ttl", 5),
        # ... 0 is an explicit "never", not "inherit" ...
        ("ttl: 0", "globalTTL: 30", "ttl", 0),
        # ... and -1 is llama-swap's spelled-out "use globalTTL".
        ("ttl: -1", "globalTTL: 30", "ttl", 30),
        # unloadTimeout: the global value, which a model may override; 0 means inherit.
        ("", "unloadTimeout: 3", "unload_timeout", 3),
        ("unloadTimeout: 7", "unloadTimeout: 3", "unload_timeout", 7),
        ("unloadTimeout: 0", "unloadTimeout: 3", "unload_timeout", 3),
        # healthCheckTimeout is global only, and at least 15 s.
        ("", "healthCheckTimeout: 300", "health_check_timeout", 300),
        ("", "healthCheckTimeout: 5", "health_check_timeout", 15),
        # concurrencyLimit: 0 (llama-swap's "unset") is the default of 10.
        ("concurrencyLimit: 0", "", "concurrency_limit", 10),
        ("concurrencyLimit: 2", "", "concurrency_limit", 2),
        # checkEndpoint: "none" skips health checking.
        ("checkEndpoint: none", "", "check_endpoint", None),
        ("checkEndpoint: /v1/models", "", "check_endpoint", "/v1/models"),
        # A YAML key with no value is unset, not an error.
        ("ttl:", "globalTTL: 30", "ttl", 30),
        ("useModelName: org/model-7b", "", "use_model_name", "org/model-7b"),
        ("unlisted: true", "", "unlisted", True),
        # env is llama-swap's list of NAME=value; a value may contain '=', the last one wins.
        ("env: [A=1, B=x=y, A=2]", "", "env", {"A": "2", "B": "x=y"}),
        # stripParams: trimmed, deduplicated, sorted, and `model` is never stripped.
        (
            "filters: {stripParams: 'top_p, temperature, model, , top_p'}",
            "",
            "strip_params",
            ("temperature", "top_p"),
        ),
        # The legacy snake_case spelling still works.
        ("filters: {strip_params: 'top_k'}", "", "strip_params", ("top_k",)),
        # setParams never overrides `model`.
        (
            "filters: {setParams: {model: x, temperature: 0.2}}",
            "",
            "set_params",
            {"temperature": 0.2},
        ),
        ("metadata: {family: qwen, size: 7}", "", "metadata", {"family": "qwen", "size": 7}),
        # A fixed proxy is kept exactly as written (no localhost rewriting).
        ("proxy: http://localhost:${PORT}/", "", "proxy", "http://localhost:5800/"),
    ],
)
def test_model_settings(settings: str, top: str, attribute: str, expected: Any) -> None:
    assert getattr(model(with_model(settings, top)), attribute) == expected


@pytest.mark.parametrize(
    ("top", "attribute", "expected"),
    [
        ("logLevel: DEBUG", "log_level", "debug"),  # case-insensitive, like llama-swap
        ("logLevel: warn", "log_level", "warn"),
        ("unloadTimeout: 0", "unload_timeout", 10),  # 0 is the default
        ("healthCheckTimeout: 15.5", "health_check_timeout", 15.5),
    ],
)
def test_global_settings(top: str, attribute: str, expected: Any) -> None:
    assert getattr(parse(with_model("", top)), attribute) == expected


# --------------------------------------------------------------------------- cmd


@pytest.mark.parametrize(
    ("text", "argv"),
    [
        # One line, split like a shell.
        ("llama-server -m model.gguf", ("llama-server", "-m", "model.gguf")),
        # Quotes group words; no shell expands anything.
        ("run --prompt 'a b' \"c d\" $HOME", ("run", "--prompt", "a b", "c d", "$HOME")),
        # Comment lines (even indented) are dropped; newlines separate arguments.
        ("# comment\nrun\n   # indented comment\n--flag", ("run", "--flag")),
        # A trailing backslash joins the next line.
        ("run \\\n  --a 1 \\\n  --b 2", ("run", "--a", "1", "--b", "2")),
        # '#' inside a line is not a comment (llama-swap only drops whole lines).
        ("run --sep x#y", ("run", "--sep", "x#y")),
        # Only comments: nothing to run.
        ("# nothing\n", ()),
    ],
)
def test_split_command(text: str, argv: tuple[str, ...]) -> None:
    assert split_command(text) == argv


@pytest.mark.parametrize(
    ("cmd_yaml", "argv"),
    [
        # A literal block with comments and continuation lines, as in llama-swap's docs.
        (
            "cmd: |\n  # start the server\n  server\n    --port ${PORT} \\\n    --ctx 4096\n",
            ("server", "--port", "5800", "--ctx", "4096"),
        ),
        # A folded block joins lines with spaces.
        ("cmd: >\n  server\n  --port ${PORT}\n", ("server", "--port", "5800")),
        # A macro mentioned only in a comment is neither expanded nor an error.
        ("cmd: |\n  # uses ${undefined}\n  server --port ${PORT}\n", ("server", "--port", "5800")),
    ],
)
def test_cmd_from_yaml(cmd_yaml: str, argv: tuple[str, ...]) -> None:
    text = "models:\n  m:\n" + textwrap.indent(cmd_yaml, "    ")
    assert model(text).cmd == argv


@pytest.mark.parametrize(
    ("cmd_stop", "argv"),
    [
        # ${PID} stays for the process layer to fill in at stop time.
        ("kill -TERM ${PID}", ("kill", "-TERM", "${PID}")),
        # ${MODEL_ID} is expanded like in cmd.
        ("docker stop ${MODEL_ID}", ("docker", "stop", "m")),
        # Comment lines are dropped here too; an empty cmdStop is no cmdStop.
        ("'# no stop command'", None),
    ],
)
def test_cmd_stop(cmd_stop: str, argv: tuple[str, ...] | None) -> None:
    assert model(with_model(f"cmdStop: {cmd_stop}")).cmd_stop == argv


# --------------------------------------------------------------------------- macros


@pytest.mark.parametrize(
    ("macros", "cmd", "argv"),
    [
        # Plain substitution.
        (
            "bin: /opt/llama-server",
            "${bin} --port ${PORT}",
            ("/opt/llama-server", "--port", "5800"),
        ),
        # Nested: a macro may use macros declared before it.
        (
            "base: /models\npath: ${base}/llama\nfull: ${path}/q4.gguf",
            "run -m ${full} --port ${PORT}",
            ("run", "-m", "/models/llama/q4.gguf", "--port", "5800"),
        ),
        # Numbers and booleans are written as llama-swap writes them.
        (
            "ctx: 4096\ntemp: 0.7\nflag: true",
            "run ${ctx} ${temp} ${flag}",
            ("run", "4096", "0.7", "true"),
        ),
        # ${MODEL_ID} inside a global macro is the id of the model using it.
        ("name: --alias ${MODEL_ID}", "run ${name}", ("run", "--alias", "m")),
        # ${PORT} inside a macro counts as the cmd using ${PORT}.
        ("serve: server --port ${PORT}", "${serve}", ("server", "--port", "5800")),
        # ${env.NAME} in a macro value.
        ("dir: ${env.MODELS}/gguf", "run ${dir}", ("run", "/srv/models/gguf")),
        # A multi-word env value is split like the rest of cmd.
        ("", "${env.LAUNCH} --port ${PORT}", ("python", "-m", "x", "--port", "5800")),
    ],
)
def test_macros_expand(macros: str, cmd: str, argv: tuple[str, ...]) -> None:
    text = f"macros:\n{textwrap.indent(macros, '  ')}\nmodels:\n  m:\n    cmd: '{cmd}'\n"
    if "${PORT}" not in text:
        text += "    proxy: http://127.0.0.1:9000\n"
    environ = {"MODELS": "/srv/models", "LAUNCH": "python -m x"}
    assert model(text, environ).cmd == argv


def test_model_macros_override_globals() -> None:
    # A model's macro replaces the global one everywhere in that model, even inside
    # global macros that use it; other models still see the global value.
    config = parse(
        """
        macros:
          tag: global
          msg: value-${tag}
        models:
          a:
            macros:
              tag: local
            cmd: echo ${msg} --port ${PORT}
          b:
            cmd: echo ${msg} --port ${PORT}
        """
    )
    assert config.models["a"].cmd[:2] == ("echo", "value-local")
    assert config.models["b"].cmd[:2] == ("echo", "value-global")


def test_whole_value_macros_keep_their_type() -> None:
    # `ttl: ${idle}` with an integer macro is an integer, as in llama-swap; metadata too.
    m = model(
        """
        macros:
          idle: 60
          temp: 0.7
        models:
          m:
            cmd: server --port ${PORT}
            ttl: ${idle}
            metadata: {port: "${PORT}", temp: "${temp}", note: "${MODEL_ID} on ${PORT}"}
        """
    )
    assert m.ttl == 60
    assert m.metadata == {"port": 5800, "temp": 0.7, "note": "m on 5800"}


def test_env_value_as_a_whole_scalar_is_typed() -> None:
    # llama-swap substitutes ${env.*} into the YAML text, so a bare number stays a number.
    config = parse(with_model("", "startPort: ${env.BASE}"), {"BASE": "6000"})
    assert config.start_port == 6000
    assert config.models["m"].proxy == "http://localhost:6000"


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        # Reserved names cannot be defined, globally or per model.
        ("macros: {PORT: 1}\n" + MINIMAL, "macros.PORT", "reserved"),
        ("macros: {PID: 1}\n" + MINIMAL, "macros.PID", "reserved"),
        (with_model("macros: {MODEL_ID: x}"), "models.m.macros.MODEL_ID", "reserved"),
        # An undefined macro left in cmd names the key.
        (with_model("cmd: run ${nope} --port ${PORT}"), "models.m.cmd", "${nope}"),
        # A macro may only use macros declared before it.
        (
            "macros: {a: '${b}', b: x}\nmodels: {m: {cmd: 'run ${a} ${PORT}'}}",
            "models.m.cmd",
            "${b}",
        ),
        # Self-reference can never resolve.
        ("macros: {a: 'x${a}'}\n" + MINIMAL, "macros.a", "itself"),
        # Names are restricted to llama-swap's [a-zA-Z0-9_-].
        ("macros: {a.b: x}\n" + MINIMAL, "macros.a.b", "letters, digits"),
        # Values are scalars.
        ("macros: {a: [1, 2]}\n" + MINIMAL, "macros.a", "string, number or boolean"),
        ("macros: {a: }\n" + MINIMAL, "macros.a", "string, number or boolean"),
        # A missing environment variable is an error where it is used.
        ("macros: {home: '${env.NOPE_X}'}\n" + MINIMAL, "macros.home", "NOPE_X"),
        (with_model("cmd: run ${env.NOPE_X} ${PORT}"), "models.m.cmd", "NOPE_X"),
        (with_model("env: ['A=${env.NOPE_X}']"), "models.m.env[0]", "NOPE_X"),
        # ${PID} only exists when cmdStop runs.
        (with_model("cmd: run ${PID} ${PORT}"), "models.m.cmd", "${PID}"),
        # Undefined macros anywhere in a model are reported with the full path.
        (with_model("metadata: {a: {b: '${nope}'}}"), "models.m.metadata.a.b", "${nope}"),
        (with_model("name: '${nope}'"), "models.m.name", "${nope}"),
        (with_model("aliases: [x, '${nope}']"), "models.m.aliases[1]", "${nope}"),
        # ... and in global settings.
        ("logLevel: '${nope}'\n" + MINIMAL, "logLevel", "${nope}"),
    ],
)
def test_macro_errors(text: str, key: str, fragment: str) -> None:
    error = error_of(text)
    assert error.key == key
    assert fragment in error.message


# --------------------------------------------------------------------------- ${PORT}


def test_ports_go_to_models_using_port_in_sorted_id_order() -> None:
    config = parse(
        """
        startPort: 9000
        macros:
          serve: server --port ${PORT}
        models:
          zeta:
            cmd: server --port ${PORT}
          alpha:
            cmd: ${serve}
          fixed:
            cmd: server --port 8999
            proxy: http://127.0.0.1:8999
          beta:
            cmd: server --port ${PORT}
            proxy: http://gpu-box:${PORT}
        """
    )
    # alpha, beta, zeta sorted (file order is zeta, alpha, fixed, beta); fixed gets none.
    assert {m.id: m.proxy for m in config.models.values()} == {
        "alpha": "http://localhost:9000",
        "beta": "http://gpu-box:9001",
        "fixed": "http://127.0.0.1:8999",
        "zeta": "http://localhost:9002",
    }
    assert config.models["zeta"].cmd == ("server", "--port", "9002")
    # Models keep file order in the mapping.
    assert list(config.models) == ["zeta", "alpha", "fixed", "beta"]


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        # No ${PORT} in cmd and no proxy: the default proxy needs a port nobody listens on.
        ({"cmd": "server --port 8000"}, "models.m.proxy"),
        # An explicit proxy using ${PORT} without cmd using it is the same mistake.
        ({"cmd": "server --port 8000", "proxy": "http://x:${PORT}"}, "models.m.proxy"),
    ],
)
def test_port_in_proxy_needs_port_in_cmd(settings: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"models": {"m": settings}}, environ={})
    assert info.value.key == key
    assert "${PORT}" in info.value.message


# --------------------------------------------------------------------------- aliases


ALIASED = """
models:
  qwen:
    cmd: server --port ${PORT}
    aliases: [gpt-4o-mini, qwen-latest]
  llama:
    cmd: server --port ${PORT}
"""


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("qwen", "qwen"),  # a model id is itself
        ("gpt-4o-mini", "qwen"),  # an alias resolves to its model
        ("qwen-latest", "qwen"),
        ("llama", "llama"),
        ("GPT-4O-MINI", None),  # names are case-sensitive, as in llama-swap
        ("nope", None),
    ],
)
def test_resolve(name: str, expected: str | None) -> None:
    resolved = parse(ALIASED).resolve(name)
    assert (resolved.id if resolved else None) == expected


def test_alias_map() -> None:
    assert parse(ALIASED).aliases == {"gpt-4o-mini": "qwen", "qwen-latest": "qwen"}


# --------------------------------------------------------------------------- errors


def two_models(a: str, b: str) -> str:
    return (
        "models:\n  a:\n    cmd: server ${PORT}\n"
        + textwrap.indent(a, "    ")
        + "\n  b:\n    cmd: server ${PORT}\n"
        + textwrap.indent(b, "    ")
        + "\n"
    )


@pytest.mark.parametrize(
    ("text", "key"),
    [
        # --- the models section
        ("logLevel: info", "models"),  # missing
        ("models: [a, b]", "models"),  # not a mapping
        ("models: {}", "models"),  # nothing to serve
        ("models: {m: }", "models.m"),  # a model without settings
        ("models: {m: {proxy: 'http://x:1'}}", "models.m.cmd"),  # no cmd
        (with_model("cmd: '# only a comment'"), "models.m.cmd"),  # empty once comments go
        (with_model("cmd: run 'unclosed ${PORT}"), "models.m.cmd"),  # unbalanced quote
        (with_model("cmd: [run, x]"), "models.m.cmd"),  # a list, not a string
        # --- values of the wrong type or range
        (with_model("ttl: -5"), "models.m.ttl"),  # -1 inherits; lower is invalid
        (with_model("ttl: '60'"), "models.m.ttl"),  # a string
        (with_model("ttl: 1.5"), "models.m.ttl"),  # not an integer
        (with_model("ttl: true"), "models.m.ttl"),  # booleans are not numbers
        (with_model("unloadTimeout: -1"), "models.m.unloadTimeout"),
        (with_model("concurrencyLimit: -1"), "models.m.concurrencyLimit"),
        (with_model("proxy: 'localhost:${PORT}'"), "models.m.proxy"),  # no scheme
        (with_model("proxy: 'ftp://x:${PORT}'"), "models.m.proxy"),
        (with_model("unlisted: maybe"), "models.m.unlisted"),
        (with_model("metadata: [a]"), "models.m.metadata"),
        (with_model("filters: {setParams: [a]}"), "models.m.filters.setParams"),
        (with_model("filters: {stripParams: [a]}"), "models.m.filters.stripParams"),
        (with_model("checkEndpoint: {path: /x}"), "models.m.checkEndpoint"),
        # --- aliases and env
        (with_model("aliases: gpt"), "models.m.aliases"),  # a string, not a list
        (with_model("aliases: [[x]]"), "models.m.aliases[0]"),
        (with_model("aliases: ['']"), "models.m.aliases[0]"),
        (two_models("aliases: [x]", "aliases: [x]"), "models.b.aliases[0]"),  # used twice
        (two_models("aliases: [b]", ""), "models.a.aliases[0]"),  # shadows a model id
        (two_models("aliases: [x, x]", ""), "models.a.aliases[1]"),  # repeated in one model
        (with_model("env: [A=1, B]"), "models.m.env[1]"),  # no '='
        (with_model("env: ['=x']"), "models.m.env[0]"),  # no name
        (with_model("env: {A: 1}"), "models.m.env"),  # llama-swap's env is a list
        # --- global settings
        (with_model("", "healthCheckTimeout: soon"), "healthCheckTimeout"),
        (with_model("", "startPort: 0"), "startPort"),
        (with_model("", "startPort: 70000"), "startPort"),
        (with_model("", "globalTTL: -1"), "globalTTL"),
        (with_model("", "unloadTimeout: -3"), "unloadTimeout"),
        (with_model("", "logLevel: [info]"), "logLevel"),
        (with_model("", "macros: [a]"), "macros"),
        (with_model("", "hooks: [a]"), "hooks"),
        (with_model("", "hooks: {on_startup: {preload: m}}"), "hooks.on_startup.preload"),
        (
            with_model("", "hooks: {on_startup: {preload: [m, nope]}}"),
            "hooks.on_startup.preload[1]",
        ),
        (with_model("", "routing: [a]"), "routing"),
        (with_model("", "routing: {scheduler: fifo}"), "routing.scheduler"),
    ],
)
def test_errors_name_the_key(text: str, key: str) -> None:
    assert error_of(text).key == key


def test_config_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(["models"], environ={})  # type: ignore[arg-type]
    assert info.value.key == ""


def test_error_message_shows_key_and_value() -> None:
    error = error_of(with_model("ttl: -5"))
    assert str(error) == "models.m.ttl: must be >= 0 (or -1 for globalTTL), got -5"


# --------------------------------------------------------------------------- warnings


@pytest.mark.parametrize(
    ("text", "warning"),
    [
        # Top-level llama-swap settings that only concern its own UI.
        (with_model("", "ui: {}"), "ui: "),
        # Unknown keys inside peers, selectors and profiles.
        (with_model("", "peers: {p: {proxy: 'http://x', models: [a], bogus: 1}}"), "peers.p.bogus: "),
        (with_model("", "profiles: {p: {pins: {a: m}, bogus: 1}}"), "profiles.p.bogus: "),
        (with_model("", "selectors: {s: {strategy: pin, targets: [m], bogus: 1}}"), "selectors.s.bogus: "),
        # A key llama-swap does not know either.
        (with_model("", "frobnicate: 1"), "frobnicate: unknown key"),
        # Per model: known to llama-swap but not implemented, or unknown.
        (with_model("capabilities: {tools: true, video: 1}"), "models.m.capabilities.video: "),
        (with_model("", "upstream: {ignorePaths: [x], extra: 1}"), "upstream.extra: unknown key"),
        (with_model("", "logTimeFormat: iso"), "logTimeFormat: unknown format 'iso'"),
        (with_model("frobnicate: 1"), "models.m.frobnicate: unknown model key"),
        (with_model("filters: {bogus: 1}"), "models.m.filters.bogus: unknown filter"),
        # Routing: unknown keys, and the router section use does not name.
        (with_model("", "routing: {router: {use: group, bogus: 1}}"), "routing.router.bogus: "),
        (
            with_model("", "routing: {router: {use: group, settings: {matrix: {sets: {s: m}}}}}"),
            "routing.router.settings.matrix: not used",
        ),
        (
            with_model("", "routing: {scheduler: {settings: {serial: {bogus: 1}}}}"),
            "routing.scheduler.settings.serial.bogus: unknown key",
        ),
        (with_model("", "hooks: {on_shutdown: {}}"), "hooks.on_shutdown: "),
        # Adjusted values say so.
        (with_model("", "healthCheckTimeout: 5"), "healthCheckTimeout: 5 is below the minimum"),
        (with_model("", "logLevel: loud"), "logLevel: unknown level"),
    ],
)
def test_unsupported_keys_warn_once(text: str, warning: str) -> None:
    config = parse(text, {})
    assert len(config.warnings) == 1, config.warnings
    assert config.warnings[0].startswith(warning)
    assert "m" in config.models  # and the config still loads


def test_ignored_sections_are_not_expanded() -> None:
    # An env var only an ignored section uses need not be set: it is ignored whole.
    config = parse(with_model("", "ui: {activity: {session_id: ['${env.NOPE_X}']}}"), {})
    assert config.warnings[0].startswith("ui: ")


# --------------------------------------------------------------------------- API keys


@pytest.mark.parametrize(
    ("top", "environ", "expected"),
    [
        # None, null or an empty list: no keys, requests need none.
        ("", {}, {}),
        ("apiKeys:", {}, {}),
        ("apiKeys: []", {}, {}),
        # llama-swap's plain strings, named by position.
        ("apiKeys: [sk-a, sk-b]", {}, {"sk-a": ApiKey("key-1"), "sk-b": ApiKey("key-2")}),
        # A YAML number is a key too (llama-swap decodes into strings).
        ("apiKeys: [12345]", {}, {"12345": ApiKey("key-1")}),
        # Mappings: name, key, priority rule; everything but the key optional.
        (
            "apiKeys: [{name: farm, key: sk-f, priority: {default: batch, ceiling: normal}}]",
            {},
            {"sk-f": ApiKey("farm", KeyPolicy(default=-100, ceiling=0))},
        ),
        (
            "apiKeys: [{key: sk-f, priority: {default: 5, ceiling: 50, offset: -3}}]",
            {},
            {"sk-f": ApiKey("key-1", KeyPolicy(default=5, ceiling=50, offset=-3))},
        ),
        (
            "apiKeys: [{key: sk-f, priority: {ceiling: INTERACTIVE, default: '+7'}}]",
            {},
            {"sk-f": ApiKey("key-1", KeyPolicy(default=7, ceiling=100))},
        ),
        (
            "apiKeys: [{key: sk-f, priority: {offset: 2}}]",
            {},
            {"sk-f": ApiKey("key-1", KeyPolicy(offset=2))},
        ),
        ("apiKeys: [{key: sk-f, priority: }]", {}, {"sk-f": ApiKey("key-1")}),
        ("apiKeys: [{name: ' pro ', key: sk-p}]", {}, {"sk-p": ApiKey("pro")}),
        # Plain and mapped entries mixed: positions count across both.
        (
            "apiKeys: [sk-a, {name: b, key: sk-b}, sk-c]",
            {},
            {"sk-a": ApiKey("key-1"), "sk-b": ApiKey("b"), "sk-c": ApiKey("key-3")},
        ),
        # ${env.NAME} and macros expand in keys and names, as elsewhere.
        ("apiKeys: ['${env.K}']", {"K": "sk-env"}, {"sk-env": ApiKey("key-1")}),
        ("apiKeys: ['sk-${env.K}-x']", {"K": "mid"}, {"sk-mid-x": ApiKey("key-1")}),
        ("apiKeys: [{key: '${env.K}'}]", {"K": "42"}, {"42": ApiKey("key-1")}),
        (
            "macros: {p: sk-pre}\napiKeys: ['${p}-1', {name: '${p}', key: '${p}-2'}]",
            {},
            {"sk-pre-1": ApiKey("key-1"), "sk-pre-2": ApiKey("sk-pre")},
        ),
    ],
)
def test_api_keys(top: str, environ: dict[str, str], expected: dict[str, ApiKey]) -> None:
    config = parse(with_model("", top), environ)
    assert dict(config.api_keys) == expected
    assert all(k.source == "config" for k in config.api_keys.values())
    assert config.warnings == ()  # apiKeys is read now, not ignored


@pytest.mark.parametrize(
    ("top", "environ", "key", "fragment"),
    [
        ("apiKeys: sk-a", {}, "apiKeys", "must be a list"),
        ("apiKeys: {a: sk-a}", {}, "apiKeys", "must be a list"),
        ("apiKeys: ['']", {}, "apiKeys[0]", "must not be empty"),
        ("apiKeys: [sk-a, null]", {}, "apiKeys[1]", "must not be empty"),
        ("apiKeys: [sk-a, 'sk b']", {}, "apiKeys[1]", "whitespace"),
        ('apiKeys: ["sk-a\\t"]', {}, "apiKeys[0]", "whitespace"),
        ("apiKeys: [' sk-a']", {}, "apiKeys[0]", "whitespace"),
        ("apiKeys: [true]", {}, "apiKeys[0]", "must be a key or a mapping"),
        ("apiKeys: [[sk-a]]", {}, "apiKeys[0]", "must be a key or a mapping"),
        ("apiKeys: [sk-a, sk-a]", {}, "apiKeys[1]", "duplicate key"),
        ("apiKeys: [sk-a, {name: b, key: sk-a}]", {}, "apiKeys[1].key", "duplicate key"),
        (
            "apiKeys: [{name: b, key: sk-a}, {name: b, key: sk-b}]",
            {},
            "apiKeys[1].name",
            "duplicate name",
        ),
        ("apiKeys: [sk-a, {name: key-1, key: sk-b}]", {}, "apiKeys[1].name", "duplicate name"),
        ("apiKeys: [{name: b}]", {}, "apiKeys[0].key", "required"),
        ("apiKeys: [{name: b, key: ''}]", {}, "apiKeys[0].key", "must not be empty"),
        ("apiKeys: [{name: b, key: 'a b'}]", {}, "apiKeys[0].key", "whitespace"),
        ("apiKeys: [{name: b, key: [x]}]", {}, "apiKeys[0].key", "must be a string"),
        ("apiKeys: [{name: '  ', key: sk-a}]", {}, "apiKeys[0].name", "must not be empty"),
        ("apiKeys: [{name: [x], key: sk-a}]", {}, "apiKeys[0].name", "must be a string"),
        ("apiKeys: [{key: sk-a, tier: pro}]", {}, "apiKeys[0].tier", "unknown field"),
        ("apiKeys: [{key: sk-a, priority: 5}]", {}, "apiKeys[0].priority", "must be a mapping"),
        (
            "apiKeys: [{key: sk-a, priority: {max: 5}}]",
            {},
            "apiKeys[0].priority.max",
            "unknown field",
        ),
        (
            "apiKeys: [{key: sk-a, priority: {default: urgent}}]",
            {},
            "apiKeys[0].priority.default",
            "interactive, normal or batch",
        ),
        (
            "apiKeys: [{key: sk-a, priority: {ceiling: 1.5}}]",
            {},
            "apiKeys[0].priority.ceiling",
            "integer priority",
        ),
        (
            "apiKeys: [{key: sk-a, priority: {ceiling: true}}]",
            {},
            "apiKeys[0].priority.ceiling",
            "integer priority",
        ),
        (
            "apiKeys: [{key: sk-a, priority: {default: 99999999999999999999}}]",
            {},
            "apiKeys[0].priority.default",
            "integer priority",
        ),
        (
            "apiKeys: [{key: sk-a, priority: {offset: batch}}]",
            {},
            "apiKeys[0].priority.offset",
            "must be an integer",
        ),
        (
            "apiKeys: [{key: sk-a, priority: {default: interactive, ceiling: normal}}]",
            {},
            "apiKeys[0].priority.default",
            "above the ceiling",
        ),
        # Expansion problems name the key's path, as anywhere else.
        ("apiKeys: ['${env.NOPE}']", {}, "apiKeys[0]", "'NOPE' is not set"),
        ("apiKeys: [{key: '${env.NOPE}'}]", {}, "apiKeys[0].key", "'NOPE' is not set"),
        ("apiKeys: ['sk-${nope}']", {}, "apiKeys[0]", "unknown macro"),
        ("apiKeys: ['${env.K}']", {"K": "a b"}, "apiKeys[0]", "whitespace"),
    ],
)
def test_api_key_errors(top: str, environ: dict[str, str], key: str, fragment: str) -> None:
    error = error_of(with_model("", top), environ)
    assert error.key == key, error
    assert fragment in error.message, error


# --------------------------------------------------------------------------- scheduler


SCHEDULED = """
models:
  qwen:
    cmd: server --port ${PORT}
    aliases: [gpt-4o-mini]
  llama:
    cmd: server --port ${PORT}
routing:
  scheduler:
"""


@pytest.mark.parametrize(
    ("scheduler", "expected"),
    [
        # Nothing set: serial with the spec's defaults.
        ("", SchedulerSettings()),
        # fifo with per-model priorities, as in llama-swap.
        (
            "use: fifo\nsettings: {fifo: {priority: {qwen: 10, llama: -5}}}",
            SchedulerSettings.create(use="fifo", fifo_priority={"qwen": 10, "llama": -5}),
        ),
        # An alias in fifo.priority is stored under its model id (requests resolve to ids).
        (
            "use: fifo\nsettings: {fifo: {priority: {gpt-4o-mini: 3}}}",
            SchedulerSettings.create(use="fifo", fifo_priority={"qwen": 3}),
        ),
        # agingDivisor 0 disables aging; swapAffinityBonus 0 gives strict priority order.
        (
            "use: serial\nsettings: {serial: {agingDivisor: 0, swapAffinityBonus: 0}}",
            SchedulerSettings.create(aging_divisor=0, swap_affinity_bonus=0),
        ),
        # agingDivisor may be fractional.
        ("settings: {serial: {agingDivisor: 30.5}}", SchedulerSettings.create(aging_divisor=30.5)),
        # Unset keys (null) take their defaults.
        ("use:\nsettings: {serial: {agingDivisor: }}", SchedulerSettings()),
    ],
)
def test_scheduler_settings(scheduler: str, expected: SchedulerSettings) -> None:
    text = SCHEDULED + textwrap.indent(scheduler, "    ")
    assert parse(text).scheduler == expected


@pytest.mark.parametrize(
    ("scheduler", "key"),
    [
        ("use: lifo", KEY_USE),  # only serial and fifo exist
        ("use: 1", KEY_USE),
        ("settings: {serial: {agingDivisor: -1}}", KEY_AGING),  # aging never runs backwards
        ("settings: {serial: {agingDivisor: soon}}", KEY_AGING),
        ("settings: {serial: {swapAffinityBonus: 100}}", KEY_BONUS),  # must stay below a band
        ("settings: {serial: {swapAffinityBonus: 1.5}}", KEY_BONUS),
        ("settings: {fifo: {priority: [qwen]}}", KEY_FIFO),
        ("settings: {fifo: {priority: {qwen: high}}}", f"{KEY_FIFO}.qwen"),
        ("settings: {fifo: {priority: {nope: 1}}}", f"{KEY_FIFO}.nope"),  # unknown model
        # The same model twice (by id and by alias) is ambiguous.
        ("settings: {fifo: {priority: {qwen: 1, gpt-4o-mini: 2}}}", f"{KEY_FIFO}.gpt-4o-mini"),
        ("settings: {serial: 60}", "routing.scheduler.settings.serial"),
        ("settings: [serial]", "routing.scheduler.settings"),
    ],
)
def test_scheduler_errors(scheduler: str, key: str) -> None:
    text = SCHEDULED + textwrap.indent(scheduler, "    ")
    assert error_of(text).key == key


# --------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize(
    ("field_name", "expected"),
    [
        # llama-swap's reverse-proxy transport defaults, in seconds ...
        ("connect", 30),
        ("keepalive", 30),
        ("response_header", 0),  # no limit
        ("tls_handshake", 10),
        ("expect_continue", 1),
        ("idle_conn", 90),
        # ... and ours: silence from the model during a request before it is checked.
        ("idle", 300),
    ],
)
def test_model_timeout_defaults(field_name: str, expected: float) -> None:
    assert getattr(ModelTimeouts(), field_name) == expected
    assert getattr(model(MINIMAL).timeouts, field_name) == expected


@pytest.mark.parametrize(
    ("timeouts", "top", "expected"),
    [
        ("{}", "", ModelTimeouts()),
        ("", "", ModelTimeouts()),  # `timeouts:` with no value
        ("{connect: 5}", "", ModelTimeouts(connect=5)),  # the others keep their defaults
        ("{keepalive: 0}", "", ModelTimeouts(keepalive=0)),  # 0 disables one
        ("{responseHeader: 120}", "", ModelTimeouts(response_header=120)),
        ("{tlsHandshake: 2.5}", "", ModelTimeouts(tls_handshake=2.5)),  # fractions allowed
        ("{expectContinue: 0}", "", ModelTimeouts(expect_continue=0)),
        ("{idleConn: 15}", "", ModelTimeouts(idle_conn=15)),
        ("{idle: 0}", "", ModelTimeouts(idle=0)),
        ("{idle: 45}", "", ModelTimeouts(idle=45)),
        ("{connect: }", "", ModelTimeouts()),  # null is unset
        # A whole-value macro keeps its number type.
        ("{idle: '${slow}'}", "macros: {slow: 900}", ModelTimeouts(idle=900)),
        (
            "{connect: 1, keepalive: 2, responseHeader: 3, tlsHandshake: 4, expectContinue: 5, "
            "idleConn: 6, idle: 7}",
            "",
            ModelTimeouts(1, 2, 3, 4, 5, 6, 7),
        ),
    ],
)
def test_model_timeouts(timeouts: str, top: str, expected: ModelTimeouts) -> None:
    config = parse(with_model(f"timeouts: {timeouts}", top))
    assert config.models["m"].timeouts == expected
    assert config.warnings == ()


def test_model_timeouts_are_per_model() -> None:
    text = two_models("timeouts: {idle: 10}", "")
    config = parse(text)
    assert config.models["a"].timeouts.idle == 10
    assert config.models["b"].timeouts == ModelTimeouts()


@pytest.mark.parametrize(
    ("timeouts", "key"),
    [
        ("[5]", "models.m.timeouts"),  # not a mapping
        ("30", "models.m.timeouts"),
        ("{connect: -1}", "models.m.timeouts.connect"),
        ("{keepalive: soon}", "models.m.timeouts.keepalive"),
        ("{responseHeader: '60'}", "models.m.timeouts.responseHeader"),  # a string
        ("{tlsHandshake: true}", "models.m.timeouts.tlsHandshake"),  # not a number
        ("{expectContinue: .inf}", "models.m.timeouts.expectContinue"),  # not finite
        ("{idleConn: .nan}", "models.m.timeouts.idleConn"),
        ("{idle: -0.5}", "models.m.timeouts.idle"),
        ("{idle: [1]}", "models.m.timeouts.idle"),
        ("{connect: 30s}", "models.m.timeouts.connect"),  # seconds, not Go durations
    ],
)
def test_model_timeout_errors(timeouts: str, key: str) -> None:
    assert error_of(with_model(f"timeouts: {timeouts}")).key == key


@pytest.mark.parametrize(
    ("text", "warnings"),
    [
        (with_model("timeouts: {connect: 5, dial: 3}"), ["models.m.timeouts.dial: unknown key"]),
        (
            with_model("timeouts: {idle_conn: 5, Idle: 3}"),  # spelled llama-swap's way only
            ["models.m.timeouts.idle_conn: unknown key", "models.m.timeouts.Idle: unknown key"],
        ),
        # llama-swap has no global timeouts section.
        (with_model("", "timeouts: {connect: 5}"), ["timeouts: unknown key"]),
    ],
)
def test_timeout_warnings(text: str, warnings: list[str]) -> None:
    config = parse(text)
    assert len(config.warnings) == len(warnings), config.warnings
    for warning, prefix in zip(config.warnings, warnings, strict=True):
        assert warning.startswith(prefix)
        assert warning.endswith("; ignored")


def test_unknown_timeout_keys_do_not_change_the_known_ones() -> None:
    assert model(with_model("timeouts: {connect: 5, dial: 3}")).timeouts == ModelTimeouts(connect=5)


# --------------------------------------------------------------------------- limits


@pytest.mark.parametrize(
    ("field_name", "expected"),
    [
        ("max_body_bytes", 256 * 1024 * 1024),
        ("header_timeout", 30),
        ("body_timeout", 300),
        ("body_idle_timeout", 60),
    ],
)
def test_limit_defaults(field_name: str, expected: float) -> None:
    assert getattr(RequestLimits(), field_name) == expected
    assert getattr(parse(MINIMAL).limits, field_name) == expected


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ("", RequestLimits()),  # `limits:` with no value
        ("{}", RequestLimits()),
        ("{maxBodyBytes: 1}", RequestLimits(max_body_bytes=1)),
        ("{maxBodyBytes: 1048576}", RequestLimits(max_body_bytes=1024 * 1024)),
        ("{headerTimeout: 5}", RequestLimits(header_timeout=5)),
        ("{headerTimeout: 0}", RequestLimits(header_timeout=0)),  # 0 disables one
        ("{bodyTimeout: 0.5}", RequestLimits(body_timeout=0.5)),
        ("{bodyTimeout: 0}", RequestLimits(body_timeout=0)),
        ("{bodyIdleTimeout: 10}", RequestLimits(body_idle_timeout=10)),
        ("{bodyIdleTimeout: 0}", RequestLimits(body_idle_timeout=0)),
        ("{maxBodyBytes: , headerTimeout: }", RequestLimits()),  # null is unset
        (
            "{maxBodyBytes: 100, headerTimeout: 1, bodyTimeout: 2, bodyIdleTimeout: 3}",
            RequestLimits(100, 1, 2, 3),
        ),
    ],
)
def test_limits(limits: str, expected: RequestLimits) -> None:
    config = parse(with_model("", f"limits: {limits}"))
    assert config.limits == expected
    assert config.warnings == ()


def test_limits_expand_env_and_macros() -> None:
    top = "macros: {mb: 1000}\nlimits: {maxBodyBytes: '${mb}', bodyTimeout: '${env.BODY}'}"
    limits = parse(with_model("", top), {"BODY": "90"}).limits
    assert limits == RequestLimits(max_body_bytes=1000, body_timeout=90)


@pytest.mark.parametrize(
    ("limits", "key"),
    [
        ("[1]", "limits"),
        ("100", "limits"),
        ("{maxBodyBytes: 0}", "limits.maxBodyBytes"),  # at least one byte
        ("{maxBodyBytes: -1}", "limits.maxBodyBytes"),
        ("{maxBodyBytes: 1.5}", "limits.maxBodyBytes"),  # whole bytes
        ("{maxBodyBytes: 10MB}", "limits.maxBodyBytes"),
        ("{maxBodyBytes: true}", "limits.maxBodyBytes"),
        ("{headerTimeout: -1}", "limits.headerTimeout"),
        ("{headerTimeout: soon}", "limits.headerTimeout"),
        ("{bodyTimeout: .inf}", "limits.bodyTimeout"),
        ("{bodyTimeout: false}", "limits.bodyTimeout"),
        ("{bodyIdleTimeout: -0.1}", "limits.bodyIdleTimeout"),
        ("{bodyIdleTimeout: '60'}", "limits.bodyIdleTimeout"),
    ],
)
def test_limit_errors(limits: str, key: str) -> None:
    assert error_of(with_model("", f"limits: {limits}")).key == key


def test_unknown_limit_keys_warn() -> None:
    config = parse(with_model("", "limits: {maxBodyBytes: 10, maxHeaderBytes: 5}"))
    assert config.warnings == ("limits.maxHeaderBytes: unknown key; ignored",)
    assert config.limits == RequestLimits(max_body_bytes=10)


# --------------------------------------------------------------------------- queue bounds


def bounds_of(scheduler: str) -> QueueBounds:
    return parse(SCHEDULED + textwrap.indent(scheduler, "    ")).bounds


@pytest.mark.parametrize(
    ("scheduler", "expected"),
    [
        # Nothing set: unbounded.
        ("", QueueBounds()),
        ("settings: {serial: {}}", QueueBounds()),
        ("settings: {serial: {maxQueueDepth: 1}}", QueueBounds(max_queue_depth=1)),
        ("settings: {serial: {maxQueueDepth: 500}}", QueueBounds(max_queue_depth=500)),
        ("settings: {serial: {maxQueueDepth: }}", QueueBounds()),  # null is unset
        ("settings: {serial: {maxWait: {}}}", QueueBounds()),
        ("settings: {serial: {maxWait: }}", QueueBounds()),
        # One band bounded, the others unbounded.
        ("settings: {serial: {maxWait: {batch: 600}}}", QueueBounds(max_wait={"batch": 600})),
        (
            "settings: {serial: {maxWait: {interactive: 0.5, normal: 30, batch: 3600}}}",
            QueueBounds(max_wait={"interactive": 0.5, "normal": 30, "batch": 3600}),
        ),
        ("settings: {serial: {maxWait: {normal: }}}", QueueBounds()),  # null is unset
        # The fifo section takes the same keys.
        (
            "use: fifo\nsettings: {fifo: {maxQueueDepth: 8, maxWait: {normal: 20}}}",
            QueueBounds(max_queue_depth=8, max_wait={"normal": 20}),
        ),
        # A section not in use still supplies what the one in use leaves out ...
        ("settings: {fifo: {maxQueueDepth: 8}}", QueueBounds(max_queue_depth=8)),
        ("use: fifo\nsettings: {serial: {maxQueueDepth: 8}}", QueueBounds(max_queue_depth=8)),
        # ... but when both set a key, the section named by `use` wins (serial by default).
        (
            "settings: {serial: {maxQueueDepth: 4}, fifo: {maxQueueDepth: 8}}",
            QueueBounds(max_queue_depth=4),
        ),
        (
            "use: serial\nsettings: {serial: {maxQueueDepth: 4}, fifo: {maxQueueDepth: 8}}",
            QueueBounds(max_queue_depth=4),
        ),
        (
            "use: fifo\nsettings: {serial: {maxQueueDepth: 4}, fifo: {maxQueueDepth: 8}}",
            QueueBounds(max_queue_depth=8),
        ),
        # A null in the section in use is unset, so the other section's value stands.
        (
            "settings: {serial: {maxQueueDepth: }, fifo: {maxQueueDepth: 8}}",
            QueueBounds(max_queue_depth=8),
        ),
        # maxWait is merged band by band; for a band both set, `use` wins.
        (
            "use: fifo\nsettings: {serial: {maxWait: {normal: 10, batch: 100}}, "
            "fifo: {maxWait: {normal: 20, interactive: 2}}}",
            QueueBounds(max_wait={"interactive": 2, "normal": 20, "batch": 100}),
        ),
        (
            "settings: {serial: {maxWait: {normal: 10, batch: 100}}, "
            "fifo: {maxWait: {normal: 20, interactive: 2}}}",
            QueueBounds(max_wait={"interactive": 2, "normal": 10, "batch": 100}),
        ),
        # The bounds sit next to the policy's own settings.
        (
            "settings: {serial: {agingDivisor: 30, maxQueueDepth: 2}, "
            "fifo: {priority: {qwen: 1}, maxWait: {batch: 5}}}",
            QueueBounds(max_queue_depth=2, max_wait={"batch": 5}),
        ),
    ],
)
def test_queue_bounds(scheduler: str, expected: QueueBounds) -> None:
    text = SCHEDULED + textwrap.indent(scheduler, "    ")
    config = parse(text)
    assert config.bounds == expected
    assert config.warnings == ()


def test_queue_bounds_max_wait_is_read_only_and_keyed_by_band_value() -> None:
    bounds = bounds_of("settings: {serial: {maxWait: {batch: 60, interactive: 1}}}")
    assert list(bounds.max_wait) == ["interactive", "batch"]  # band order
    assert all(type(band) is str for band in bounds.max_wait)
    with pytest.raises(TypeError):
        bounds.max_wait["normal"] = 5  # type: ignore[index]
    assert QueueBounds().max_wait == {}


SERIAL_KEY = "routing.scheduler.settings.serial"
FIFO_KEY = "routing.scheduler.settings.fifo"


@pytest.mark.parametrize(
    ("scheduler", "key"),
    [
        ("settings: {serial: {maxQueueDepth: 0}}", f"{SERIAL_KEY}.maxQueueDepth"),
        ("settings: {serial: {maxQueueDepth: -1}}", f"{SERIAL_KEY}.maxQueueDepth"),
        ("settings: {serial: {maxQueueDepth: 2.5}}", f"{SERIAL_KEY}.maxQueueDepth"),
        ("settings: {serial: {maxQueueDepth: many}}", f"{SERIAL_KEY}.maxQueueDepth"),
        ("settings: {serial: {maxQueueDepth: true}}", f"{SERIAL_KEY}.maxQueueDepth"),
        ("settings: {fifo: {maxQueueDepth: 0}}", f"{FIFO_KEY}.maxQueueDepth"),
        ("settings: {serial: {maxWait: 60}}", f"{SERIAL_KEY}.maxWait"),  # per band
        ("settings: {serial: {maxWait: [60]}}", f"{SERIAL_KEY}.maxWait"),
        ("settings: {serial: {maxWait: {urgent: 5}}}", f"{SERIAL_KEY}.maxWait.urgent"),
        ("settings: {serial: {maxWait: {Normal: 5}}}", f"{SERIAL_KEY}.maxWait.Normal"),
        ("settings: {serial: {maxWait: {100: 5}}}", f"{SERIAL_KEY}.maxWait.100"),  # no numbers
        ("settings: {serial: {maxWait: {normal: 0}}}", f"{SERIAL_KEY}.maxWait.normal"),
        ("settings: {serial: {maxWait: {normal: -5}}}", f"{SERIAL_KEY}.maxWait.normal"),
        ("settings: {serial: {maxWait: {batch: .inf}}}", f"{SERIAL_KEY}.maxWait.batch"),
        ("settings: {serial: {maxWait: {batch: 1h}}}", f"{SERIAL_KEY}.maxWait.batch"),
        ("settings: {fifo: {maxWait: {urgent: 5}}}", f"{FIFO_KEY}.maxWait.urgent"),
        ("settings: {fifo: {maxWait: {interactive: 0}}}", f"{FIFO_KEY}.maxWait.interactive"),
        # The section not in use is checked too, even where the one in use overrides it.
        (
            "settings: {serial: {maxQueueDepth: 4}, fifo: {maxQueueDepth: 0}}",
            f"{FIFO_KEY}.maxQueueDepth",
        ),
        (
            "use: fifo\nsettings: {serial: {maxWait: {normal: -1}}, fifo: {maxWait: {normal: 1}}}",
            f"{SERIAL_KEY}.maxWait.normal",
        ),
    ],
)
def test_queue_bound_errors(scheduler: str, key: str) -> None:
    text = SCHEDULED + textwrap.indent(scheduler, "    ")
    assert error_of(text).key == key


def test_queue_bound_error_message() -> None:
    error = error_of(SCHEDULED + "    settings: {serial: {maxWait: {urgent: 5}}}\n")
    assert str(error) == (
        f"{SERIAL_KEY}.maxWait.urgent: unknown band 'urgent' "
        "(use one of interactive, normal, batch)"
    )


@pytest.mark.parametrize(
    ("scheduler", "warnings"),
    [
        ("settings: {serial: {maxQueueLength: 5}}", [f"{SERIAL_KEY}.maxQueueLength"]),
        ("settings: {fifo: {maxwait: {normal: 5}}}", [f"{FIFO_KEY}.maxwait"]),
        (
            "settings: {serial: {maxQueueDepth: 1, x: 1}, fifo: {maxQueueDepth: 1, y: 1}}",
            [f"{SERIAL_KEY}.x", f"{FIFO_KEY}.y"],
        ),
    ],
)
def test_unknown_bound_keys_warn(scheduler: str, warnings: list[str]) -> None:
    config = parse(SCHEDULED + textwrap.indent(scheduler, "    "))
    assert config.warnings == tuple(f"{key}: unknown key; ignored" for key in warnings)


# --------------------------------------------------------------------------- hooks


def test_preload_resolves_aliases_and_drops_blanks_and_repeats() -> None:
    text = ALIASED + "hooks:\n  on_startup:\n    preload: [gpt-4o-mini, ' ', llama, qwen]\n"
    assert parse(text).preload == ("qwen", "llama")


# --------------------------------------------------------------------------- files


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    config = load_config(path)
    assert config.source == str(path)
    assert config.models["m"].cmd == ("server", "--port", "5800")


def test_load_config_expands_env_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLAMASWAP_TEST_BIN", "/opt/bin/server")
    path = write(tmp_path, "models: {m: {cmd: '${env.LLAMASWAP_TEST_BIN} ${PORT}'}}")
    assert load_config(path).models["m"].cmd == ("/opt/bin/server", "5800")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        # A syntax error names the line.
        ("models:\n  m:\n    cmd: [unclosed\n", "line 4"),
        ("models:\n  m:\n cmd: x\n  bad: : :\n", "line 3"),
        # A key defined twice (a duplicated model id) is an error, not a silent override.
        ("models:\n  m: {cmd: a}\n  m: {cmd: b}\n", "'m' is defined twice (first on line 2)"),
    ],
)
def test_yaml_errors_name_the_file_and_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == str(path)
    assert fragment in info.value.message


def test_yaml_merge_keys_may_override(tmp_path: Path) -> None:
    # Anchors and `<<:` are common in llama-swap configs; an override is not a duplicate.
    path = write(
        tmp_path,
        """
        x-base: &base
          cmd: server --port ${PORT}
          ttl: 60
        models:
          m:
            <<: *base
            ttl: 5
        """,
    )
    config = load_config(path)
    assert config.models["m"].ttl == 5
    assert config.warnings == ("x-base: unknown key; ignored",)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == str(path)
    assert "not found" in info.value.message


def test_empty_file_has_no_models(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, "# nothing yet\n"))
    assert info.value.key == "models"


# Reduced from llama-swap's own config.example.yaml: unsupported sections and all.
LLAMA_SWAP_EXAMPLE = """
healthCheckTimeout: 500
logLevel: info
logToStdout: "proxy"
metricsMaxInMemory: 1000
startPort: 10001
sendLoadingState: true
globalTTL: 0
macros:
  "latest-llama": >
    /path/to/llama-server/llama-server-ec9e0301 --port ${PORT}
  "default_ctx": 4096
  "default_args": "--ctx-size ${default_ctx}"
  "models_dir": "${env.HOME}/models"
apiKeys:
  - "sk-hunter2"
models:
  "gpt-oss-120b":
    macros:
      "default_ctx": 16384
      "temp": 0.7
    cmd: |
      # ${latest-llama} is a macro that is defined above
      ${latest-llama}
      --model ${models_dir}/gpt-oss-120B.gguf
      --ctx-size ${default_ctx}
      --temperature ${temp}
    name: "gpt-oss 120B"
    description: "A thinking model from OpenAI"
    env:
      - "CUDA_VISIBLE_DEVICES=0,1,2"
    proxy: http://127.0.0.1:8999
    checkEndpoint: /custom-endpoint
    ttl: 60
    unloadTimeout: 10
    useModelName: "openai/gpt-oss-120B"
    filters:
      stripParams: "temperature, top_p, top_k"
      setParams:
        temperature: 0.7
        top_p: 0.9
    aliases:
      - "gpt-4o-mini"
    metadata:
      port: ${PORT}
      temperature: ${temp}
      note: "The ${MODEL_ID} is running on port ${PORT}"
    concurrencyLimit: 0
    timeouts:
      connect: 30
  "unlisted-model":
    unlisted: true
    cmd: some-upstream-server --port ${PORT}
  "docker-llama":
    proxy: "http://127.0.0.1:${PORT}"
    cmd: |
      docker run --name ${MODEL_ID}
      --init --rm -p ${PORT}:8080 -v /mnt/nvme/models:/models
      ghcr.io/ggml-org/llama.cpp:server
      --model '/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf'
    cmdStop: docker stop ${MODEL_ID}
hooks:
  on_startup:
    preload:
      - "docker-llama"
routing:
  router:
    use: group
    settings:
      groups:
        "group1":
          swap: true
          members: ["docker-llama", "unlisted-model"]
  scheduler:
    use: fifo
    settings:
      fifo:
        priority:
          gpt-4o-mini: 10
          docker-llama: 5
peers:
  openrouter:
    proxy: https://openrouter.ai/api
    apiKey: ${env.OPENROUTER_API_KEY}
    models: [z-ai/glm-4.7]
"""


def test_realistic_llama_swap_config_loads() -> None:
    config = parse(LLAMA_SWAP_EXAMPLE, {"HOME": "/home/u", "OPENROUTER_API_KEY": "sk-or"})
    gpt = config.models["gpt-oss-120b"]
    # Ports by sorted id: docker-llama, gpt-oss-120b (its cmd uses ${PORT} via a macro),
    # unlisted-model.
    assert config.models["docker-llama"].proxy == "http://127.0.0.1:10001"
    assert gpt.cmd == (
        "/path/to/llama-server/llama-server-ec9e0301",
        "--port",
        "10002",
        "--model",
        "/home/u/models/gpt-oss-120B.gguf",
        "--ctx-size",
        "16384",  # the model macro wins over the global one
        "--temperature",
        "0.7",
    )
    assert gpt.proxy == "http://127.0.0.1:8999"  # a fixed proxy stays fixed
    assert config.models["unlisted-model"].proxy == "http://localhost:10003"
    assert config.models["docker-llama"].cmd_stop == ("docker", "stop", "docker-llama")
    assert gpt.metadata == {
        "port": 10002,
        "temperature": 0.7,
        "note": "The gpt-oss-120b is running on port 10002",
    }
    assert gpt.env == {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    assert gpt.strip_params == ("temperature", "top_k", "top_p")
    assert gpt.health_check_timeout == 500
    assert config.resolve("gpt-4o-mini") is gpt
    assert config.preload == ("docker-llama",)
    assert config.scheduler.use is Policy.FIFO
    assert config.scheduler.fifo_priority == {"gpt-oss-120b": 10, "docker-llama": 5}
    assert [w.split(":")[0] for w in config.warnings] == ["metricsMaxInMemory"]
    assert all(m.send_loading_state for m in config.models.values())
    assert config.peer_routes["z-ai/glm-4.7"].peer.api_key == "sk-or"
    assert [(g.name, g.members) for g in config.router.groups] == [
        ("group1", ("docker-llama", "unlisted-model")),
        ("(default)", ("gpt-oss-120b",)),
    ]
    assert gpt.timeouts == ModelTimeouts(connect=30)
    assert config.api_keys == {"sk-hunter2": ApiKey("key-1")}


# --------------------------------------------------------------------------- config.example.yaml


def test_example_config_loads_cleanly() -> None:
    config = load_config(REPO / "config.example.yaml")
    assert config.warnings == ()
    assert set(config.models) == {"qwen3", "llama3", "embed"}
    assert config.resolve("gpt-4o-mini") is config.models["qwen3"]
    ports = set()
    for m in config.models.values():
        # Runs the bundled simulated server from the repo root, each on its own port.
        assert m.cmd[:3] == (".venv/bin/python", "-m", "fakellm")
        port = m.cmd[m.cmd.index("--port") + 1]
        assert m.proxy == f"http://127.0.0.1:{port}"
        ports.add(port)
    assert len(ports) == 3


def test_example_config_commented_scheduler_section_is_true() -> None:
    # Uncommenting the routing section must give the defaults it claims (plus priorities).
    text = (REPO / "config.example.yaml").read_text(encoding="utf-8")
    commented = text[text.index("# routing:") :]
    routing = "\n".join(line[2:] for line in commented.splitlines() if line.startswith("# "))
    data = yaml.safe_load((REPO / "config.example.yaml").read_text(encoding="utf-8"))
    data.update(yaml.safe_load(routing))
    scheduler = parse_config(data, environ={}).scheduler
    assert scheduler.use is Policy.SERIAL
    assert (scheduler.aging_divisor, scheduler.swap_affinity_bonus) == (60, 10)
    assert scheduler.fifo_priority == {"qwen3": 10, "embed": 5}
    assert scheduler.start_failure_cooldown == 5


# --------------------------------------------------------------------------- system checks


BAD_TTL = "models:\n  qwen:\n    cmd: server ${PORT}\n    ttl: -5\n"
WITH_WARNINGS = "ui: {}\nlogRequests: true\n" + MINIMAL


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # A valid config says nothing.
        (MINIMAL, []),
        # An error: one E001 naming the key path.
        (
            BAD_TTL,
            [("llamaswap.E001", "models.qwen.ttl: must be >= 0 (or -1 for globalTTL), got -5")],
        ),
        # A file-level error: the message carries the line.
        ("models: [\n", [("llamaswap.E001", "YAML syntax error at line 2")]),
        # One W001 per ignored key.
        (WITH_WARNINGS, [("llamaswap.W001", "ui: "), ("llamaswap.W001", "logRequests: ")]),
    ],
)
def test_check_config(
    settings: Any, tmp_path: Path, text: str, expected: list[tuple[str, str]]
) -> None:
    settings.LLAMASWAP_CONFIG = str(write(tmp_path, text))
    messages = checks.check_config()
    assert [m.id for m in messages] == [check_id for check_id, _ in expected]
    for message, (_, prefix) in zip(messages, expected, strict=True):
        assert message.msg.startswith(prefix)
    for message in messages:
        assert message.hint
        assert message.obj == settings.LLAMASWAP_CONFIG


def test_check_config_without_a_config_is_silent(settings: Any) -> None:
    settings.LLAMASWAP_CONFIG = ""
    assert checks.check_config() == []


def test_check_config_missing_file(settings: Any, tmp_path: Path) -> None:
    settings.LLAMASWAP_CONFIG = str(tmp_path / "nope.yaml")
    [message] = checks.check_config()
    assert message.id == "llamaswap.E001"
    assert "not found" in message.msg


def test_manage_py_check_reports_errors(settings: Any, tmp_path: Path) -> None:
    settings.LLAMASWAP_CONFIG = str(write(tmp_path, BAD_TTL))
    with pytest.raises(SystemCheckError) as info:
        call_command("check", stdout=io.StringIO(), stderr=io.StringIO())
    assert "llamaswap.E001" in str(info.value)
    assert "models.qwen.ttl" in str(info.value)


def test_manage_py_check_reports_warnings(settings: Any, tmp_path: Path) -> None:
    settings.LLAMASWAP_CONFIG = str(write(tmp_path, WITH_WARNINGS))
    out, err = io.StringIO(), io.StringIO()
    call_command("check", stdout=out, stderr=err)
    output = out.getvalue() + err.getvalue()
    assert output.count("llamaswap.W001") == 2
    assert "logRequests" in output


# --------------------------------------------------------------------------- smaller llama-swap keys


def test_smaller_keys_default_as_llama_swap() -> None:
    config = parse(with_model(""))
    assert config.include_aliases_in_list is False
    assert config.log_to_stdout == "proxy"
    assert config.log_time_format == ""
    assert [p.pattern for p in config.upstream_ignore_paths] == [DEFAULT_UPSTREAM_IGNORE_PATHS]
    assert config.models["m"].capabilities == Capabilities()
    assert config.models["m"].capabilities.empty
    assert config.warnings == ()


def test_smaller_keys_are_read() -> None:
    config = parse(
        with_model(
            "capabilities: {in: [text, image], out: [text], tools: true, context: 32768}",
            "includeAliasesInList: true\nlogToStdout: both\nlogTimeFormat: RFC3339\n"
            "upstream: {ignorePaths: ['^/static/', '\\.map$']}",
        )
    )
    assert config.include_aliases_in_list is True
    assert config.log_to_stdout == "both"
    assert config.log_time_format == "rfc3339"  # case-insensitive, as llama-swap
    assert [p.pattern for p in config.upstream_ignore_paths] == ["^/static/", "\\.map$"]
    assert config.models["m"].capabilities == Capabilities(
        inputs=("text", "image"), outputs=("text",), tools=True, context=32768
    )
    assert config.warnings == ()


def test_empty_ignore_paths_take_the_default() -> None:
    config = parse(with_model("", "upstream: {ignorePaths: []}"))
    assert [p.pattern for p in config.upstream_ignore_paths] == [DEFAULT_UPSTREAM_IGNORE_PATHS]


def test_capabilities_and_metadata_take_macros() -> None:
    m = model(
        with_model(
            "macros: {ctx: 8192}\ncapabilities: {context: '${ctx}'}\n"
            "metadata: {ctx: '${ctx}', tags: [a, '${MODEL_ID}'], nested: {enabled: true}}"
        )
    )
    assert m.capabilities.context == 8192  # the macro's type is kept
    assert m.metadata == {"ctx": 8192, "tags": ["a", "m"], "nested": {"enabled": True}}


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (with_model("", "logToStdout: stderr"), "logToStdout"),
        (with_model("", "logToStdout: ''"), "logToStdout"),
        (with_model("", "logTimeFormat: [rfc3339]"), "logTimeFormat"),
        (with_model("", "includeAliasesInList: yes-please"), "includeAliasesInList"),
        (with_model("", "upstream: [x]"), "upstream"),
        (with_model("", "upstream: {ignorePaths: '.*'}"), "upstream.ignorePaths"),
        (with_model("", "upstream: {ignorePaths: ['ok', '(unclosed']}"), "upstream.ignorePaths[1]"),
        (with_model("capabilities: [text]"), "models.m.capabilities"),
        (with_model("capabilities: {in: [text, video]}"), "models.m.capabilities.in[1]"),
        (with_model("capabilities: {out: text}"), "models.m.capabilities.out"),
        (with_model("capabilities: {tools: 1}"), "models.m.capabilities.tools"),
        (with_model("capabilities: {reranker: 'no'}"), "models.m.capabilities.reranker"),
        (with_model("capabilities: {context: -1}"), "models.m.capabilities.context"),
        (with_model("capabilities: {context: 4k}"), "models.m.capabilities.context"),
        (with_model("metadata: [a, b]"), "models.m.metadata"),
    ],
)
def test_smaller_key_errors_name_the_key(text: str, key: str) -> None:
    assert error_of(text).key == key


def test_send_loading_state_global_and_per_model():
    config = parse_config(
        yaml.safe_load(
            """
sendLoadingState: true
models:
  a: {cmd: "x --port ${PORT}"}
  b: {cmd: "x --port ${PORT}", sendLoadingState: false}
"""
        )
    )
    assert not config.warnings
    assert config.models["a"].send_loading_state and not config.models["b"].send_loading_state
    assert not parse_config({"models": {"a": {"cmd": "x --port ${PORT}"}}}).models["a"].send_loading_state
    with pytest.raises(ConfigError) as caught:
        parse_config({"models": {"a": {"cmd": "x --port ${PORT}", "sendLoadingState": "yes please"}}})
    assert caught.value.key == "models.a.sendLoadingState"
