"""``profiles``, ``selectors`` and ``peers``: their values and their parsing, with
llama-swap's load errors (the resolution of a request's name is :mod:`scheduler.names`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from scheduler.config.models import (
    PROTECTED_PARAMS,
    ModelConfig,
    ModelTimeouts,
    check_url,
    parse_strip_params,
    read_listing,
    read_model_timeouts,
    set_params_by_id,
)
from scheduler.config.values import (
    ConfigError,
    kind_of,
    or_default,
    read_int,
    read_mapping,
    read_string,
    read_string_list,
    warn_unknown,
)

STRATEGY_PIN = "pin"


STRATEGY_WARM = "warm"


STRATEGY_SPILLOVER = "spillover"


STRATEGIES = (STRATEGY_WARM, STRATEGY_PIN, STRATEGY_SPILLOVER)
"""llama-swap's selector strategies, in the order its error message lists them."""


DEFAULT_SPILLOVER = 1


_PROFILE_KEYS = frozenset({"description", "pins"})


_SELECTOR_KEYS = frozenset(
    {"strategy", "targets", "settings", "name", "description", "unlisted", "metadata"}
)


_PEER_KEYS = frozenset({"proxy", "apiKey", "models", "filters", "timeouts"})


_PEER_FILTER_KEYS = frozenset({"stripParams", "strip_params", "setParams", "setParamsByID"})


@dataclass(frozen=True)
class Profile:
    """``profiles.<id>``: a set of name rewrites an operator switches on at run time."""

    id: str
    description: str = ""
    pins: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Requested name -> target (a model id, alias, peer model or selector); "" (or null
    in the YAML) makes the name unknown while the profile is active."""


@dataclass(frozen=True)
class Selector:
    """``selectors.<id>``: a virtual model name that picks one of its targets per request."""

    id: str
    strategy: str
    targets: tuple[str, ...]
    spillover: int = DEFAULT_SPILLOVER
    """``settings.spillover``: requests per target before the next one is used."""
    name: str = ""
    description: str = ""
    unlisted: bool = False
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


PEER_TIMEOUTS = ModelTimeouts(response_header=60, idle=0)
"""llama-swap's peer defaults: ``responseHeader`` 60 s, the rest as for models (``idle``,
ours, is off unless set)."""


@dataclass(frozen=True)
class Peer:
    """``peers.<id>``: a remote OpenAI-compatible server (another llama-swap or llamaswap,
    OpenRouter, ...). Its requests are forwarded as they come: no local turn, no queue."""

    id: str
    proxy: str
    """Base URL; the request's path is appended (``https://openrouter.ai/api`` +
    ``/v1/chat/completions``)."""
    models: tuple[str, ...]
    api_key: str = ""
    """Sent as ``Authorization: Bearer`` and ``x-api-key`` when set."""
    strip_params: tuple[str, ...] = ()
    set_params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    set_params_by_id: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    timeouts: ModelTimeouts = field(default_factory=lambda: PEER_TIMEOUTS)
    """:data:`PEER_TIMEOUTS` where the config sets none."""


@dataclass(frozen=True)
class PeerModel:
    """One model of one peer, as a request names it."""

    peer: Peer
    model: str
    """The peer's own name for it (sent upstream as ``model``)."""

    @property
    def fqn(self) -> str:
        return f"{self.peer.id}/{self.model}"


@dataclass(frozen=True)
class Names:
    """What :func:`parse_names` gives :class:`scheduler.config.Config`."""

    profiles: Mapping[str, Profile]
    selectors: Mapping[str, Selector]
    peers: Mapping[str, Peer]
    peer_routes: Mapping[str, PeerModel]


def parse_names(
    top: Mapping[str, Any],
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    warnings: list[str],
) -> Names:
    """``peers``, ``selectors`` and ``profiles`` (macros already expanded), checked against
    the models and each other with llama-swap's rules."""
    peers = _peers(top.get("peers"), warnings)
    routes = _peer_routes(peers, models, aliases)
    selectors = _selectors(top.get("selectors"), models, aliases, routes, warnings)
    profiles = _profiles(top.get("profiles"), models, aliases, routes, selectors, warnings)
    return Names(
        profiles=MappingProxyType(profiles),
        selectors=MappingProxyType(selectors),
        peers=MappingProxyType(peers),
        peer_routes=MappingProxyType(routes),
    )


