"""The :class:`Config` and the entry points, :func:`load_config` and
:func:`parse_config`: the top-level keys, the phases (environment, macros, models, the
sections), and the defaults of the top-level settings."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, cast

from scheduler.config.access import (
    RequestLimits,
    Security,
    read_api_keys,
    read_request_limits,
    read_security,
)
from scheduler.config.macros import (
    Budget,
    check_expanded,
    expand_env,
    macro_scope,
    read_macros,
    substitute_all,
)
from scheduler.config.models import (
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_UNLOAD_TIMEOUT,
    ModelConfig,
    ModelDefaults,
    alias_map,
    assign_ports,
    build_model,
    check_derived_aliases,
    prepare_models,
)
from scheduler.config.peers import Peer, PeerModel, Profile, Selector, parse_names
from scheduler.config.reading import check_size, read_yaml
from scheduler.config.routing import (
    QueueBounds,
    read_lanes,
    read_preload,
    read_queue_bounds,
    read_router,
    read_scheduler_settings,
)
from scheduler.config.server import (
    DEFAULT_UPSTREAM_ALLOW_PATHS,
    DEFAULT_UPSTREAM_IGNORE_PATHS,
    LOG_LEVELS,
    LOG_TO_STDOUT,
    PathPattern,
    compile_re2,
    read_log_time_format,
    read_upstream_allow_paths,
    read_upstream_ignore_paths,
)
from scheduler.config.values import (
    ConfigError,
    kind_of,
    known_keys,
    or_default,
    read_bool,
    read_int,
    read_number,
    read_string,
)
from scheduler.core.lanes import DEFAULT_LANE
from scheduler.core.policy import (
    SchedulerSettings,
)
from scheduler.core.swapper import (
    GroupSwapper,
    Swapper,
)
from scheduler.keys import ApiKey

MIN_HEALTH_CHECK_TIMEOUT = 15
"""llama-swap raises anything lower to this."""


DEFAULT_START_PORT = 5800


# Top-level keys we read, and llama-swap's keys we knowingly ignore (with why).
_TOP_LEVEL_KEYS = frozenset(
    {
        "healthCheckTimeout",
        "logLevel",
        "startPort",
        "globalTTL",
        "unloadTimeout",
        "macros",
        "models",
        "hooks",
        "routing",
        "limits",
        "apiKeys",
        "includeAliasesInList",
        "upstream",
        "security",
        "logToStdout",
        "logTimeFormat",
        "sendLoadingState",
        "captureBuffer",
        "globalConcurrencyLimit",
        "profiles",
        "selectors",
        "peers",
        "groups",
        "matrix",
    }
)


_IGNORED_TOP_LEVEL = {
    "logRequests": "not supported",
    "metricsMaxInMemory": "not supported",
    "store": "not supported",
    "ui": "not supported",
    "performance": "not supported",
}


@dataclass(frozen=True)
class Config:
    models: Mapping[str, ModelConfig]
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """alias -> model id."""
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    bounds: QueueBounds = field(default_factory=QueueBounds)
    limits: RequestLimits = field(default_factory=RequestLimits)
    health_check_timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT
    start_port: int = DEFAULT_START_PORT
    global_ttl: int = 0
    unload_timeout: float = DEFAULT_UNLOAD_TIMEOUT
    log_level: str = "info"
    log_to_stdout: str = "proxy"
    """``logToStdout``: proxy, upstream, both or none (see :data:`LOG_TO_STDOUT`)."""
    log_time_format: str = ""
    """``logTimeFormat``: one of :data:`LOG_TIME_FORMATS`, or "" for the default timestamp."""
    include_aliases_in_list: bool = False
    """``includeAliasesInList``: ``/v1/models`` lists each alias as its own record."""
    global_concurrency_limit: int = 0
    """``globalConcurrencyLimit`` (llama-swap #1086): most inference requests in the
    server at once, waiting or answered, every model and peer together; one more gets
    429 at once (proxy/views.py). 0: no limit."""
    capture_buffer_mb: int = 0
    """``captureBuffer``: MB of memory for request/response captures (web/captures.py);
    0, our default (llama-swap's is 5), captures nothing."""
    upstream_ignore_paths: tuple[PathPattern, ...] = (compile_re2(DEFAULT_UPSTREAM_IGNORE_PATHS),)
    """``upstream.ignorePaths``: a ``/upstream/<model>/<path>`` whose path matches one
    (searched, unanchored, as Go's ``MatchString``) never loads the model: 409 unless it
    is already loaded."""
    upstream_allow_paths: tuple[PathPattern, ...] = field(
        default_factory=lambda: tuple(compile_re2(p) for p in DEFAULT_UPSTREAM_ALLOW_PATHS)
    )
    """``upstream.allowPaths``: the paths ``/upstream/<model>/<path>`` may reach (searched,
    as ``ignorePaths``); any other is refused with 403 before a turn is taken."""
    security: Security = field(default_factory=Security)
    preload: tuple[str, ...] = ()
    api_keys: Mapping[str, ApiKey] = field(default_factory=lambda: MappingProxyType({}))
    """``apiKeys``: the key as written (env and macros expanded) -> its name and priority
    rule. Empty: requests need no key (llama-swap's default)."""
    router: Swapper = field(default=cast(Swapper, None))
    """``routing.router`` (or the legacy top-level ``groups``/``matrix``): which resident
    models a model's start evicts. Default: every model in llama-swap's ``(default)``
    group, one model at a time."""
    lanes: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """``routing.scheduler.settings.serial.lanes`` (our extension): lane name -> its model
    ids, the named lanes in config order, then :data:`DEFAULT_LANE` with every other model
    (absent when no model is left for it). Default: one lane holding every model."""
    lane_of: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Model id -> its lane's name; every model has one."""
    profiles: Mapping[str, Profile] = field(default_factory=lambda: MappingProxyType({}))
    """``profiles``: switched at run time (none active at start), see scheduler/names.py."""
    selectors: Mapping[str, Selector] = field(default_factory=lambda: MappingProxyType({}))
    peers: Mapping[str, Peer] = field(default_factory=lambda: MappingProxyType({}))
    peer_routes: Mapping[str, PeerModel] = field(default_factory=lambda: MappingProxyType({}))
    """Every name a peer model answers to: ``peer/model``, and ``model`` when one peer has it."""
    warnings: tuple[str, ...] = ()
    """One line per ignored, not yet supported key (ui, store, ...) or adjusted value."""
    source: str = ""
    """The file it came from."""

    def __post_init__(self) -> None:
        # A Config built by hand (tests, benches) gets llama-swap's defaults.
        if self.router is None:
            object.__setattr__(self, "router", GroupSwapper.default(self.models))
        if not self.lanes:
            object.__setattr__(self, "lanes", MappingProxyType({DEFAULT_LANE: tuple(self.models)}))
            object.__setattr__(
                self, "lane_of", MappingProxyType(dict.fromkeys(self.models, DEFAULT_LANE))
            )

    def resolve(self, name: str) -> ModelConfig | None:
        """The model for an id or an alias."""
        model = self.models.get(name)
        if model is None and name in self.aliases:
            model = self.models[self.aliases[name]]
        return model


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and parse a llama-swap ``config.yaml``. Raises :class:`ConfigError`.

    File-level problems (missing file, YAML syntax, duplicate keys) carry the file name as
    their key and the line number in the message.
    """
    source = os.fspath(path)
    data = read_yaml(source)
    return parse_config({} if data is None else data, source=source)


def parse_config(
    data: Mapping[str, Any],
    source: str = "",
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build a :class:`Config` from a parsed YAML document, with llama-swap's defaults.

    ``environ`` answers ``${env.NAME}``; it defaults to ``os.environ``. Raises
    :class:`ConfigError` naming the key path of the first problem found.
    """
    env = os.environ if environ is None else environ
    if not isinstance(data, Mapping):
        raise ConfigError("", f"the config must be a mapping of settings, got {kind_of(data)}")
    check_size(data, source)  # before anything walks it: aliases may stand for gigabytes
    budget = Budget()
    warnings: list[str] = []

    raw = known_keys(data, "", _TOP_LEVEL_KEYS, _IGNORED_TOP_LEVEL, warnings)

    # Phase 1: ${env.NAME} everywhere we read, before any macro sees the values.
    raw = {key: expand_env(value, key, env, budget) for key, value in raw.items()}

    # Phase 2: global macros over everything but the models, which get their own scope.
    macros = read_macros(raw.pop("macros", None), "macros")
    top = {
        key: substitute_all(value, macro_scope(macros), key, budget)
        for key, value in raw.items()
        if key != "models"
    }
    for key, value in top.items():
        check_expanded(value, key, allow_pid=False)

    health_check_timeout = read_number(
        or_default(top.get("healthCheckTimeout"), DEFAULT_HEALTH_CHECK_TIMEOUT),
        "healthCheckTimeout",
    )
    if health_check_timeout < MIN_HEALTH_CHECK_TIMEOUT:
        warnings.append(
            f"healthCheckTimeout: {health_check_timeout:g} is below the minimum of "
            f"{MIN_HEALTH_CHECK_TIMEOUT}; using {MIN_HEALTH_CHECK_TIMEOUT}"
        )
        health_check_timeout = MIN_HEALTH_CHECK_TIMEOUT
    start_port = read_int(or_default(top.get("startPort"), DEFAULT_START_PORT), "startPort", 1)
    if start_port > 65535:
        raise ConfigError("startPort", f"must be a TCP port 1..65535, got {start_port}")
    global_ttl = read_int(or_default(top.get("globalTTL"), 0), "globalTTL", 0)
    unload_timeout = read_number(or_default(top.get("unloadTimeout"), 0), "unloadTimeout")
    unload_timeout = unload_timeout or DEFAULT_UNLOAD_TIMEOUT  # 0 means the default
    log_level = read_string(or_default(top.get("logLevel"), "info"), "logLevel").strip().lower()
    if log_level not in LOG_LEVELS:
        warnings.append(
            f"logLevel: unknown level {log_level!r} (use one of {', '.join(LOG_LEVELS)}); "
            "using info"
        )
        log_level = "info"

    log_to_stdout = read_string(or_default(top.get("logToStdout"), "proxy"), "logToStdout")
    if log_to_stdout not in LOG_TO_STDOUT:
        raise ConfigError(
            "logToStdout", f"must be one of {', '.join(LOG_TO_STDOUT)}, got {log_to_stdout!r}"
        )
    log_time_format = read_log_time_format(top.get("logTimeFormat"), warnings)
    include_aliases = read_bool(
        or_default(top.get("includeAliasesInList"), False), "includeAliasesInList"
    )
    capture_buffer = read_int(or_default(top.get("captureBuffer"), 0), "captureBuffer", 0)
    global_limit = read_int(
        or_default(top.get("globalConcurrencyLimit"), 0), "globalConcurrencyLimit", 0
    )
    ignore_paths = read_upstream_ignore_paths(top.get("upstream"), warnings)
    allow_paths = read_upstream_allow_paths(top.get("upstream"))

    # Phase 3: each model with its own macro scope, then ${PORT} in sorted id order.
    prepared = prepare_models(raw.get("models"), macros, warnings, budget)
    assign_ports(prepared, start_port)
    for model_id, model in prepared.items():
        for name, value in model.items():
            check_expanded(value, f"models.{model_id}.{name}", allow_pid=name == "cmdStop")

    defaults = ModelDefaults(
        ttl=global_ttl,
        unload_timeout=unload_timeout,
        health_check_timeout=health_check_timeout,
        send_loading_state=read_bool(
            or_default(top.get("sendLoadingState"), False), "sendLoadingState"
        ),
    )
    models = {
        model_id: build_model(model_id, model, defaults, warnings)
        for model_id, model in prepared.items()
    }
    check_derived_aliases(models)
    aliases = alias_map(models)
    names = parse_names(top, models, aliases, warnings)
    scheduler = read_scheduler_settings(top.get("routing"), models, aliases, warnings)
    router = read_router(top, models, aliases, warnings)
    lanes, lane_of = read_lanes(top.get("routing"), models, aliases, router)

    return Config(
        models=MappingProxyType(models),
        aliases=MappingProxyType(aliases),
        scheduler=scheduler,
        bounds=read_queue_bounds(top.get("routing"), scheduler.use),
        limits=read_request_limits(top.get("limits"), warnings),
        health_check_timeout=health_check_timeout,
        start_port=start_port,
        global_ttl=global_ttl,
        unload_timeout=unload_timeout,
        log_level=log_level,
        log_to_stdout=log_to_stdout,
        log_time_format=log_time_format,
        include_aliases_in_list=include_aliases,
        capture_buffer_mb=capture_buffer,
        global_concurrency_limit=global_limit,
        upstream_ignore_paths=ignore_paths,
        upstream_allow_paths=allow_paths,
        security=read_security(top.get("security"), warnings),
        preload=read_preload(top.get("hooks"), models, aliases, warnings),
        router=router,
        lanes=lanes,
        lane_of=lane_of,
        api_keys=MappingProxyType(read_api_keys(top.get("apiKeys"))),
        profiles=names.profiles,
        selectors=names.selectors,
        peers=names.peers,
        peer_routes=names.peer_routes,
        warnings=tuple(warnings),
        source=source,
    )
