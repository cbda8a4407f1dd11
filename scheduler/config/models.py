"""``models:``: each model's settings with its macros expanded, ``${PORT}`` assigned,
checked and built into a :class:`ModelConfig`; its aliases, including the ones
``filters.setParamsByID`` creates."""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from scheduler.config.macros import (
    Budget,
    MacroScope,
    expand_macros,
    macro_scope,
    model_scope,
    read_macros,
    substitute,
    substitute_all,
)
from scheduler.config.values import (
    ConfigError,
    kind_of,
    known_keys,
    or_default,
    read_bool,
    read_int,
    read_mapping,
    read_number,
    read_string,
    read_string_list,
    warn_unknown,
)

DEFAULT_CONCURRENCY_LIMIT = 10
DEFAULT_HEALTH_CHECK_TIMEOUT = 120
DEFAULT_UNLOAD_TIMEOUT = 10
"""``healthCheckTimeout`` and ``unloadTimeout`` (seconds) when the config says none (or 0)."""

COMFYUI_MODEL_ID = "comfyui_auto"
"""The model ``/comfyui/`` passes through to (llama-swap's rule; ``proxy/passthrough.py``).
Its config is forced as llama-swap forces it: ``concurrencyLimit`` at least
:data:`COMFYUI_CONCURRENCY_LIMIT` (a ComfyUI page sends many requests at once) and
``compat.ignoreWebsockets`` (its page's socket never loads it)."""
COMFYUI_CONCURRENCY_LIMIT = 50


DEFAULT_CHECK_ENDPOINT = "/health"


DEFAULT_PROXY = "http://localhost:${PORT}"


INHERIT_TTL = -1
"""A model ``ttl`` of -1 (llama-swap's default) means "use ``globalTTL``"."""


PROTECTED_PARAMS = frozenset({"model"})
"""Request parameters that filters may never strip or set: routing depends on them."""


_MODEL_KEYS = frozenset(
    {
        "cmd",
        "cmdStop",
        "proxy",
        "aliases",
        "env",
        "checkEndpoint",
        "ttl",
        "unloadTimeout",
        "useModelName",
        "name",
        "description",
        "unlisted",
        "concurrencyLimit",
        "metadata",
        "filters",
        "macros",
        "timeouts",
        "capabilities",
        "slots",
        "sendLoadingState",
        "compat",
    }
)


_IGNORED_MODEL_KEYS = {
    "healthCheckTimeout": "per-model value is not supported; the global one applies",
}


_CAPABILITY_KEYS = frozenset({"in", "out", "tools", "reranker", "context"})


MODALITIES = ("text", "audio", "image")
"""What ``capabilities.in`` and ``.out`` accept (llama-swap's list)."""


_FILTER_KEYS = frozenset({"stripParams", "strip_params", "setParams", "setParamsByID"})


_TIMEOUT_KEYS = {  # config key -> ModelTimeouts field
    "connect": "connect",
    "keepalive": "keepalive",
    "responseHeader": "response_header",
    "tlsHandshake": "tls_handshake",
    "expectContinue": "expect_continue",
    "idleConn": "idle_conn",
    "idle": "idle",
}


@dataclass(frozen=True)
class ModelTimeouts:
    """``models.<id>.timeouts``, in seconds; 0 disables one.

    All but ``idle`` are llama-swap's reverse-proxy transport timeouts, with its defaults.
    """

    connect: float = 30
    keepalive: float = 30
    response_header: float = 0
    """Seconds for the model's response headers once the request is sent; 0: no limit."""
    tls_handshake: float = 10
    expect_continue: float = 1
    idle_conn: float = 90
    """Seconds an idle keep-alive connection to the model is kept."""
    idle: float = 300
    """Our extension: seconds without a byte from the model during a request, after which
    the model is checked."""


@dataclass(frozen=True)
class Capabilities:
    """``models.<id>.capabilities``: what ``/v1/models`` publishes about the model."""

    inputs: tuple[str, ...] = ()
    """``in``: modalities the model reads (text, audio, image)."""
    outputs: tuple[str, ...] = ()
    """``out``: modalities it writes."""
    tools: bool = False
    reranker: bool = False
    context: int = 0
    """Context length in tokens; 0: not said."""

    @property
    def empty(self) -> bool:
        """All zero values: treated as not configured (llama-swap's rule)."""
        return self == Capabilities()


