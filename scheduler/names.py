"""The names a request may use besides model ids and aliases: llama-swap's ``profiles``,
``selectors``, ``peers`` and the aliases ``filters.setParamsByID`` creates.

Two halves:

* **Parsing** (:func:`parse_names`, :func:`set_params_by_id`, :func:`check_derived_aliases`,
  :func:`expand_set_params_keys`), called by :func:`scheduler.config.parse_config`. The
  load errors are llama-swap's, each naming its key path.
* **Resolution** (:func:`route`, :func:`choose_warm`, :func:`choose_spillover`): pure, the
  state of the models and the load of each target come in as arguments. A request's name
  goes through, in llama-swap's order:
  1. the active profile's pin (``profiles.<p>.pins``): the name is replaced by the pin's
     target; an empty target makes the name unknown while the profile is active;
  2. a selector (``selectors.<s>``) picks one of its targets (``pin``, ``warm``,
     ``spillover``);
  3. a local model id or alias (``setParamsByID`` keys included), else a peer model
     (``peer/model``, or the bare ``model`` when exactly one peer lists it).

  Pins do not chain (a pin's target is never looked up in the pins again) and selectors do
  not point at selectors (a load error).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from scheduler.config import (
    PROTECTED_PARAMS,
    Config,
    ConfigError,
    MacroScope,
    ModelConfig,
    ModelTimeouts,
    _bool,
    _Budget,
    _default,
    _int,
    _kind,
    _mapping,
    _model_timeouts,
    _string,
    _string_list,
    _strip_params,
    _warn_unknown,
    check_url,
    expand_macros,
)
from scheduler.process import ModelState

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
_MACRO_LEFT = re.compile(r"\$\{([a-zA-Z0-9_.-]+)\}")


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
    timeouts: ModelTimeouts = field(
        default_factory=lambda: ModelTimeouts(response_header=60, idle=0)
    )
    """llama-swap's peer defaults: ``responseHeader`` 60 s, the rest as for models
    (``idle``, ours, is off unless set)."""


@dataclass(frozen=True)
class PeerModel:
    """One model of one peer, as a request names it."""

    peer: Peer
    model: str
    """The peer's own name for it (sent upstream as ``model``)."""
    @property
    def fqn(self) -> str:
        return f"{self.peer.id}/{self.model}"


# --------------------------------------------------------------------------- resolution


class Unroutable(LookupError):
    """The requested name leads to no model: ``status`` 404, or 503 when a selector has
    no target it can use now. ``why`` says more than "not found" (or is empty)."""

    def __init__(self, requested: str, why: str = "", status: int = 404) -> None:
        self.requested = requested
        self.why = why
        self.status = status
        super().__init__(f"model {requested!r} not found" + (f": {why}" if why else ""))


@dataclass(frozen=True)
class Route:
    """Where a request goes, and how its name got there."""

    requested: str
    """The name the client sent."""
    name: str
    """The name after the profile's pin and the selector: the ``model`` sent on (unless
    ``useModelName`` or the peer's own name replaces it) and the key of
    ``setParamsByID``."""
    model: ModelConfig | None = None
    """The local model that runs it, or None for a peer."""
    peer: PeerModel | None = None
    selector: str = ""
    """The selector that picked ``name``, if any."""
    profile: str = ""
    """The profile whose pin rewrote the name, if any."""


def route(
    config: Config,
    requested: str,
    *,
    profile: str = "",
    states: Mapping[str, ModelState] | None = None,
    load: Callable[[str], int] | None = None,
) -> Route:
    """Resolve a requested name (see the module's docstring). Raises :class:`Unroutable`.

    ``states``: model id -> state (absent: stopped), for ``warm`` and ``spillover``.
    ``load``: a local model id or a peer model's ``peer/model`` -> requests of it waiting
    or running, for ``spillover``. Only a selector asks for either.
    """
    name = requested
    pinned_by = ""
    active = config.profiles.get(profile) if profile else None
    if active is not None and requested in active.pins:
        name = active.pins[requested]
        pinned_by = active.id
        if not name:
            raise Unroutable(requested, f"disabled by the active profile {active.id!r}")
    selector = config.selectors.get(name)
    chosen_by = ""
    if selector is not None:
        chosen_by = selector.id
        picked = pick_target(config, selector, states or {}, load or _no_load)
        if picked is None:
            raise Unroutable(
                requested, f"selector {selector.id!r} has no available spillover target", 503
            )
        name = picked
    model = config.resolve(name)
    if model is not None:
        return Route(requested, name, model=model, selector=chosen_by, profile=pinned_by)
    peer = config.peer_routes.get(name)
    if peer is not None:
        return Route(requested, name, peer=peer, selector=chosen_by, profile=pinned_by)
    raise Unroutable(requested)