def _peers(value: Any, warnings: list[str]) -> dict[str, Peer]:
    peers: dict[str, Peer] = {}
    for raw_id, settings in read_mapping(value, "peers").items():
        peer_id = str(raw_id)
        key = f"peers.{peer_id}"
        if not peer_id.strip():
            raise ConfigError(key, "peer ids must not be empty")
        if settings is None or not isinstance(settings, Mapping):
            raise ConfigError(key, "must be a mapping with proxy and models")
        warn_unknown(settings, key, set(_PEER_KEYS), warnings)
        proxy = read_string(or_default(settings.get("proxy"), ""), f"{key}.proxy").strip()
        if not proxy:
            raise ConfigError(f"{key}.proxy", "required: the peer's base URL")
        check_url(proxy, f"{key}.proxy")
        listed = read_string_list(settings.get("models"), f"{key}.models")
        names: list[str] = []
        for i, name in enumerate(listed):
            if not name.strip():
                raise ConfigError(f"{key}.models[{i}]", "model names must not be empty")
            if name not in names:
                names.append(name)
        if not names:
            raise ConfigError(f"{key}.models", "peer models can not be empty")
        filters = read_mapping(settings.get("filters"), f"{key}.filters")
        warn_unknown(filters, f"{key}.filters", set(_PEER_FILTER_KEYS), warnings)
        strip_text = filters.get("stripParams") or filters.get("strip_params") or ""
        set_params = {
            str(k): v
            for k, v in read_mapping(filters.get("setParams"), f"{key}.filters.setParams").items()
            if str(k) not in PROTECTED_PARAMS
        }
        raw_timeouts = dict(read_mapping(settings.get("timeouts"), f"{key}.timeouts"))
        raw_timeouts.setdefault("responseHeader", PEER_TIMEOUTS.response_header)
        raw_timeouts.setdefault("idle", PEER_TIMEOUTS.idle)
        timeouts = read_model_timeouts(raw_timeouts, f"{key}.timeouts", warnings)
        peers[peer_id] = Peer(
            id=peer_id,
            proxy=proxy,
            models=tuple(names),
            api_key=_header_value(settings.get("apiKey"), f"{key}.apiKey"),
            strip_params=parse_strip_params(read_string(strip_text, f"{key}.filters.stripParams")),
            set_params=MappingProxyType(set_params),
            set_params_by_id=MappingProxyType(
                set_params_by_id(filters.get("setParamsByID"), f"{key}.filters.setParamsByID")
            ),
            timeouts=timeouts,
        )
    return peers


def _header_value(value: Any, key: str) -> str:
    """A peer's ``apiKey``: sent in a header, so visible ASCII only (a newline or a
    non-ASCII character would fail every request to the peer instead of the load)."""
    text = read_string(or_default(value, ""), key).strip()
    if not all("!" <= c <= "~" for c in text):
        raise ConfigError(
            key, "must be visible ASCII characters (no whitespace, control or non-ASCII ones)"
        )
    return text


def _peer_routes(
    peers: Mapping[str, Peer], models: Mapping[str, ModelConfig], aliases: Mapping[str, str]
) -> dict[str, PeerModel]:
    """``peer/model`` for every peer model, plus the bare ``model`` when exactly one peer
    lists it and no ``peer/model`` is spelled that way. A full name may be no model id or
    alias (llama-swap's namespace rule); a bare name that is one stays local."""
    full: dict[str, PeerModel] = {}
    bare: dict[str, list[PeerModel]] = {}
    for peer_id in sorted(peers):
        peer = peers[peer_id]
        for i, name in enumerate(peer.models):
            entry = PeerModel(peer, name)
            if entry.fqn in full:
                other = full[entry.fqn]
                raise ConfigError(
                    f"peers.{peer_id}.models[{i}]",
                    f"peer model name {entry.fqn!r} is ambiguous between peers.{other.peer.id} "
                    f"model {other.model!r} and peers.{peer_id} model {name!r}",
                )
            if entry.fqn in models:
                raise ConfigError(
                    f"peers.{peer_id}.models[{i}]",
                    f"{entry.fqn!r} is also the id of a local model",
                )
            if entry.fqn in aliases:
                raise ConfigError(
                    f"peers.{peer_id}.models[{i}]",
                    f"{entry.fqn!r} is also an alias of local model {aliases[entry.fqn]!r}",
                )
            full[entry.fqn] = entry
            bare.setdefault(name, []).append(entry)
    routes = dict(full)
    for name, entries in bare.items():
        if len(entries) == 1 and name not in full:
            routes[name] = entries[0]
    return routes


def _resolves(
    name: str,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    routes: Mapping[str, PeerModel],
) -> bool:
    return name in models or name in aliases or name in routes