@dataclass(frozen=True)
class ModelConfig:
    """One entry of ``models:`` with every macro expanded except ``${PID}`` in ``cmd_stop``."""

    id: str
    cmd: tuple[str, ...]
    """argv, split shell-style; no shell is involved."""
    proxy: str
    """Base URL of the model's server, e.g. ``http://127.0.0.1:5800``."""
    cmd_stop: tuple[str, ...] | None = None
    """argv run to stop the model; ``${PID}`` is replaced at stop time."""
    aliases: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    check_endpoint: str | None = "/health"
    """None when the config says ``none``: the model counts as ready once started."""
    ttl: int = 0
    """Seconds idle before the model is unloaded; 0 never."""
    unload_timeout: float = DEFAULT_UNLOAD_TIMEOUT
    """Seconds between SIGTERM and SIGKILL."""
    health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT
    use_model_name: str = ""
    name: str = ""
    description: str = ""
    unlisted: bool = False
    concurrency_limit: int = DEFAULT_CONCURRENCY_LIMIT
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    strip_params: tuple[str, ...] = ()
    set_params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    timeouts: ModelTimeouts = field(default_factory=ModelTimeouts)
    capabilities: Capabilities = field(default_factory=Capabilities)
    set_params_by_id: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    """``filters.setParamsByID``: requested name -> params set after ``setParams``; every
    key but the model's id is also one of its ``aliases`` (see scheduler/names.py)."""
    slots: int = 1
    """``slots`` (our extension): how many requests of this model its lane may run at
    once (serial scheduler)."""
    send_loading_state: bool = False
    """``sendLoadingState`` (the model's, else the global one): a streaming chat request
    that waits (in the queue or for its model's load) gets progress in
    ``reasoning_content`` (proxy/progress.py)."""
    ignore_websockets: bool = False
    """``compat.ignoreWebsockets``: a websocket to this model never loads it and takes no
    turn; it is relayed only while the model is ready (proxy/wsproxy.py)."""


def split_command(text: str) -> tuple[str, ...]:
    """argv for a ``cmd``/``cmdStop`` string, as llama-swap splits it.

    Lines whose first non-blank character is ``#`` are dropped, a trailing ``\\`` joins a
    line to the next, and the rest is split shell-style (POSIX quoting). No shell runs it.
    Raises ``ValueError`` on an unclosed quote.
    """
    lines: list[str] = []
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        lines.append(stripped[:-1] + " " if stripped.endswith("\\") else line)
    return tuple(shlex.split("\n".join(lines), comments=False, posix=True))


@dataclass(frozen=True)
class ModelDefaults:
    ttl: int
    unload_timeout: float
    health_check_timeout: float
    send_loading_state: bool = False


def prepare_models(
    value: Any, global_macros: list[tuple[str, Any]], warnings: list[str], budget: Budget
) -> dict[str, dict[str, Any]]:
    """Each model's raw settings with comments stripped and its macros expanded."""
    if value is None:
        raise ConfigError("models", "required: a mapping of model id to model settings")
    if not isinstance(value, Mapping):
        raise ConfigError(
            "models", f"must be a mapping of model id to settings, got {kind_of(value)}"
        )
    if not value:
        raise ConfigError("models", "no models defined")
    global_scope = macro_scope(global_macros)
    prepared: dict[str, dict[str, Any]] = {}
    for raw_id, settings in value.items():
        model_id = str(raw_id)
        key = f"models.{model_id}"
        if not model_id.strip():
            raise ConfigError(key, "model ids must not be empty")
        if not isinstance(settings, Mapping):
            raise ConfigError(key, f"must be a mapping of model settings, got {kind_of(settings)}")
        model = known_keys(
            settings, key, _MODEL_KEYS, _IGNORED_MODEL_KEYS, warnings, "unknown model key"
        )
        model_macros = read_macros(model.pop("macros", None), f"{key}.macros")
        if model.get("cmd") is None:
            raise ConfigError(f"{key}.cmd", "required: the command that starts the model's server")
        # Comments go before expansion: a macro mentioned in a comment is not an error.
        for name in ("cmd", "cmdStop"):
            if isinstance(model.get(name), str):
                model[name] = _strip_comment_lines(model[name])
        if model.get("proxy") is None:
            model["proxy"] = DEFAULT_PROXY
        scope = model_scope(model_id, global_scope, model_macros)
        prepared[model_id] = substitute_all(model, scope, key, budget)
        expand_set_params_keys(prepared[model_id], scope, key, budget)
    return prepared