def _no_load(_: str) -> int:
    return 0


def target_key(config: Config, target: str) -> tuple[str, bool]:
    """A selector target's model id (local) or ``peer/model`` (remote), and whether local."""
    local = config.resolve(target)
    if local is not None:
        return local.id, True
    peer = config.peer_routes[target]
    return peer.fqn, False


def pick_target(
    config: Config,
    selector: Selector,
    states: Mapping[str, ModelState],
    load: Callable[[str], int],
) -> str | None:
    """The target a selector picks now (as written in its ``targets``); None when a
    ``spillover`` selector has none it can use (every local target is stopping)."""
    if selector.strategy == STRATEGY_WARM:
        keys = [target_key(config, t)[0] for t in selector.targets]
        return selector.targets[choose_warm([states.get(k, ModelState.STOPPED) for k in keys])]
    if selector.strategy == STRATEGY_SPILLOVER:
        slots: list[tuple[ModelState | None, int]] = []
        for target in selector.targets:
            key, local = target_key(config, target)
            slots.append((states.get(key, ModelState.STOPPED) if local else None, load(key)))
        index = choose_spillover(slots, selector.spillover)
        return None if index is None else selector.targets[index]
    return selector.targets[0]  # pin


def choose_warm(states: Sequence[ModelState]) -> int:
    """``warm``: the first target that is ready, else the first one starting, else the
    first (it is cold-started). Pure: the targets' states in target order."""
    for wanted in (ModelState.READY, ModelState.STARTING):
        for i, state in enumerate(states):
            if state is wanted:
                return i
    return 0


def choose_spillover(slots: Sequence[tuple[ModelState | None, int]], spillover: int) -> int | None:
    """``spillover``: which target takes the next request, or None when none can.

    ``slots`` are the targets in order, each ``(state, load)``: ``state`` None for a peer
    model (always available), ``load`` the requests of it waiting or running. A local
    target that is stopping is skipped. A target is *active* when it is loaded or starting,
    or has load; else *cold*. The least-loaded active target (the first of equals) takes
    the request while its load is under ``spillover``; once every active one has
    ``spillover``, the first cold target is started; with none left, the least-loaded
    active one takes it anyway. With nothing active, the first cold target.
    """
    active: list[int] = []
    cold: list[int] = []
    for i, (state, load) in enumerate(slots):
        if state is ModelState.STOPPING:
            continue
        if state in (ModelState.READY, ModelState.STARTING) or load > 0:
            active.append(i)
        else:
            cold.append(i)
    if not active:
        return cold[0] if cold else None
    least = min(active, key=lambda i: slots[i][1])
    if slots[least][1] < spillover or not cold:
        return least
    return cold[0]


# --------------------------------------------------------------------------- parsing


def expand_set_params_keys(
    model: dict[str, Any], scope: MacroScope, key: str, budget: _Budget
) -> None:
    """Macros in the keys of ``filters.setParamsByID`` (``${MODEL_ID}:high``), as
    llama-swap expands them: in the model's scope, last declared first. In place."""
    filters = model.get("filters")
    if not isinstance(filters, Mapping) or not isinstance(filters.get("setParamsByID"), Mapping):
        return
    expanded: dict[str, Any] = {}
    originals: dict[str, str] = {}
    for raw_key, params in filters["setParamsByID"].items():
        name = expand_macros(str(raw_key), scope, f"{key}.filters.setParamsByID", budget, typed=False)
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
    for raw_id, params in _mapping(value, key).items():
        name = str(raw_id)
        path = f"{key}.{name}"
        if not name.strip():
            raise ConfigError(path, "keys must not be empty")
        left = _MACRO_LEFT.search(name)
        if left is not None:
            if left.group(1) == "PORT":
                raise ConfigError(path, "${PORT} is not available in setParamsByID keys")
            raise ConfigError(path, f"unknown macro '${{{left.group(1)}}}' in the key")
        values = _mapping(params, path)
        result[name] = MappingProxyType(
            {str(k): v for k, v in values.items() if str(k) not in PROTECTED_PARAMS}
        )
    return result


