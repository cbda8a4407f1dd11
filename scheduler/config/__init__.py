"""llama-swap's config.yaml, parsed once into frozen dataclasses.

Pure: no Django, no I/O beyond reading the file in :func:`load_config` (the environment
for ``${env.NAME}`` comes in as an argument of :func:`parse_config`).

The semantics are llama-swap's (its ``internal/config`` and ``config.example.yaml``):

* ``${env.NAME}`` is expanded first; an unset variable is an error.
* Macros are expanded last-declared first, so a macro may use any macro declared *before*
  it. A value that is exactly ``${name}`` takes the macro's type (``ttl: ${ttl}`` stays an
  int). A model's own ``macros`` override global ones of the same name. ``${MODEL_ID}`` is
  the model's id, ``${PORT}`` an automatic port, ``${PID}`` is left in ``cmdStop``.
* Comment lines are dropped from ``cmd``/``cmdStop`` *before* macro expansion, so a macro
  in a comment is neither expanded nor reported.
* ``${PORT}``: the models whose ``cmd`` uses it get ``startPort``, ``startPort + 1``, ...
  in sorted model-id order. A ``proxy`` using it (the default ``http://localhost:${PORT}``
  does) needs a ``cmd`` that uses it too.
* Any ``${name}`` left after expansion is an error naming its key.

Keys llamaswap does not implement (``ui``, ``store``, ...) are ignored, with one line
each in :attr:`Config.warnings`; so are unknown keys inside the sections read.

``routing.router`` (groups or matrix, or the legacy top-level ``groups``/``matrix``)
becomes :attr:`Config.router`, a :mod:`scheduler.core.swapper` policy, with llama-swap's
load errors: one form only, groups or matrix, a model in one group, members are model ids.

Extensions of llama-swap's format (it has none of these):

* ``models.<id>.timeouts.idle``: seconds without a byte from the model during a request
  before it is checked (the other ``timeouts`` keys are llama-swap's own, per model only).
* ``limits``: what a client may send (:class:`RequestLimits`).
* ``maxQueueDepth`` and ``maxWait`` under ``routing.scheduler.settings.serial`` and
  ``.fifo`` (:class:`QueueBounds`).
* ``apiKeys`` entries may be mappings ``{name, key, priority: {default, ceiling, offset}}``
  besides llama-swap's plain strings (:attr:`Config.api_keys`, :mod:`scheduler.keys`).
* ``routing.scheduler.settings.serial.lanes``: lane name -> groups, model ids or aliases;
  one serial queue per lane (:attr:`Config.lanes`, :attr:`Config.lane_of`).
* ``models.<id>.slots``: requests of the model a lane may run at once (serial).

The parsing is split by concern into the modules of this package: ``values`` (typed
readers, ConfigError), ``reading`` (YAML and its bounds), ``macros``, ``models``,
``peers`` (profiles, selectors, peers), ``routing`` (scheduler settings, router, lanes,
queue bounds), ``access`` (API keys, security, limits), ``server`` (logging, upstream
paths) and ``parse`` (Config, load_config, parse_config). Every public name is
re-exported here: import from ``scheduler.config``.
"""

from __future__ import annotations

from scheduler.config.access import (
    RequestLimits,
    Security,
    check_api_key,
    key_policy,
    key_scopes,
)
from scheduler.config.macros import (
    MAX_EXPANSION_CHARS,
    RESERVED_MACROS,
    MacroScope,
    expand_macros,
)
from scheduler.config.models import (
    DEFAULT_CHECK_ENDPOINT,
    DEFAULT_CONCURRENCY_LIMIT,
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_PROXY,
    DEFAULT_UNLOAD_TIMEOUT,
    INHERIT_TTL,
    MODALITIES,
    PROTECTED_PARAMS,
    Capabilities,
    ModelConfig,
    ModelTimeouts,
    check_url,
    split_command,
)
from scheduler.config.parse import (
    DEFAULT_START_PORT,
    MIN_HEALTH_CHECK_TIMEOUT,
    Config,
    load_config,
    parse_config,
)
from scheduler.config.peers import (
    Peer,
    PeerModel,
    Profile,
    Selector,
)
from scheduler.config.reading import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_CHARS,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_VALUES,
    check_size,
    read_yaml,
)
from scheduler.config.routing import (
    KEY_LANES,
    ROUTER_PREFIX,
    QueueBounds,
    resolve_fifo_priority,
)
from scheduler.config.server import (
    DEFAULT_UPSTREAM_ALLOW_PATHS,
    DEFAULT_UPSTREAM_IGNORE_PATHS,
    LOG_LEVELS,
    LOG_TIME_FORMATS,
    LOG_TO_STDOUT,
    PathPattern,
)
from scheduler.config.values import (
    ConfigError,
)
from scheduler.core.lanes import DEFAULT_LANE  # the lane of models on no named lane

__all__ = [
    "resolve_fifo_priority",
    "DEFAULT_LANE",
    "Capabilities",
    "Config",
    "ConfigError",
    "DEFAULT_CHECK_ENDPOINT",
    "DEFAULT_CONCURRENCY_LIMIT",
    "DEFAULT_HEALTH_CHECK_TIMEOUT",
    "DEFAULT_PROXY",
    "DEFAULT_START_PORT",
    "DEFAULT_UNLOAD_TIMEOUT",
    "DEFAULT_UPSTREAM_ALLOW_PATHS",
    "DEFAULT_UPSTREAM_IGNORE_PATHS",
    "INHERIT_TTL",
    "KEY_LANES",
    "LOG_LEVELS",
    "LOG_TIME_FORMATS",
    "LOG_TO_STDOUT",
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_CHARS",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_VALUES",
    "MAX_EXPANSION_CHARS",
    "MIN_HEALTH_CHECK_TIMEOUT",
    "MODALITIES",
    "MacroScope",
    "ModelConfig",
    "ModelTimeouts",
    "PROTECTED_PARAMS",
    "PathPattern",
    "Peer",
    "PeerModel",
    "Profile",
    "QueueBounds",
    "RESERVED_MACROS",
    "ROUTER_PREFIX",
    "RequestLimits",
    "Security",
    "Selector",
    "check_api_key",
    "check_size",
    "check_url",
    "expand_macros",
    "key_policy",
    "key_scopes",
    "load_config",
    "parse_config",
    "read_yaml",
    "split_command",
]