def _strip_comment_lines(text: str) -> str:
    return "\n".join(line for line in text.split("\n") if not line.strip().startswith("#"))


def assign_ports(prepared: dict[str, dict[str, Any]], start_port: int) -> None:
    """Give ``${PORT}`` to each model whose cmd uses it, in sorted model-id order."""
    port = start_port
    for model_id in sorted(prepared):
        model = prepared[model_id]
        cmd = read_string(model["cmd"], f"models.{model_id}.cmd")
        if not cmd.strip():
            raise ConfigError(f"models.{model_id}.cmd", "is empty")
        cmd_uses = "${PORT}" in cmd
        proxy_uses = isinstance(model.get("proxy"), str) and "${PORT}" in model["proxy"]
        if proxy_uses and not cmd_uses:
            raise ConfigError(
                f"models.{model_id}.proxy",
                "uses ${PORT} but cmd does not (the default proxy is "
                f"{DEFAULT_PROXY}); use ${{PORT}} in cmd or set proxy to the URL cmd listens on",
            )
        if cmd_uses:
            if port > 65535:
                raise ConfigError(
                    f"models.{model_id}.cmd", f"no port left for ${{PORT}} (startPort {start_port})"
                )
            prepared[model_id] = substitute(model, "PORT", port)
            port += 1


def read_listing(body: Mapping[str, Any], key: str) -> dict[str, Any]:
    """How a model or selector at ``key`` is listed (``/v1/models``): its ``name``,
    ``description``, ``unlisted`` and ``metadata``, as :class:`ModelConfig` fields."""
    return {
        "name": read_string(or_default(body.get("name"), ""), f"{key}.name"),
        "description": read_string(or_default(body.get("description"), ""), f"{key}.description"),
        "unlisted": read_bool(or_default(body.get("unlisted"), False), f"{key}.unlisted"),
        "metadata": MappingProxyType(dict(read_mapping(body.get("metadata"), f"{key}.metadata"))),
    }