def _selectors(
    value: Any,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    routes: Mapping[str, PeerModel],
    warnings: list[str],
) -> dict[str, Selector]:
    section = read_mapping(value, "selectors")
    selectors: dict[str, Selector] = {}
    for raw_id, settings in section.items():
        sel_id = str(raw_id)
        key = f"selectors.{sel_id}"
        if not sel_id.strip():
            raise ConfigError(key, "selector names cannot be empty")
        if sel_id in models:
            raise ConfigError(key, f"name conflicts with model ID {sel_id!r}")
        if sel_id in aliases:
            raise ConfigError(key, f"name conflicts with model alias {sel_id!r}")
        if sel_id in routes and routes[sel_id].fqn == sel_id:
            raise ConfigError(key, f"name conflicts with the peer model {sel_id!r}")
        body = read_mapping(settings, key)
        warn_unknown(body, key, set(_SELECTOR_KEYS), warnings)
        strategy = read_string(or_default(body.get("strategy"), ""), f"{key}.strategy").strip()
        if not strategy:
            raise ConfigError(f"{key}.strategy", "required (warn, pin or spillover)")
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"{key}.strategy",
                f"unknown strategy {strategy!r} (valid: {', '.join(STRATEGIES)})",
            )
        targets = read_string_list(body.get("targets"), f"{key}.targets")
        if not targets:
            raise ConfigError(f"{key}.targets", "must contain at least one entry")
        seen: dict[str, int] = {}
        for i, target in enumerate(targets):
            path = f"{key}.targets[{i}]"
            if target in section:
                raise ConfigError(
                    path, f"references selector {target!r}; selector chaining is not supported"
                )
            if not _resolves(target, models, aliases, routes):
                raise ConfigError(path, f"references unknown model {target!r}")
            local = target in models or target in aliases
            if strategy == STRATEGY_WARM and not local:
                raise ConfigError(path, f"must resolve to a local model for strategy {strategy!r}")
            if strategy == STRATEGY_SPILLOVER:
                resolved = aliases.get(target, target) if local else routes[target].fqn
                if resolved in seen:
                    raise ConfigError(
                        path,
                        f"duplicate resolved model {resolved!r} (also targets[{seen[resolved]}])",
                    )
                seen[resolved] = i
        options = read_mapping(body.get("settings"), f"{key}.settings")
        warn_unknown(options, f"{key}.settings", {"spillover"}, warnings)
        spillover = read_int(
            or_default(options.get("spillover"), DEFAULT_SPILLOVER), f"{key}.settings.spillover"
        )
        if strategy == STRATEGY_SPILLOVER and spillover < 1:
            raise ConfigError(f"{key}.settings.spillover", f"must be >= 1, got {spillover}")
        selectors[sel_id] = Selector(
            id=sel_id,
            strategy=strategy,
            targets=tuple(targets),
            spillover=spillover,
            **read_listing(body, key),
        )
    return selectors


def _profiles(
    value: Any,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    routes: Mapping[str, PeerModel],
    selectors: Mapping[str, Selector],
    warnings: list[str],
) -> dict[str, Profile]:
    profiles: dict[str, Profile] = {}
    for raw_id, settings in read_mapping(value, "profiles").items():
        profile_id = str(raw_id)
        key = f"profiles.{profile_id}"
        if not profile_id.strip():
            raise ConfigError(key, "profile names cannot be empty")
        if not isinstance(settings, Mapping):
            raise ConfigError(
                key,
                f"must be a mapping with description and pins, got {kind_of(settings)}; "
                "the legacy list syntax is no longer supported",
            )
        warn_unknown(settings, key, set(_PROFILE_KEYS), warnings)
        pins_raw = read_mapping(settings.get("pins"), f"{key}.pins")
        if not pins_raw:
            raise ConfigError(f"{key}.pins", "must contain at least one entry")
        pins: dict[str, str] = {}
        for raw_pin, raw_target in pins_raw.items():
            pin = str(raw_pin)
            path = f"{key}.pins.{pin}"
            if not pin.strip():
                raise ConfigError(f"{key}.pins", "pin names cannot be empty")
            if pin in routes and routes[pin].fqn == pin:
                raise ConfigError(path, f"pin {pin!r} conflicts with the peer model {pin!r}")
            target = "" if raw_target is None else read_string(raw_target, path)
            if target and not (_resolves(target, models, aliases, routes) or target in selectors):
                raise ConfigError(path, f"references unknown model {target!r}")
            pins[pin] = target
        profiles[profile_id] = Profile(
            id=profile_id,
            description=read_string(
                or_default(settings.get("description"), ""), f"{key}.description"
            ),
            pins=MappingProxyType(pins),
        )
    return profiles