def derived_aliases(model_id: str, explicit: Sequence[str], by_id: Mapping[str, Any]) -> tuple[str, ...]:
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
    for raw_id, settings in _mapping(value, "peers").items():
        peer_id = str(raw_id)
        key = f"peers.{peer_id}"
        if not peer_id.strip():
            raise ConfigError(key, "peer ids must not be empty")
        if settings is None or not isinstance(settings, Mapping):
            raise ConfigError(key, "must be a mapping with proxy and models")
        _warn_unknown(settings, key, set(_PEER_KEYS), warnings)
        proxy = _string(_default(settings.get("proxy"), ""), f"{key}.proxy").strip()
        if not proxy:
            raise ConfigError(f"{key}.proxy", "required: the peer's base URL")
        check_url(proxy, f"{key}.proxy")
        listed = _string_list(settings.get("models"), f"{key}.models")
        names: list[str] = []
        for i, name in enumerate(listed):
            if not name.strip():
                raise ConfigError(f"{key}.models[{i}]", "model names must not be empty")
            if name not in names:
                names.append(name)
        if not names:
            raise ConfigError(f"{key}.models", "peer models can not be empty")
        filters = _mapping(settings.get("filters"), f"{key}.filters")
        _warn_unknown(filters, f"{key}.filters", set(_PEER_FILTER_KEYS), warnings)
        strip_text = filters.get("stripParams") or filters.get("strip_params") or ""
        set_params = {
            str(k): v
            for k, v in _mapping(filters.get("setParams"), f"{key}.filters.setParams").items()
            if str(k) not in PROTECTED_PARAMS
        }
        raw_timeouts = dict(_mapping(settings.get("timeouts"), f"{key}.timeouts"))
        raw_timeouts.setdefault("responseHeader", 60)  # llama-swap's peer default
        raw_timeouts.setdefault("idle", 0)  # ours; off for peers unless set
        timeouts = _model_timeouts(raw_timeouts, f"{key}.timeouts", warnings)
        peers[peer_id] = Peer(
            id=peer_id,
            proxy=proxy,
            models=tuple(names),
            api_key=_header_value(settings.get("apiKey"), f"{key}.apiKey"),
            strip_params=_strip_params(_string(strip_text, f"{key}.filters.stripParams")),
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
    text = _string(_default(value, ""), key).strip()
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
    section = _mapping(value, "selectors")
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
        body = _mapping(settings, key)
        _warn_unknown(body, key, set(_SELECTOR_KEYS), warnings)
        strategy = _string(_default(body.get("strategy"), ""), f"{key}.strategy").strip()
        if not strategy:
            raise ConfigError(f"{key}.strategy", "required (warn, pin or spillover)")
        if strategy not in STRATEGIES:
            raise ConfigError(
                f"{key}.strategy",
                f"unknown strategy {strategy!r} (valid: {', '.join(STRATEGIES)})",
            )
        targets = _string_list(body.get("targets"), f"{key}.targets")
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
                        path, f"duplicate resolved model {resolved!r} (also targets[{seen[resolved]}])"
                    )
                seen[resolved] = i
        options = _mapping(body.get("settings"), f"{key}.settings")
        _warn_unknown(options, f"{key}.settings", {"spillover"}, warnings)
        spillover = _int(
            _default(options.get("spillover"), DEFAULT_SPILLOVER), f"{key}.settings.spillover"
        )
        if strategy == STRATEGY_SPILLOVER and spillover < 1:
            raise ConfigError(f"{key}.settings.spillover", f"must be >= 1, got {spillover}")
        selectors[sel_id] = Selector(
            id=sel_id,
            strategy=strategy,
            targets=tuple(targets),
            spillover=spillover,
            name=_string(_default(body.get("name"), ""), f"{key}.name"),
            description=_string(_default(body.get("description"), ""), f"{key}.description"),
            unlisted=_bool(_default(body.get("unlisted"), False), f"{key}.unlisted"),
            metadata=MappingProxyType(dict(_mapping(body.get("metadata"), f"{key}.metadata"))),
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
    for raw_id, settings in _mapping(value, "profiles").items():
        profile_id = str(raw_id)
        key = f"profiles.{profile_id}"
        if not profile_id.strip():
            raise ConfigError(key, "profile names cannot be empty")
        if not isinstance(settings, Mapping):
            raise ConfigError(
                key,
                f"must be a mapping with description and pins, got {_kind(settings)}; "
                "the legacy list syntax is no longer supported",
            )
        _warn_unknown(settings, key, set(_PROFILE_KEYS), warnings)
        pins_raw = _mapping(settings.get("pins"), f"{key}.pins")
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
            target = "" if raw_target is None else _string(raw_target, path)
            if target and not (_resolves(target, models, aliases, routes) or target in selectors):
                raise ConfigError(path, f"references unknown model {target!r}")
            pins[pin] = target
        profiles[profile_id] = Profile(
            id=profile_id,
            description=_string(_default(settings.get("description"), ""), f"{key}.description"),
            pins=MappingProxyType(pins),
        )
    return profiles
