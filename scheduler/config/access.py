"""Who may use the API and what a client may send: ``apiKeys`` (with their priority
rules and scopes), ``security`` (browser origins, the 401 challenge) and ``limits``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from scheduler.config.values import (
    ConfigError,
    kind_of,
    or_default,
    read_bool,
    read_int,
    read_mapping,
    read_number,
    read_string,
    read_string_list,
    warn_unknown,
)
from scheduler.core.priority import parse_priority_or_none
from scheduler.keys import DEFAULT_SCOPES, ApiKey, KeyPolicy
from scheduler.keys import Scope as KeyScope

_LIMIT_KEYS = {  # config key -> RequestLimits field; _LIMIT_COUNTS are ints, the rest seconds
    "maxBodyBytes": "max_body_bytes",
    "maxJsonValues": "max_json_values",
    "headerTimeout": "header_timeout",
    "bodyTimeout": "body_timeout",
    "bodyIdleTimeout": "body_idle_timeout",
    "sendIdleTimeout": "send_idle_timeout",
}


_LIMIT_COUNTS = frozenset({"maxBodyBytes", "maxJsonValues"})


_API_KEY_FIELDS = frozenset({"name", "key", "priority", "scopes"})


_KEY_POLICY_FIELDS = frozenset({"default", "ceiling", "offset"})


_INT64_MIN = -(2**63)


_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class RequestLimits:
    """``limits`` (our extension): what a client may send. Timeouts in seconds; 0 disables."""

    max_body_bytes: int = 256 * 1024 * 1024
    """``maxBodyBytes``: the largest request body accepted."""
    header_timeout: float = 30
    """``headerTimeout``: seconds to send the request line and headers."""
    body_timeout: float = 300
    """``bodyTimeout``: seconds to send the whole body once the headers arrived."""
    body_idle_timeout: float = 60
    """``bodyIdleTimeout``: seconds without a body byte."""
    max_json_values: int = 1_000_000
    """``maxJsonValues``: the most JSON values a request body may hold, counted before it
    is parsed as its ``{ [ , :`` bytes (an upper bound: those inside strings count too).
    Parsing costs up to ~100 bytes and ~0.1 us per value on the event loop: this bounds
    both, whatever the body's shape, where the body's size alone allowed ~25x its size."""
    send_idle_timeout: float = 60
    """``sendIdleTimeout``: seconds a client may leave a response unread (the server's
    send buffer full, the response waiting) before the connection is cut."""


@dataclass(frozen=True)
class Security:
    """``security``: who may talk to the API from a browser, and how a 401 answers."""

    allowed_origins: frozenset[str] = frozenset()
    """``security.cors.allowedOrigins``: browser origins (``scheme://host[:port]``,
    lowercased, default port dropped) whose cross-site requests the API paths accept.
    Default none: only the server's own pages and non-browser clients."""
    any_origin: bool = False
    """``"*"`` among the allowed origins: no cross-site check at all (llama-swap's
    historical policy, asked for explicitly)."""
    basic_auth_challenge: bool = False
    """``security.basicAuthChallenge``: a 401 carries ``WWW-Authenticate: Basic`` (llama-swap
    sends it so its UI gets the browser's password prompt). Off by default: a browser that
    caches the credentials then sends them on every request, cross-site forms included."""
    allow_credentials: bool = False
    """``security.cors.allowCredentials``: an allowed origin's preflight and responses say
    ``Access-Control-Allow-Credentials: true`` (its page may send cookies or a Basic login)."""
    allowed_methods: tuple[str, ...] = ()
    """``security.cors.allowedMethods``: the preflight's ``Access-Control-Allow-Methods``
    (empty: llama-swap's list, web/cors.py)."""
    allowed_headers: tuple[str, ...] = ()
    """``security.cors.allowedHeaders``: the preflight's ``Access-Control-Allow-Headers``
    (empty: the requested ones, as llama-swap)."""
    exposed_headers: tuple[str, ...] = ()
    """``security.cors.exposedHeaders``: added to ``Access-Control-Expose-Headers`` on an
    allowed origin's responses."""
    max_age: int | None = None
    """``security.cors.maxAge``: the preflight's ``Access-Control-Max-Age`` in seconds
    (None: llama-swap's 86400)."""


def read_api_keys(value: Any) -> dict[str, ApiKey]:
    """``apiKeys``: a list of keys (llama-swap) or ``{name, key, priority, scopes}`` mappings.

    A plain key is named ``key-<position>`` (from 1). Keys must be non-empty and contain no
    whitespace; keys and names must be unique. A key without ``scopes`` (a plain string
    key included) may use inference only (:data:`scheduler.keys.DEFAULT_SCOPES`).
    """
    if value is None:
        return {}
    if not isinstance(value, list):
        raise ConfigError("apiKeys", f"must be a list of keys, got {kind_of(value)}")
    keys: dict[str, ApiKey] = {}
    named: dict[str, str] = {}  # name -> where
    for i, entry in enumerate(value):
        where = f"apiKeys[{i}]"
        if isinstance(entry, Mapping):
            for name in entry:
                if name not in _API_KEY_FIELDS:
                    raise ConfigError(
                        f"{where}.{name}", "unknown field (use name, key, priority and scopes)"
                    )
            if entry.get("key") is None:
                raise ConfigError(f"{where}.key", "required: the key clients present")
            key_path = f"{where}.key"
            raw_key = entry["key"]
            name = (
                f"key-{i + 1}"
                if entry.get("name") is None
                else read_string(entry["name"], f"{where}.name").strip()
            )
            if not name:
                raise ConfigError(f"{where}.name", "must not be empty")
            policy = key_policy(entry.get("priority"), f"{where}.priority")
            scopes = key_scopes(entry.get("scopes"), f"{where}.scopes")
        elif entry is None or isinstance(entry, str | int | float) and not isinstance(entry, bool):
            key_path, raw_key, name, policy = where, entry, f"key-{i + 1}", KeyPolicy()
            scopes = DEFAULT_SCOPES
        else:
            raise ConfigError(
                where, f"must be a key or a mapping of name, key and priority, got {kind_of(entry)}"
            )
        key = check_api_key(read_string(raw_key, key_path) if raw_key is not None else "", key_path)
        if key in keys:
            raise ConfigError(key_path, f"duplicate key: already the key of {keys[key].name!r}")
        if name in named:
            name_path = f"{where}.name" if isinstance(entry, Mapping) else where
            raise ConfigError(name_path, f"duplicate name {name!r}: already used by {named[name]}")
        named[name] = where
        keys[key] = ApiKey(name=name, policy=policy, source="config", scopes=scopes)
    return keys


def key_scopes(value: Any, path: str) -> frozenset[KeyScope]:
    """``scopes``: a non-empty list of :class:`~scheduler.keys.Scope` names; absent (or
    null): inference only. An unknown name is an error naming ``<path>[j]``."""
    if value is None:
        return DEFAULT_SCOPES
    known = ", ".join(s.value for s in KeyScope)
    if not isinstance(value, list):
        raise ConfigError(path, f"must be a list of scopes ({known}), got {kind_of(value)}")
    if not value:
        raise ConfigError(
            path, f"must name at least one scope ({known}); leave it out for inference only"
        )
    scopes = set()
    for j, item in enumerate(value):
        try:
            scopes.add(KeyScope(item.strip()) if isinstance(item, str) else KeyScope(item))
        except ValueError:
            raise ConfigError(f"{path}[{j}]", f"unknown scope {item!r} (use {known})") from None
    return frozenset(scopes)


def check_api_key(key: str, path: str) -> str:
    """A key as llama-swap accepts it: non-empty, no whitespace. Raises :class:`ConfigError`."""
    if not key:
        raise ConfigError(path, "must not be empty")
    if any(c.isspace() for c in key):
        raise ConfigError(path, "must not contain whitespace")
    return key


def key_policy(value: Any, path: str) -> KeyPolicy:
    """``{default, ceiling, offset}`` (all optional) as a :class:`KeyPolicy`.

    ``default`` and ``ceiling`` are integers or the aliases interactive/normal/batch (what
    the ``X-LlamaSwap-Priority`` header accepts); ``offset`` is an integer. Also used by
    the admin's form for issued keys. Raises :class:`ConfigError`.
    """
    rule = read_mapping(value, path)
    for name in rule:
        if name not in _KEY_POLICY_FIELDS:
            raise ConfigError(f"{path}.{name}", "unknown field (use default, ceiling and offset)")
    default = _priority_value(rule.get("default"), f"{path}.default")
    ceiling = _priority_value(rule.get("ceiling"), f"{path}.ceiling")
    offset = 0
    if rule.get("offset") is not None:
        offset = read_int(rule["offset"], f"{path}.offset")
        if not _INT64_MIN <= offset <= _INT64_MAX:
            raise ConfigError(f"{path}.offset", f"out of the 64-bit range, got {offset}")
    if default is not None and ceiling is not None and default > ceiling:
        raise ConfigError(
            f"{path}.default", f"{default} is above the ceiling {ceiling}: it could never apply"
        )
    return KeyPolicy(default=default, ceiling=ceiling, offset=offset)


def _priority_value(value: Any, path: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        parsed = value if _INT64_MIN <= value <= _INT64_MAX else None
    elif isinstance(value, str):
        parsed = parse_priority_or_none(value)
    else:
        parsed = None
    if parsed is None:
        raise ConfigError(
            path,
            f"must be an integer priority or interactive, normal or batch, got {kind_of(value)}",
        )
    return parsed


_CORS_KEYS = frozenset(
    {
        "allowedOrigins",
        "allowCredentials",
        "allowedMethods",
        "allowedHeaders",
        "exposedHeaders",
        "maxAge",
    }
)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP token (RFC 9110): what a method or a header name is."""


def _tokens(value: Any, key: str, star: bool = False) -> tuple[str, ...]:
    """A list of HTTP tokens (methods, header names), each checked; ``star``: ``"*"``
    allowed as the only entry."""
    entries = read_string_list(value, key)
    for i, entry in enumerate(entries):
        if entry == "*":
            if star and len(entries) == 1:
                continue
            raise ConfigError(
                f"{key}[{i}]",
                '"*" may only be the one entry' if star else '"*" is not allowed here',
            )
        if not _TOKEN.fullmatch(entry):
            raise ConfigError(
                f"{key}[{i}]", f"{entry!r} is not an HTTP token (letters, digits, -, _, ...)"
            )
    return tuple(entries)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def read_security(value: Any, warnings: list[str]) -> Security:
    """``security``: ``cors.allowedOrigins`` (llama-swap's key; entries ``scheme://host[:port]``
    or ``"*"``; default none here, any in llama-swap) and ``basicAuthChallenge`` (ours)."""
    security = read_mapping(value, "security")
    warn_unknown(security, "security", {"cors", "basicAuthChallenge"}, warnings)
    cors = read_mapping(security.get("cors"), "security.cors")
    warn_unknown(cors, "security.cors", _CORS_KEYS, warnings)
    origins: set[str] = set()
    any_origin = False
    entries = read_string_list(cors.get("allowedOrigins"), "security.cors.allowedOrigins")
    for i, entry in enumerate(entries):
        if entry == "*":
            any_origin = True
        else:
            origins.add(_origin(entry, f"security.cors.allowedOrigins[{i}]"))
    challenge = read_bool(
        or_default(security.get("basicAuthChallenge"), False), "security.basicAuthChallenge"
    )
    credentials = read_bool(
        or_default(cors.get("allowCredentials"), False), "security.cors.allowCredentials"
    )
    if credentials and any_origin:
        raise ConfigError(
            "security.cors.allowCredentials",
            'true with allowedOrigins ["*"] would let every site use the browser\'s '
            "credentials here: list the origins instead",
        )
    max_age = cors.get("maxAge")
    return Security(
        frozenset(origins),
        any_origin,
        challenge,
        allow_credentials=credentials,
        allowed_methods=_tokens(cors.get("allowedMethods"), "security.cors.allowedMethods"),
        allowed_headers=_tokens(
            cors.get("allowedHeaders"), "security.cors.allowedHeaders", star=True
        ),
        exposed_headers=_tokens(cors.get("exposedHeaders"), "security.cors.exposedHeaders"),
        max_age=None if max_age is None else read_int(max_age, "security.cors.maxAge", 0),
    )


def _origin(text: str, key: str) -> str:
    """An origin as browsers send it: ``scheme://host[:port]`` lowercased, without the
    scheme's default port (so ``https://A.example:443`` matches ``https://a.example``)."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(key, f"{text!r} is not an origin: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ConfigError(
            key, f"{text!r} must be an http(s)://host[:port] origin, e.g. https://chat.example.com"
        )
    if parts.path or parts.query or parts.fragment or "@" in parts.netloc or text != text.strip():
        raise ConfigError(
            key,
            f"{text!r} must be a bare origin: no path (not even /), query, fragment, user or spaces",
        )
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def read_request_limits(value: Any, warnings: list[str]) -> RequestLimits:
    """``limits``: ``maxBodyBytes`` and ``maxJsonValues`` >= 1, and the client timeouts
    >= 0 (0 disables one)."""
    limits = read_mapping(value, "limits")
    warn_unknown(limits, "limits", set(_LIMIT_KEYS), warnings)
    values: dict[str, Any] = {}
    for setting, name in _LIMIT_KEYS.items():
        if limits.get(setting) is None:
            continue
        if setting in _LIMIT_COUNTS:
            values[name] = read_int(limits[setting], f"limits.{setting}", 1)
        else:
            values[name] = read_number(limits[setting], f"limits.{setting}")
    return RequestLimits(**values)