def build_model(
    model_id: str, model: Mapping[str, Any], defaults: ModelDefaults, warnings: list[str]
) -> ModelConfig:
    key = f"models.{model_id}"
    cmd = _command(model["cmd"], f"{key}.cmd")
    if not cmd:
        raise ConfigError(f"{key}.cmd", "is empty")
    cmd_stop = None
    if model.get("cmdStop") is not None:
        cmd_stop = _command(model["cmdStop"], f"{key}.cmdStop") or None

    proxy = check_url(read_string(model["proxy"], f"{key}.proxy").strip(), f"{key}.proxy")

    endpoint = read_string(
        or_default(model.get("checkEndpoint"), DEFAULT_CHECK_ENDPOINT), f"{key}.checkEndpoint"
    ).strip()
    check_endpoint = None if endpoint.lower() == "none" else endpoint
    if check_endpoint is not None and _UNSAFE_IN_URL.search(check_endpoint):
        raise ConfigError(
            f"{key}.checkEndpoint",
            f"must be a URL path without whitespace or control characters, got {check_endpoint!r}",
        )

    ttl = read_int(or_default(model.get("ttl"), INHERIT_TTL), f"{key}.ttl")
    if ttl < INHERIT_TTL:
        raise ConfigError(f"{key}.ttl", f"must be >= 0 (or -1 for globalTTL), got {ttl}")
    if ttl == INHERIT_TTL:
        ttl = defaults.ttl
    unload_timeout = read_number(or_default(model.get("unloadTimeout"), 0), f"{key}.unloadTimeout")
    concurrency = read_int(
        or_default(model.get("concurrencyLimit"), 0), f"{key}.concurrencyLimit", 0
    )

    filters = read_mapping(model.get("filters"), f"{key}.filters")
    for name in filters:
        if name not in _FILTER_KEYS:
            warnings.append(f"{key}.filters.{name}: unknown filter; ignored")
    strip_text = filters.get("stripParams") or filters.get("strip_params") or ""
    strip_params = parse_strip_params(read_string(strip_text, f"{key}.filters.stripParams"))
    set_params = {
        str(k): v
        for k, v in read_mapping(filters.get("setParams"), f"{key}.filters.setParams").items()
        if str(k) not in PROTECTED_PARAMS
    }
    by_id = set_params_by_id(filters.get("setParamsByID"), f"{key}.filters.setParamsByID")
    explicit_aliases = tuple(read_string_list(model.get("aliases"), f"{key}.aliases"))

    return ModelConfig(
        id=model_id,
        cmd=cmd,
        proxy=proxy,
        cmd_stop=cmd_stop,
        aliases=(*explicit_aliases, *derived_aliases(model_id, explicit_aliases, by_id)),
        env=MappingProxyType(_environment(model.get("env"), f"{key}.env")),
        check_endpoint=check_endpoint,
        ttl=ttl,
        unload_timeout=unload_timeout or defaults.unload_timeout,
        health_check_timeout=defaults.health_check_timeout,
        use_model_name=read_string(
            or_default(model.get("useModelName"), ""), f"{key}.useModelName"
        ),
        **read_listing(model, key),
        concurrency_limit=max(
            concurrency or DEFAULT_CONCURRENCY_LIMIT,
            COMFYUI_CONCURRENCY_LIMIT if model_id == COMFYUI_MODEL_ID else 0,
        ),
        strip_params=strip_params,
        set_params=MappingProxyType(set_params),
        set_params_by_id=MappingProxyType(by_id),
        timeouts=read_model_timeouts(model.get("timeouts"), f"{key}.timeouts", warnings),
        capabilities=_capabilities(model.get("capabilities"), f"{key}.capabilities", warnings),
        slots=read_int(or_default(model.get("slots"), 1), f"{key}.slots", 1),
        send_loading_state=read_bool(
            or_default(model.get("sendLoadingState"), defaults.send_loading_state),
            f"{key}.sendLoadingState",
        ),
        ignore_websockets=_ignore_websockets(model.get("compat"), f"{key}.compat", warnings)
        or model_id == COMFYUI_MODEL_ID,
    )


def _ignore_websockets(value: Any, key: str, warnings: list[str]) -> bool:
    """``compat.ignoreWebsockets`` (llama-swap's only ``compat`` key)."""
    compat = read_mapping(value, key)
    for name in compat:
        if name != "ignoreWebsockets":
            warnings.append(f"{key}.{name}: unknown compat key; ignored")
    return read_bool(or_default(compat.get("ignoreWebsockets"), False), f"{key}.ignoreWebsockets")


_UNSAFE_IN_URL = re.compile(r"[\x00-\x20\x7f-\x9f\s]")


_IPV4_LIKE = re.compile(r"[0-9.]+")


_HOST_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def check_url(url: str, key: str) -> str:
    """``url`` if it is an http(s) base URL requests can be sent to, else a ConfigError
    naming ``key``: the scheme ``http`` or ``https``; a host name, an IPv4 address or an
    IPv6 one in brackets (``http://[::1]:8080``); a port 1..65535 if one is given; then a
    path at most. No credentials (``user:pass@``: they would show in logs, and llama-swap
    does not send them either), no query or fragment (the request's own path and query are
    appended), no whitespace or control characters.

    Checked when the config loads, so that a typo is an error naming the key instead of a
    traceback (``http://[::1``) or a 500 on every request (``http://127.0.0.1:99999``).
    """

    def refuse(why: str) -> ConfigError:
        shown = url if len(url) <= 200 else url[:200] + "..."
        return ConfigError(key, f"{why}, got {shown!r}")

    if _UNSAFE_IN_URL.search(url):
        raise refuse("must be a URL without whitespace or control characters")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # urllib's own check: "Invalid IPv6 URL" (an unclosed '[')
        raise refuse(f"is not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not url.lower().startswith(f"{parts.scheme}://"):
        raise refuse("must be an http(s) URL such as http://127.0.0.1:8080")
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise refuse("must be a base URL without a query (?) or fragment (#)")
    netloc = parts.netloc
    if "@" in netloc:
        raise refuse("must not hold credentials (user:password@); peers take apiKey")
    port: str | None = None
    if netloc.startswith("["):
        host, _, rest = netloc[1:].partition("]")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise refuse(f"{host!r} in brackets is not an IPv6 address") from None
        if rest:
            if not rest.startswith(":"):
                raise refuse("only ':PORT' may follow the bracketed IPv6 address")
            port = rest[1:]
    else:
        host = netloc
        if ":" in netloc:
            host, _, port = netloc.rpartition(":")
            if ":" in host:
                raise refuse("an IPv6 address goes in brackets (http://[::1]:8080)")
        if not host:
            raise refuse("must name a host")
        if _IPV4_LIKE.fullmatch(host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise refuse(f"{host!r} is not an IPv4 address") from None
        elif not host.isascii():
            # IDNA has two standards that disagree; the xn-- form means one thing to all.
            raise refuse(f"write the international host name {host!r} in its xn-- form")
        else:
            labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
            if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
                raise refuse(f"{host!r} is not a valid host name")
    if port is not None and not (
        port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535
    ):
        raise refuse(f"the port must be a number 1..65535 ({port!r})")
    return url


def _capabilities(value: Any, key: str, warnings: list[str]) -> Capabilities:
    """``capabilities``: ``in``/``out`` modality lists, ``tools``, ``reranker``, ``context``."""
    caps = read_mapping(value, key)
    warn_unknown(caps, key, set(_CAPABILITY_KEYS), warnings)
    modalities: dict[str, tuple[str, ...]] = {}
    for name in ("in", "out"):
        listed = read_string_list(caps.get(name), f"{key}.{name}")
        for i, modality in enumerate(listed):
            if modality not in MODALITIES:
                raise ConfigError(
                    f"{key}.{name}[{i}]",
                    f"invalid modality {modality!r}, must be one of: {', '.join(MODALITIES)}",
                )
        modalities[name] = tuple(listed)
    return Capabilities(
        inputs=modalities["in"],
        outputs=modalities["out"],
        tools=read_bool(or_default(caps.get("tools"), False), f"{key}.tools"),
        reranker=read_bool(or_default(caps.get("reranker"), False), f"{key}.reranker"),
        context=read_int(or_default(caps.get("context"), 0), f"{key}.context", 0),
    )


def read_model_timeouts(value: Any, key: str, warnings: list[str]) -> ModelTimeouts:
    """``timeouts``: llama-swap's transport timeouts plus ``idle``; each a number >= 0."""
    timeouts = read_mapping(value, key)
    warn_unknown(timeouts, key, set(_TIMEOUT_KEYS), warnings)
    values = {
        name: read_number(timeouts[setting], f"{key}.{setting}")
        for setting, name in _TIMEOUT_KEYS.items()
        if timeouts.get(setting) is not None
    }
    return ModelTimeouts(**values)


def _command(value: Any, key: str) -> tuple[str, ...]:
    text = read_string(value, key)
    if "\0" in text:  # no program takes one in its argv: refused here, not at each start
        raise ConfigError(key, "must not contain a NUL character")
    try:
        return split_command(text)
    except ValueError as exc:
        raise ConfigError(key, f"cannot split into arguments: {exc}") from None


def parse_strip_params(text: str) -> tuple[str, ...]:
    """llama-swap's comma-separated list: trimmed, deduplicated, sorted, never ``model``."""
    names = {name.strip() for name in text.split(",")}
    return tuple(sorted(name for name in names if name and name not in PROTECTED_PARAMS))


def _environment(value: Any, key: str) -> dict[str, str]:
    """llama-swap's ``env`` list of ``NAME=value`` strings; a later NAME wins."""
    env: dict[str, str] = {}
    for i, item in enumerate(read_string_list(value, key)):
        name, sep, setting = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"{key}[{i}]", f"must look like NAME=value, got {item!r}")
        if "\0" in item:
            raise ConfigError(f"{key}[{i}]", "must not contain a NUL character")
        env[name] = setting
    return env


def alias_map(models: Mapping[str, ModelConfig]) -> dict[str, str]:
    """alias -> model id; an alias may name one model only and never shadow a model id."""
    aliases: dict[str, str] = {}
    for model_id, model in models.items():
        for i, alias in enumerate(model.aliases):
            key = f"models.{model_id}.aliases[{i}]"
            if not alias.strip():
                raise ConfigError(key, "aliases must not be empty")
            if alias in models:
                raise ConfigError(key, f"alias {alias!r} is the id of another model")
            if alias in aliases:
                other = aliases[alias]
                where = "this model" if other == model_id else f"model {other!r}"
                raise ConfigError(key, f"duplicate alias {alias!r}: already an alias of {where}")
            aliases[alias] = model_id
    return aliases


def real_model_id(
    name: str, models: Mapping[str, ModelConfig], aliases: Mapping[str, str]
) -> str | None:
    return name if name in models else aliases.get(name)


_MACRO_LEFT = re.compile(r"\$\{([a-zA-Z0-9_.-]+)\}")


def expand_set_params_keys(
    model: dict[str, Any], scope: MacroScope, key: str, budget: Budget
) -> None:
    """Macros in the keys of ``filters.setParamsByID`` (``${MODEL_ID}:high``), as
    llama-swap expands them: in the model's scope, last declared first. In place."""
    filters = model.get("filters")
    if not isinstance(filters, Mapping) or not isinstance(filters.get("setParamsByID"), Mapping):
        return
    expanded: dict[str, Any] = {}
    originals: dict[str, str] = {}
    for raw_key, params in filters["setParamsByID"].items():
        name = expand_macros(
            str(raw_key), scope, f"{key}.filters.setParamsByID", budget, typed=False
        )
        if name in expanded:
            raise ConfigError(
                f"{key}.filters.setParamsByID",
                f"keys {originals[name]!r} and {str(raw_key)!r} both expand to {name!r}",
            )
        expanded[name] = params
        originals[name] = str(raw_key)
    model["filters"] = {**filters, "setParamsByID": expanded}


def set_params_by_id(value: Any, key: str) -> dict[str, Mapping[str, Any]]:
    """``filters.setParamsByID``: requested name -> params to set (``model`` never)."""
    result: dict[str, Mapping[str, Any]] = {}
    for raw_id, params in read_mapping(value, key).items():
        name = str(raw_id)
        path = f"{key}.{name}"
        if not name.strip():
            raise ConfigError(path, "keys must not be empty")
        left = _MACRO_LEFT.search(name)
        if left is not None:
            if left.group(1) == "PORT":
                raise ConfigError(path, "${PORT} is not available in setParamsByID keys")
            raise ConfigError(path, f"unknown macro '${{{left.group(1)}}}' in the key")
        values = read_mapping(params, path)
        result[name] = MappingProxyType(
            {str(k): v for k, v in values.items() if str(k) not in PROTECTED_PARAMS}
        )
    return result


def derived_aliases(
    model_id: str, explicit: Sequence[str], by_id: Mapping[str, Any]
) -> tuple[str, ...]:
    """The aliases ``setParamsByID`` adds: every key but the model's own id and its
    explicit aliases, in key order."""
    return tuple(k for k in by_id if k != model_id and k not in explicit)


def check_derived_aliases(models: Mapping[str, ModelConfig]) -> None:
    """Each ``setParamsByID`` key is an alias of its model: never another model's id or
    alias (llama-swap's load errors). Run before the alias map is built."""
    for model_id, model in models.items():
        for name in model.set_params_by_id:
            if name == model_id:
                continue
            path = f"models.{model_id}.filters.setParamsByID.{name}"
            if name in models:
                raise ConfigError(path, f"key {name!r} conflicts with the id of model {name!r}")
            for other_id, other_model in models.items():
                if other_id != model_id and name in other_model.aliases:
                    raise ConfigError(
                        path, f"duplicate alias {name!r}: already an alias of model {other_id!r}"
                    )
