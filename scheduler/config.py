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
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shlex
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import urlsplit

import re2
import yaml

from scheduler.core.lanes import DEFAULT_LANE
from scheduler.core.policy import (
    DEFAULT_AGING_DIVISOR,
    DEFAULT_SWAP_AFFINITY_BONUS,
    KEY_FIFO,
    SETTINGS_PREFIX,
    Policy,
    SchedulerSettings,
    SettingsError,
)
from scheduler.core.priority import BANDS, parse_priority_or_none
from scheduler.core.swapper import (
    DEFAULT_GROUP,
    Group,
    GroupError,
    GroupSwapper,
    MatrixError,
    MatrixSwapper,
    Swapper,
)
from scheduler.keys import DEFAULT_SCOPES, ApiKey, KeyPolicy
from scheduler.keys import Scope as KeyScope

if TYPE_CHECKING:
    from scheduler.names import Peer, PeerModel, Profile, Selector

DEFAULT_HEALTH_CHECK_TIMEOUT = 120
MIN_HEALTH_CHECK_TIMEOUT = 15
"""llama-swap raises anything lower to this."""
DEFAULT_START_PORT = 5800
DEFAULT_UNLOAD_TIMEOUT = 10
DEFAULT_CONCURRENCY_LIMIT = 10
DEFAULT_CHECK_ENDPOINT = "/health"
DEFAULT_PROXY = "http://localhost:${PORT}"
INHERIT_TTL = -1
"""A model ``ttl`` of -1 (llama-swap's default) means "use ``globalTTL``"."""
LOG_LEVELS = ("debug", "info", "warn", "error")
RESERVED_MACROS = frozenset({"PORT", "MODEL_ID", "PID"})
PROTECTED_PARAMS = frozenset({"model"})
"""Request parameters that filters may never strip or set: routing depends on them."""

# What loading a config may cost. A few KB of YAML aliases (``&a [*b, *b, ...]``), macros
# that use each other or ``${env.NAME}`` repeated can stand for gigabytes; these bounds
# are far above any real config (llama-swap's example is 5 KB, 50 models are ~20 KB) and
# keep a hostile or mistaken one to a few seconds and a few hundred MB.
MAX_CONFIG_BYTES = 1024 * 1024
"""The most bytes of YAML read for one config, all of its sources together."""
MAX_CONFIG_VALUES = 200_000
"""The most values (scalars, lists, mappings and keys) once YAML aliases are expanded:
a node used through an alias counts at every use."""
MAX_CONFIG_CHARS = 16 * 1024 * 1024
"""The most characters of text once YAML aliases are expanded."""
MAX_EXPANSION_CHARS = 4 * 1024 * 1024
"""The most characters ``${env.NAME}`` and macro expansion may write and scan in all (each
expansion step counting at least :data:`_STEP_COST`)."""
MAX_CONFIG_DEPTH = 64
"""The deepest nesting of lists and mappings."""

_MACRO_NAME = re.compile(r"[a-zA-Z0-9_-]+")
_MACRO_USE = re.compile(r"\$\{([a-zA-Z0-9_-]+)\}")
_ENV_USE = re.compile(r"\$\{env\.([a-zA-Z_][a-zA-Z0-9_]*)\}")
_INT_TEXT = re.compile(r"[-+]?[0-9]+")
_FLOAT_TEXT = re.compile(r"[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")

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
    "captureBuffer": "request captures are not supported",
    "store": "not supported",
    "ui": "not supported",
    "performance": "not supported",
}
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
    }
)
_IGNORED_MODEL_KEYS = {
    "compat": "not supported",
    "healthCheckTimeout": "per-model value is not supported; the global one applies",
}
_CAPABILITY_KEYS = frozenset({"in", "out", "tools", "reranker", "context"})
MODALITIES = ("text", "audio", "image")
"""What ``capabilities.in`` and ``.out`` accept (llama-swap's list)."""
LOG_TO_STDOUT = ("proxy", "upstream", "both", "none")
"""``logToStdout``: whose log lines go to stdout (llama-swap's values; default proxy)."""
LOG_TIME_FORMATS = (
    "ansic",
    "unixdate",
    "rubydate",
    "rfc822",
    "rfc822z",
    "rfc850",
    "rfc1123",
    "rfc1123z",
    "rfc3339",
    "rfc3339nano",
    "kitchen",
    "stamp",
    "stampmilli",
    "stampmicro",
    "stampnano",
)
"""``logTimeFormat``: the Go time-layout names llama-swap accepts (case-insensitive);
:mod:`llamaswap_site.logfmt` renders each."""
DEFAULT_UPSTREAM_IGNORE_PATHS = r".*\.(js|json|css|png|gif|jpg|jpeg|ico|txt)$"
"""llama-swap's ``upstream.ignorePaths`` when the list is empty or absent."""
DEFAULT_UPSTREAM_ALLOW_PATHS = (
    r"^/$",
    r"^/(v1/)?(chat/completions|completions|responses|messages|messages/count_tokens"
    r"|embeddings|rerank|reranking|models|audio/speech|audio/transcriptions"
    r"|audio/translations|images/generations|images/edits)$",
    r"^/(completion|infill|embedding|tokenize|detokenize|apply-template|props|health)$",
    r"^(/[A-Za-z0-9_~-][A-Za-z0-9_.~-]*)*/[A-Za-z0-9_~-][A-Za-z0-9_.~-]*"
    r"\.(html|js|mjs|css|map|json|png|gif|jpg|jpeg|svg|ico|webp|woff|woff2|ttf|txt|webmanifest)$",
)
"""``upstream.allowPaths`` when the list is empty or absent: what a model's web UI and API
clients use (the root page, static files, the OpenAI and Anthropic routes, llama-server's
native inference routes, ``/props`` and ``/health``); not its operator endpoints
(``/slots``, ``/metrics``, ``/lora-adapters``, ``/cors-proxy``, ``/tools``,
``/models/load``; fakellm's ``/fake/requests``). Static file names start with no dot: no
dot segments, no hidden files."""


class PathPattern(Protocol):
    """A compiled ``upstream.ignorePaths`` pattern (an RE2 regexp: linear in the path)."""

    pattern: str

    def search(self, text: str) -> object: ...


def _compile_re2(pattern: str) -> PathPattern:
    """``pattern`` as RE2 (Go's regexp semantics, matching in time linear in the input;
    Python's backtracking ``re`` took seconds on ``.*\\.(js|...)$`` against a path of
    16,000 dots). Raises ``re2.error``; RE2's own logging of it is off (the ConfigError
    says it)."""
    options = re2.Options()
    options.log_errors = False
    return cast(PathPattern, re2.compile(pattern, options=options))


_FILTER_KEYS = frozenset({"stripParams", "strip_params", "setParams", "setParamsByID"})
_SCHEDULER_KEYS = frozenset({"use", "settings"})
_TIMEOUT_KEYS = {  # config key -> ModelTimeouts field
    "connect": "connect",
    "keepalive": "keepalive",
    "responseHeader": "response_header",
    "tlsHandshake": "tls_handshake",
    "expectContinue": "expect_continue",
    "idleConn": "idle_conn",
    "idle": "idle",
}
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
_BOUND_KEYS = frozenset({"maxQueueDepth", "maxWait"})
"""Accepted under both ``routing.scheduler.settings.serial`` and ``.fifo``."""


class ConfigError(ValueError):
    """A config problem that stops startup; ``key`` is the key path (e.g. ``models.qwen.cmd``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


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
class QueueBounds:
    """``maxQueueDepth`` and ``maxWait`` from ``routing.scheduler.settings.serial``/``.fifo``."""

    max_queue_depth: int | None = None
    """Most requests waiting at once; None is unbounded."""
    max_wait: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Band value (``interactive``, ``normal``, ``batch``) -> most seconds a request of that
    band may wait; a band not in it waits unbounded."""


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
    unload_timeout: float = 10
    """Seconds between SIGTERM and SIGKILL."""
    health_check_timeout: float = 120
    use_model_name: str = ""
    name: str = ""
    description: str = ""
    unlisted: bool = False
    concurrency_limit: int = 10
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


@dataclass(frozen=True)
class Config:
    models: Mapping[str, ModelConfig]
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """alias -> model id."""
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    bounds: QueueBounds = field(default_factory=QueueBounds)
    limits: RequestLimits = field(default_factory=RequestLimits)
    health_check_timeout: float = 120
    start_port: int = 5800
    global_ttl: int = 0
    unload_timeout: float = 10
    log_level: str = "info"
    log_to_stdout: str = "proxy"
    """``logToStdout``: proxy, upstream, both or none (see :data:`LOG_TO_STDOUT`)."""
    log_time_format: str = ""
    """``logTimeFormat``: one of :data:`LOG_TIME_FORMATS`, or "" for the default timestamp."""
    include_aliases_in_list: bool = False
    """``includeAliasesInList``: ``/v1/models`` lists each alias as its own record."""
    upstream_ignore_paths: tuple[PathPattern, ...] = (
        _compile_re2(DEFAULT_UPSTREAM_IGNORE_PATHS),
    )
    """``upstream.ignorePaths``: a ``/upstream/<model>/<path>`` whose path matches one
    (searched, unanchored, as Go's ``MatchString``) never loads the model: 409 unless it
    is already loaded."""
    upstream_allow_paths: tuple[PathPattern, ...] = field(
        default_factory=lambda: tuple(_compile_re2(p) for p in DEFAULT_UPSTREAM_ALLOW_PATHS)
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


# --------------------------------------------------------------------------- entry points


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and parse a llama-swap ``config.yaml``. Raises :class:`ConfigError`.

    File-level problems (missing file, YAML syntax, duplicate keys) carry the file name as
    their key and the line number in the message.
    """
    source = os.fspath(path)
    data = read_yaml(source)
    return parse_config({} if data is None else data, source=source)


def read_yaml(source: str, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """One YAML file, parsed strictly (duplicate keys are errors), of at most ``max_bytes``.
    Raises :class:`ConfigError` keyed by the file name, with the line number in the message.

    What its aliases expand to is not measured yet: the caller runs :func:`check_size`
    before walking it (:func:`parse_config` does)."""
    try:
        # At most one byte past the bound: --config /dev/zero must not fill the memory.
        with open(source, "rb") as file:
            raw = file.read(max_bytes + 1)
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(source, "config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, f"cannot read the config file: {exc}") from None
    if len(raw) > max_bytes:
        raise ConfigError(
            source,
            f"larger than {max_bytes} bytes"
            + (" (what is left of the config's bound)" if max_bytes < MAX_CONFIG_BYTES else "")
            + f"; a config is at most {MAX_CONFIG_BYTES} bytes in all",
        )
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown line"
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(source, f"YAML syntax error at {where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, f"YAML syntax error: {exc}") from None
    except (ValueError, RecursionError) as exc:
        # A scalar PyYAML cannot build: a date like 2001-02-30, an integer of more than
        # 4300 digits (Python's int conversion limit); or nesting past the interpreter's
        # recursion limit (the pure-Python parser).
        raise ConfigError(source, f"YAML value error: {exc}") from None
    return data


def check_size(data: Any, source: str = "") -> tuple[int, int]:
    """Refuse a parsed document that is too big to process once its YAML aliases are
    expanded (:data:`MAX_CONFIG_VALUES`, :data:`MAX_CONFIG_CHARS`), nested deeper than
    :data:`MAX_CONFIG_DEPTH`, or that contains itself (a recursive alias, ``&a [*a]``).

    Linear in the document as written: a node reached through aliases is measured once
    and counted at each use. The error names the smallest key whose expansion passes the
    bound (or ``source`` for the whole document), and the file in its message. Returns
    the document's values and characters, aliases expanded.
    """
    if not isinstance(data, dict | list | tuple):
        return 1, len(data) if isinstance(data, str) else 0
    measured: dict[int, tuple[int, int]] = {}  # id(container) -> (values, chars) in it
    open_ids = {id(data)}  # the containers on the current path: one met again is a cycle
    # One frame per open container: [container, its children, values, chars, path].
    frames: list[list[Any]] = [[data, _items(data), 1, 0, ""]]
    in_file = f" (in {source})" if source else ""

    def refuse(path: str, why: str) -> ConfigError:
        return ConfigError(path or source, f"{why}{in_file}")

    while frames:
        frame = frames[-1]
        item = next(frame[1], None)
        if item is None:
            frames.pop()
            open_ids.discard(id(frame[0]))
            measured[id(frame[0])] = (frame[2], frame[3])
            if not frames:
                return frame[2], frame[3]
            parent = frames[-1]
            parent[2] += frame[2]
            parent[3] += frame[3]
        else:
            label, child, key_chars = item
            frame[2] += 0 if key_chars is None else 1
            frame[3] += key_chars or 0
            path = f"{frame[4]}{label}" if label.startswith("[") or not frame[4] else f"{frame[4]}.{label}"
            if isinstance(child, dict | list | tuple):  # tuples: !!pairs, !!omap
                if id(child) in open_ids:
                    raise refuse(path, "contains itself (a recursive YAML alias)")
                known = measured.get(id(child))
                if known is None:
                    if len(frames) >= MAX_CONFIG_DEPTH:
                        raise refuse(path, f"nested deeper than {MAX_CONFIG_DEPTH} levels")
                    open_ids.add(id(child))
                    frames.append([child, _items(child), 1, 0, path])
                    continue
                frame[2] += known[0]
                frame[3] += known[1]
            else:
                frame[2] += 1
                frame[3] += len(child) if isinstance(child, str) else 0
        if frame[2] > MAX_CONFIG_VALUES:
            raise refuse(
                frame[4],
                f"holds more than {MAX_CONFIG_VALUES} values once its YAML aliases are "
                "expanded (each use of an alias counts)",
            )
        if frame[3] > MAX_CONFIG_CHARS:
            raise refuse(
                frame[4],
                f"holds more than {MAX_CONFIG_CHARS} characters of text once its YAML "
                "aliases are expanded (each use of an alias counts)",
            )
    raise AssertionError("unreachable: the root frame returns")


def _items(container: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> Any:
    """(label, child, characters of its key or None) for each entry of a list or mapping."""
    if isinstance(container, dict):
        return (
            (str(k), v, len(k) if isinstance(k, str) else 0) for k, v in container.items()
        )
    return ((f"[{i}]", v, None) for i, v in enumerate(container))


def parse_config(
    data: Mapping[str, Any],
    source: str = "",
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build a :class:`Config` from a parsed YAML document, with llama-swap's defaults.

    ``environ`` answers ``${env.NAME}``; it defaults to ``os.environ``. Raises
    :class:`ConfigError` naming the key path of the first problem found.
    """
    from scheduler import names as names_mod  # it imports this module

    env = os.environ if environ is None else environ
    if not isinstance(data, Mapping):
        raise ConfigError("", f"the config must be a mapping of settings, got {_kind(data)}")
    check_size(data, source)  # before anything walks it: aliases may stand for gigabytes
    budget = _Budget()
    warnings: list[str] = []

    raw: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key)
        if key in _TOP_LEVEL_KEYS:
            raw[key] = value
        elif key in _IGNORED_TOP_LEVEL:
            warnings.append(f"{key}: {_IGNORED_TOP_LEVEL[key]}; ignored")
        else:
            warnings.append(f"{key}: unknown key; ignored")

    # Phase 1: ${env.NAME} everywhere we read, before any macro sees the values.
    raw = {key: _expand_env(value, key, env, budget) for key, value in raw.items()}

    # Phase 2: global macros over everything but the models, which get their own scope.
    macros = _read_macros(raw.pop("macros", None), "macros")
    top = {
        key: _substitute_all(value, _scope(macros), key, budget)
        for key, value in raw.items()
        if key != "models"
    }
    for key, value in top.items():
        _check_expanded(value, key, allow_pid=False)

    health_check_timeout = _number(
        _default(top.get("healthCheckTimeout"), DEFAULT_HEALTH_CHECK_TIMEOUT),
        "healthCheckTimeout",
    )
    if health_check_timeout < MIN_HEALTH_CHECK_TIMEOUT:
        warnings.append(
            f"healthCheckTimeout: {health_check_timeout:g} is below the minimum of "
            f"{MIN_HEALTH_CHECK_TIMEOUT}; using {MIN_HEALTH_CHECK_TIMEOUT}"
        )
        health_check_timeout = MIN_HEALTH_CHECK_TIMEOUT
    start_port = _int(_default(top.get("startPort"), DEFAULT_START_PORT), "startPort", 1)
    if start_port > 65535:
        raise ConfigError("startPort", f"must be a TCP port 1..65535, got {start_port}")
    global_ttl = _int(_default(top.get("globalTTL"), 0), "globalTTL", 0)
    unload_timeout = _number(_default(top.get("unloadTimeout"), 0), "unloadTimeout")
    unload_timeout = unload_timeout or DEFAULT_UNLOAD_TIMEOUT  # 0 means the default
    log_level = _string(_default(top.get("logLevel"), "info"), "logLevel").strip().lower()
    if log_level not in LOG_LEVELS:
        warnings.append(
            f"logLevel: unknown level {log_level!r} (use one of {', '.join(LOG_LEVELS)}); "
            "using info"
        )
        log_level = "info"

    log_to_stdout = _string(_default(top.get("logToStdout"), "proxy"), "logToStdout")
    if log_to_stdout not in LOG_TO_STDOUT:
        raise ConfigError(
            "logToStdout", f"must be one of {', '.join(LOG_TO_STDOUT)}, got {log_to_stdout!r}"
        )
    log_time_format = _log_time_format(top.get("logTimeFormat"), warnings)
    include_aliases = _bool(
        _default(top.get("includeAliasesInList"), False), "includeAliasesInList"
    )
    ignore_paths = _upstream_ignore_paths(top.get("upstream"), warnings)
    allow_paths = _upstream_allow_paths(top.get("upstream"))

    # Phase 3: each model with its own macro scope, then ${PORT} in sorted id order.
    prepared = _prepare_models(raw.get("models"), macros, warnings, budget)
    _assign_ports(prepared, start_port)
    for model_id, model in prepared.items():
        for name, value in model.items():
            _check_expanded(value, f"models.{model_id}.{name}", allow_pid=name == "cmdStop")

    defaults = _ModelDefaults(
        ttl=global_ttl,
        unload_timeout=unload_timeout,
        health_check_timeout=health_check_timeout,
        send_loading_state=_bool(_default(top.get("sendLoadingState"), False), "sendLoadingState"),
    )
    models = {
        model_id: _build_model(model_id, model, defaults, warnings)
        for model_id, model in prepared.items()
    }
    names_mod.check_derived_aliases(models)
    aliases = _alias_map(models)
    names = names_mod.parse_names(top, models, aliases, warnings)
    scheduler = _scheduler_settings(top.get("routing"), models, aliases, warnings)
    router = _router(top, models, aliases, warnings)
    lanes, lane_of = _lanes(top.get("routing"), models, aliases, router)

    return Config(
        models=MappingProxyType(models),
        aliases=MappingProxyType(aliases),
        scheduler=scheduler,
        bounds=_queue_bounds(top.get("routing"), scheduler.use),
        limits=_request_limits(top.get("limits"), warnings),
        health_check_timeout=health_check_timeout,
        start_port=start_port,
        global_ttl=global_ttl,
        unload_timeout=unload_timeout,
        log_level=log_level,
        log_to_stdout=log_to_stdout,
        log_time_format=log_time_format,
        include_aliases_in_list=include_aliases,
        upstream_ignore_paths=ignore_paths,
        upstream_allow_paths=allow_paths,
        security=_security(top.get("security"), warnings),
        preload=_preload(top.get("hooks"), models, aliases, warnings),
        router=router,
        lanes=lanes,
        lane_of=lane_of,
        api_keys=MappingProxyType(_api_keys(top.get("apiKeys"))),
        profiles=names.profiles,
        selectors=names.selectors,
        peers=names.peers,
        peer_routes=names.peer_routes,
        warnings=tuple(warnings),
        source=source,
    )


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


# --------------------------------------------------------------------------- YAML


_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser when PyYAML has it: 4-5x faster than the pure-Python one on a large
config, and it refuses nesting past 1000 levels instead of recursing."""


class _StrictLoader(_SafeLoader):  # type: ignore[misc]  # yaml has no type hints here
    """SafeLoader that rejects a key defined twice in one mapping, as llama-swap's YAML does.

    PyYAML silently keeps the last one, which would hide a duplicated model id. Keys that
    arrive through a ``<<:`` merge may be overridden, so only explicit keys are compared.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            ident = (key_node.tag, key_node.value)
            if ident in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key_node.value!r} is defined twice (first on line {seen[ident]})",
                    key_node.start_mark,
                )
            seen[ident] = key_node.start_mark.line + 1
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


# --------------------------------------------------------------------------- macros


_STEP_COST = 256
"""What one macro expansion step spends at least: its fixed cost in characters' worth, so
that a long chain of macros over short text is bounded in time too."""


class _Budget:
    """The characters ``${env.NAME}`` and macro expansion may still write and scan for one
    config (:data:`MAX_EXPANSION_CHARS`). Each is linear in its input, but macros that use
    each other (``b: ${a}${a}``, ``c: ${b}${b}``, ...) double the text at every step, and a
    long variable may be used many times: the expansion stops with a ConfigError naming
    the key it was expanding once the budget is spent."""

    def __init__(self, chars: int = MAX_EXPANSION_CHARS) -> None:
        self.left = chars

    def spend(self, chars: int, key: str) -> None:
        self.left -= chars
        if self.left < 0:
            raise ConfigError(
                key,
                f"${{env.NAME}} and macro expansion would write more than {MAX_EXPANSION_CHARS} "
                "characters for this config (macros that use each other many times?)",
            )


def _expand_env(value: Any, key: str, environ: Mapping[str, str], budget: _Budget) -> Any:
    """``${env.NAME}`` replaced in every string below ``value``."""
    if isinstance(value, str):
        if "${env." not in value:
            return value
        budget.spend(len(value), key)

        def lookup(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in environ:
                raise ConfigError(key, f"environment variable '{name}' is not set")
            budget.spend(len(environ[name]), key)  # before the text is built
            return environ[name]

        expanded = _ENV_USE.sub(lookup, value)
        if expanded != value and _ENV_USE.fullmatch(value):
            # llama-swap substitutes into the YAML text, so `startPort: ${env.BASE}` is an int.
            return _yaml_scalar(expanded)
        return expanded
    if isinstance(value, Mapping):
        return {k: _expand_env(v, f"{key}.{k}", environ, budget) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{key}[{i}]", environ, budget) for i, v in enumerate(value)]
    return value


def _yaml_scalar(text: str) -> Any:
    if _INT_TEXT.fullmatch(text):
        return int(text)
    if _FLOAT_TEXT.fullmatch(text):
        return float(text)
    return text


def _read_macros(value: Any, key: str) -> list[tuple[str, Any]]:
    """Macro declarations in declaration order (that order decides what may use what)."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping of macro name to value, got {_kind(value)}")
    macros: list[tuple[str, Any]] = []
    for raw_name, macro in value.items():
        name = str(raw_name)
        path = f"{key}.{name}"
        if len(name) >= 64:
            raise ConfigError(path, "macro names must be shorter than 64 characters")
        if not _MACRO_NAME.fullmatch(name):
            raise ConfigError(path, "macro names may only use letters, digits, '_' and '-'")
        if name in RESERVED_MACROS:
            raise ConfigError(path, f"'{name}' is reserved: llamaswap sets ${{{name}}} itself")
        if isinstance(macro, str):
            if f"${{{name}}}" in macro:
                raise ConfigError(path, f"macro '{name}' refers to itself")
        elif not isinstance(macro, bool | int | float):
            raise ConfigError(path, f"must be a string, number or boolean, got {_kind(macro)}")
        macros.append((name, macro))
    return macros


MacroScope = Mapping[str, tuple[int, Any]]
"""Macros in force: name -> (place in the declaration order, value)."""


def _scope(macros: list[tuple[str, Any]]) -> dict[str, tuple[int, Any]]:
    """The global macros as a :data:`MacroScope`."""
    return {name: (i, value) for i, (name, value) in enumerate(macros)}


def _model_scope(
    model_id: str, global_scope: dict[str, tuple[int, Any]], model_macros: list[tuple[str, Any]]
) -> MacroScope:
    """A model's scope: MODEL_ID (declared first), the globals, its own macros overriding
    globals in place and the new ones after them. Built without copying the globals, so a
    config of many models and many macros costs their sum, not their product."""
    own: dict[str, tuple[int, Any]] = {"MODEL_ID": (-1, model_id)}
    for j, (name, value) in enumerate(model_macros):
        place = global_scope[name][0] if name in global_scope else len(global_scope) + j
        own[name] = (place, value)
    return ChainMap(own, global_scope)


def _substitute_all(value: Any, scope: MacroScope, key: str, budget: _Budget) -> Any:
    """Every string below ``value`` with its macros expanded (:func:`expand_macros`)."""
    if isinstance(value, str):
        return expand_macros(value, scope, key, budget) if "${" in value else value
    if isinstance(value, Mapping):
        return {k: _substitute_all(v, scope, f"{key}.{k}", budget) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute_all(v, scope, f"{key}[{i}]", budget) for i, v in enumerate(value)]
    return value


def expand_macros(
    text: str, scope: MacroScope, key: str, budget: _Budget, typed: bool = True
) -> Any:
    """``text`` with the macros of ``scope`` expanded, last declared first: a macro's value
    is itself expanded by every macro declared before it, which is how "macros may use
    previously declared macros" works (a use of a later one stays, and is reported).

    Applying every macro in turn would cost macros x text; only the ones ``text`` uses are
    applied, the latest first, which gives the same result: a macro applied puts in uses of
    earlier macros only, the ones still to come. With ``typed``, a value that is exactly
    ``${name}`` becomes the macro's value with its type (``ttl: ${ttl}`` is an int).
    Spends ``budget`` on what it scans and writes."""
    value: Any = text
    below = math.inf  # the place of the macro applied last: only earlier ones follow
    while isinstance(value, str) and "${" in value:
        budget.spend(max(len(value), _STEP_COST), key)
        best: tuple[str, int, Any] | None = None
        for name in set(_MACRO_USE.findall(value)):
            entry = scope.get(name)
            if entry is not None and entry[0] < below and (best is None or entry[0] > best[1]):
                best = (name, *entry)
        if best is None:
            break
        name, below, replacement = best
        slug = f"${{{name}}}"
        if typed and value == slug:
            value = replacement  # the whole value: keep the macro's type
            continue
        written = _format(replacement)
        budget.spend(len(value) + value.count(slug) * max(0, len(written) - len(slug)), key)
        value = value.replace(slug, written)
    return value


def _substitute(value: Any, name: str, replacement: Any) -> Any:
    slug = f"${{{name}}}"
    if isinstance(value, str):
        if value == slug:
            return replacement  # the whole value: keep the macro's type
        return value.replace(slug, _format(replacement)) if slug in value else value
    if isinstance(value, Mapping):
        return {k: _substitute(v, name, replacement) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, name, replacement) for v in value]
    return value


def _format(value: Any) -> str:
    """A macro value inside a string, written as llama-swap (Go's ``%v``) writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return str(value)


def _check_expanded(value: Any, key: str, allow_pid: bool) -> None:
    """Raise for any ``${name}`` still in ``value`` (``${PID}`` allowed in cmdStop)."""
    if isinstance(value, str):
        for match in _MACRO_USE.finditer(value):
            name = match.group(1)
            if name == "PID":
                if allow_pid:
                    continue
                raise ConfigError(key, "${PID} is only available in cmdStop")
            if name == "PORT":
                raise ConfigError(key, "${PORT} is only assigned to models whose cmd uses ${PORT}")
            raise ConfigError(
                key,
                f"unknown macro '${{{name}}}': define it under macros "
                "(a macro may only use macros declared before it)",
            )
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_expanded(v, f"{key}.{k}", allow_pid)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_expanded(v, f"{key}[{i}]", allow_pid)


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class _ModelDefaults:
    ttl: int
    unload_timeout: float
    health_check_timeout: float
    send_loading_state: bool = False


def _prepare_models(
    value: Any, global_macros: list[tuple[str, Any]], warnings: list[str], budget: _Budget
) -> dict[str, dict[str, Any]]:
    """Each model's raw settings with comments stripped and its macros expanded."""
    from scheduler import names as names_mod  # it imports this module

    if value is None:
        raise ConfigError("models", "required: a mapping of model id to model settings")
    if not isinstance(value, Mapping):
        raise ConfigError(
            "models", f"must be a mapping of model id to settings, got {_kind(value)}"
        )
    if not value:
        raise ConfigError("models", "no models defined")
    global_scope = _scope(global_macros)
    prepared: dict[str, dict[str, Any]] = {}
    for raw_id, settings in value.items():
        model_id = str(raw_id)
        key = f"models.{model_id}"
        if not model_id.strip():
            raise ConfigError(key, "model ids must not be empty")
        if not isinstance(settings, Mapping):
            raise ConfigError(key, f"must be a mapping of model settings, got {_kind(settings)}")
        model: dict[str, Any] = {}
        for raw_name, setting in settings.items():
            name = str(raw_name)
            if name in _MODEL_KEYS:
                model[name] = setting
            elif name in _IGNORED_MODEL_KEYS:
                warnings.append(f"{key}.{name}: {_IGNORED_MODEL_KEYS[name]}; ignored")
            else:
                warnings.append(f"{key}.{name}: unknown model key; ignored")
        model_macros = _read_macros(model.pop("macros", None), f"{key}.macros")
        if model.get("cmd") is None:
            raise ConfigError(f"{key}.cmd", "required: the command that starts the model's server")
        # Comments go before expansion: a macro mentioned in a comment is not an error.
        for name in ("cmd", "cmdStop"):
            if isinstance(model.get(name), str):
                model[name] = _strip_comment_lines(model[name])
        if model.get("proxy") is None:
            model["proxy"] = DEFAULT_PROXY
        scope = _model_scope(model_id, global_scope, model_macros)
        prepared[model_id] = _substitute_all(model, scope, key, budget)
        names_mod.expand_set_params_keys(prepared[model_id], scope, key, budget)
    return prepared


def _strip_comment_lines(text: str) -> str:
    return "\n".join(line for line in text.split("\n") if not line.strip().startswith("#"))


def _assign_ports(prepared: dict[str, dict[str, Any]], start_port: int) -> None:
    """Give ``${PORT}`` to each model whose cmd uses it, in sorted model-id order."""
    port = start_port
    for model_id in sorted(prepared):
        model = prepared[model_id]
        cmd = _string(model["cmd"], f"models.{model_id}.cmd")
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
            prepared[model_id] = _substitute(model, "PORT", port)
            port += 1


def _build_model(
    model_id: str, model: Mapping[str, Any], defaults: _ModelDefaults, warnings: list[str]
) -> ModelConfig:
    from scheduler import names as names_mod  # it imports this module

    key = f"models.{model_id}"
    cmd = _command(model["cmd"], f"{key}.cmd")
    if not cmd:
        raise ConfigError(f"{key}.cmd", "is empty")
    cmd_stop = None
    if model.get("cmdStop") is not None:
        cmd_stop = _command(model["cmdStop"], f"{key}.cmdStop") or None

    proxy = check_url(_string(model["proxy"], f"{key}.proxy").strip(), f"{key}.proxy")

    endpoint = _string(
        _default(model.get("checkEndpoint"), DEFAULT_CHECK_ENDPOINT), f"{key}.checkEndpoint"
    ).strip()
    check_endpoint = None if endpoint.lower() == "none" else endpoint
    if check_endpoint is not None and _UNSAFE_IN_URL.search(check_endpoint):
        raise ConfigError(
            f"{key}.checkEndpoint",
            f"must be a URL path without whitespace or control characters, got {check_endpoint!r}",
        )

    ttl = _int(_default(model.get("ttl"), INHERIT_TTL), f"{key}.ttl")
    if ttl < INHERIT_TTL:
        raise ConfigError(f"{key}.ttl", f"must be >= 0 (or -1 for globalTTL), got {ttl}")
    if ttl == INHERIT_TTL:
        ttl = defaults.ttl
    unload_timeout = _number(_default(model.get("unloadTimeout"), 0), f"{key}.unloadTimeout")
    concurrency = _int(_default(model.get("concurrencyLimit"), 0), f"{key}.concurrencyLimit", 0)

    filters = _mapping(model.get("filters"), f"{key}.filters")
    for name in filters:
        if name not in _FILTER_KEYS:
            warnings.append(f"{key}.filters.{name}: unknown filter; ignored")
    strip_text = filters.get("stripParams") or filters.get("strip_params") or ""
    strip_params = _strip_params(_string(strip_text, f"{key}.filters.stripParams"))
    set_params = {
        str(k): v
        for k, v in _mapping(filters.get("setParams"), f"{key}.filters.setParams").items()
        if str(k) not in PROTECTED_PARAMS
    }
    by_id = names_mod.set_params_by_id(
        filters.get("setParamsByID"), f"{key}.filters.setParamsByID"
    )
    explicit_aliases = tuple(_string_list(model.get("aliases"), f"{key}.aliases"))

    return ModelConfig(
        id=model_id,
        cmd=cmd,
        proxy=proxy,
        cmd_stop=cmd_stop,
        aliases=(*explicit_aliases, *names_mod.derived_aliases(model_id, explicit_aliases, by_id)),
        env=MappingProxyType(_environment(model.get("env"), f"{key}.env")),
        check_endpoint=check_endpoint,
        ttl=ttl,
        unload_timeout=unload_timeout or defaults.unload_timeout,
        health_check_timeout=defaults.health_check_timeout,
        use_model_name=_string(_default(model.get("useModelName"), ""), f"{key}.useModelName"),
        name=_string(_default(model.get("name"), ""), f"{key}.name"),
        description=_string(_default(model.get("description"), ""), f"{key}.description"),
        unlisted=_bool(_default(model.get("unlisted"), False), f"{key}.unlisted"),
        concurrency_limit=concurrency or DEFAULT_CONCURRENCY_LIMIT,
        metadata=MappingProxyType(dict(_mapping(model.get("metadata"), f"{key}.metadata"))),
        strip_params=strip_params,
        set_params=MappingProxyType(set_params),
        set_params_by_id=MappingProxyType(by_id),
        timeouts=_model_timeouts(model.get("timeouts"), f"{key}.timeouts", warnings),
        capabilities=_capabilities(model.get("capabilities"), f"{key}.capabilities", warnings),
        slots=_int(_default(model.get("slots"), 1), f"{key}.slots", 1),
        send_loading_state=_bool(
            _default(model.get("sendLoadingState"), defaults.send_loading_state),
            f"{key}.sendLoadingState",
        ),
    )


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
    caps = _mapping(value, key)
    _warn_unknown(caps, key, set(_CAPABILITY_KEYS), warnings)
    modalities: dict[str, tuple[str, ...]] = {}
    for name in ("in", "out"):
        listed = _string_list(caps.get(name), f"{key}.{name}")
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
        tools=_bool(_default(caps.get("tools"), False), f"{key}.tools"),
        reranker=_bool(_default(caps.get("reranker"), False), f"{key}.reranker"),
        context=_int(_default(caps.get("context"), 0), f"{key}.context", 0),
    )


def _model_timeouts(value: Any, key: str, warnings: list[str]) -> ModelTimeouts:
    """``timeouts``: llama-swap's transport timeouts plus ``idle``; each a number >= 0."""
    timeouts = _mapping(value, key)
    _warn_unknown(timeouts, key, set(_TIMEOUT_KEYS), warnings)
    values = {
        name: _number(timeouts[setting], f"{key}.{setting}")
        for setting, name in _TIMEOUT_KEYS.items()
        if timeouts.get(setting) is not None
    }
    return ModelTimeouts(**values)


def _command(value: Any, key: str) -> tuple[str, ...]:
    text = _string(value, key)
    if "\0" in text:  # no program takes one in its argv: refused here, not at each start
        raise ConfigError(key, "must not contain a NUL character")
    try:
        return split_command(text)
    except ValueError as exc:
        raise ConfigError(key, f"cannot split into arguments: {exc}") from None


def _strip_params(text: str) -> tuple[str, ...]:
    """llama-swap's comma-separated list: trimmed, deduplicated, sorted, never ``model``."""
    names = {name.strip() for name in text.split(",")}
    return tuple(sorted(name for name in names if name and name not in PROTECTED_PARAMS))


def _environment(value: Any, key: str) -> dict[str, str]:
    """llama-swap's ``env`` list of ``NAME=value`` strings; a later NAME wins."""
    env: dict[str, str] = {}
    for i, item in enumerate(_string_list(value, key)):
        name, sep, setting = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"{key}[{i}]", f"must look like NAME=value, got {item!r}")
        if "\0" in item:
            raise ConfigError(f"{key}[{i}]", "must not contain a NUL character")
        env[name] = setting
    return env


def _alias_map(models: Mapping[str, ModelConfig]) -> dict[str, str]:
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


def _real_model_id(
    name: str, models: Mapping[str, ModelConfig], aliases: Mapping[str, str]
) -> str | None:
    return name if name in models else aliases.get(name)


# --------------------------------------------------------------------------- global sections


def _preload(
    value: Any,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    warnings: list[str],
) -> tuple[str, ...]:
    """``hooks.on_startup.preload`` as model ids (aliases resolved, blanks and repeats dropped)."""
    hooks = _mapping(value, "hooks")
    for name in hooks:
        if name != "on_startup":
            warnings.append(f"hooks.{name}: unknown hook; ignored")
    on_startup = _mapping(hooks.get("on_startup"), "hooks.on_startup")
    for name in on_startup:
        if name != "preload":
            warnings.append(f"hooks.on_startup.{name}: unknown action; ignored")
    preload: list[str] = []
    names = _string_list(on_startup.get("preload"), "hooks.on_startup.preload")
    for i, name in enumerate(names):
        name = name.strip()
        if not name:
            continue
        model_id = _real_model_id(name, models, aliases)
        if model_id is None:
            raise ConfigError(f"hooks.on_startup.preload[{i}]", f"unknown model {name!r}")
        if model_id not in preload:
            preload.append(model_id)
    return tuple(preload)


def _scheduler_settings(
    value: Any,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    warnings: list[str],
) -> SchedulerSettings:
    """``routing.scheduler``; ``use`` defaults to serial (llama-swap's default is fifo)."""
    routing = _mapping(value, "routing")
    _warn_unknown(routing, "routing", {"scheduler", "router"}, warnings)
    scheduler = _mapping(routing.get("scheduler"), SETTINGS_PREFIX)
    _warn_unknown(scheduler, SETTINGS_PREFIX, {"use", "settings"}, warnings)
    settings = _mapping(scheduler.get("settings"), f"{SETTINGS_PREFIX}.settings")
    _warn_unknown(settings, f"{SETTINGS_PREFIX}.settings", {"serial", "fifo"}, warnings)
    serial_key = f"{SETTINGS_PREFIX}.settings.serial"
    serial = _mapping(settings.get("serial"), serial_key)
    _warn_unknown(
        serial,
        serial_key,
        {"agingDivisor", "swapAffinityBonus", "agingCap", "bandShare", "lanes", *_BOUND_KEYS},
        warnings,
    )
    fifo_key = f"{SETTINGS_PREFIX}.settings.fifo"
    fifo = _mapping(settings.get("fifo"), fifo_key)
    _warn_unknown(fifo, fifo_key, {"priority", *_BOUND_KEYS}, warnings)

    values: dict[str, Any] = {
        "use": _default(scheduler.get("use"), "serial"),
        "aging_divisor": _default(serial.get("agingDivisor"), DEFAULT_AGING_DIVISOR),
        "aging_cap": serial.get("agingCap"),
        "band_share": serial.get("bandShare"),
        "swap_affinity_bonus": _default(
            serial.get("swapAffinityBonus"), DEFAULT_SWAP_AFFINITY_BONUS
        ),
        "fifo_priority": fifo.get("priority"),
    }
    try:
        checked = SchedulerSettings.create(**values)
    except SettingsError as exc:
        raise ConfigError(exc.key, f"{exc.reason}, got {exc.value!r}") from None

    # Priorities are looked up by the model id a request resolves to, so an alias is
    # rewritten to its model's id; naming one model twice is ambiguous and an error.
    priorities: dict[str, int] = {}
    named_by: dict[str, str] = {}
    for name, priority in checked.fifo_priority.items():
        model_id = _real_model_id(name, models, aliases)
        if model_id is None:
            raise ConfigError(f"{KEY_FIFO}.{name}", f"unknown model {name!r}")
        if model_id in priorities:
            raise ConfigError(
                f"{KEY_FIFO}.{name}",
                f"model {model_id!r} already has a priority (as {named_by[model_id]!r})",
            )
        priorities[model_id] = priority
        named_by[model_id] = name
    return checked.with_changes(fifo_priority=priorities)


ROUTER_PREFIX = "routing.router"
KEY_LANES = f"{SETTINGS_PREFIX}.settings.serial.lanes"
_GROUP_KEYS = frozenset({"swap", "exclusive", "persistent", "members"})
_MATRIX_KEYS = frozenset({"vars", "evict_costs", "sets"})
_LANE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")


def _router(
    top: Mapping[str, Any],
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    warnings: list[str],
) -> Swapper:
    """``routing.router`` or the legacy top-level ``groups``/``matrix``, as llama-swap
    reads them: one form only, groups or matrix (not both), default every model in the
    ``(default)`` group."""
    router = _mapping(_mapping(top.get("routing"), "routing").get("router"), ROUTER_PREFIX)
    _warn_unknown(router, ROUTER_PREFIX, {"use", "settings"}, warnings)
    settings = _mapping(router.get("settings"), f"{ROUTER_PREFIX}.settings")
    _warn_unknown(settings, f"{ROUTER_PREFIX}.settings", {"groups", "matrix"}, warnings)
    groups = _mapping(settings.get("groups"), f"{ROUTER_PREFIX}.settings.groups")
    matrix = settings.get("matrix")
    legacy_groups = _mapping(top.get("groups"), "groups")
    legacy_matrix = top.get("matrix")

    # Present as llama-swap counts it: an empty groups mapping or a null matrix is absent.
    if legacy_matrix is not None or legacy_groups:
        legacy = "matrix" if legacy_matrix is not None else "groups"
        if router.get("use") not in (None, "") or matrix is not None or groups:
            raise ConfigError(
                legacy,
                "the legacy top-level groups/matrix cannot be used together with "
                f"{ROUTER_PREFIX}; move them under {ROUTER_PREFIX}.settings",
            )
        if legacy_matrix is not None and legacy_groups:
            raise ConfigError("matrix", "cannot be used together with groups; choose one")
        if legacy_matrix is not None:
            return _matrix(legacy_matrix, "matrix", models, aliases, warnings)
        return _groups(legacy_groups, "groups", models, warnings, aliases)

    use = _string(_default(router.get("use"), ""), f"{ROUTER_PREFIX}.use") or "group"
    if use == "matrix":
        if matrix is None:
            raise ConfigError(
                f"{ROUTER_PREFIX}.settings.matrix", f"required by {ROUTER_PREFIX}.use: matrix"
            )
        if groups:
            warnings.append(
                f"{ROUTER_PREFIX}.settings.groups: not used with {ROUTER_PREFIX}.use: matrix; "
                "ignored"
            )
        return _matrix(matrix, f"{ROUTER_PREFIX}.settings.matrix", models, aliases, warnings)
    if use == "group":
        if matrix is not None:
            warnings.append(
                f"{ROUTER_PREFIX}.settings.matrix: not used with {ROUTER_PREFIX}.use: group; "
                "ignored"
            )
        return _groups(groups, f"{ROUTER_PREFIX}.settings.groups", models, warnings, aliases)
    raise ConfigError(f"{ROUTER_PREFIX}.use", f"unknown router {use!r} (use group or matrix)")


def _groups(
    value: Mapping[str, Any],
    key: str,
    models: Mapping[str, ModelConfig],
    warnings: list[str],
    aliases: Mapping[str, str],
) -> GroupSwapper:
    """The configured groups, then ``(default)`` with every model in none.

    Members are model ids: llama-swap keys a group's processes by the member as written,
    so an alias there does not group the model it names; here it is an error.
    """
    groups: list[Group] = []
    group_of: dict[str, str] = {}
    for raw_name, raw_spec in value.items():
        name = str(raw_name)
        group_key = f"{key}.{name}"
        if name == DEFAULT_GROUP:
            raise ConfigError(
                group_key, f"{DEFAULT_GROUP} is the group of the models in no group; rename it"
            )
        spec = _mapping(raw_spec, group_key)
        _warn_unknown(spec, group_key, set(_GROUP_KEYS), warnings)
        members: list[str] = []
        for i, member in enumerate(_string_list(spec.get("members"), f"{group_key}.members")):
            member_key = f"{group_key}.members[{i}]"
            if member not in models:
                if member in aliases:
                    raise ConfigError(
                        member_key,
                        f"{member!r} is an alias of model {aliases[member]!r}; "
                        "members are model ids",
                    )
                raise ConfigError(member_key, f"unknown model {member!r}")
            if member in members:
                raise ConfigError(member_key, f"model {member!r} is listed twice in this group")
            if member in group_of:
                raise ConfigError(
                    member_key,
                    f"model {member!r} is in two groups: {group_of[member]!r} and {name!r}",
                )
            group_of[member] = name
            members.append(member)
        groups.append(
            Group(
                name,
                swap=_bool(_default(spec.get("swap"), True), f"{group_key}.swap"),
                exclusive=_bool(_default(spec.get("exclusive"), True), f"{group_key}.exclusive"),
                persistent=_bool(
                    _default(spec.get("persistent"), False), f"{group_key}.persistent"
                ),
                members=tuple(members),
            )
        )
    ungrouped = tuple(model_id for model_id in models if model_id not in group_of)
    if ungrouped:
        groups.append(Group(DEFAULT_GROUP, members=ungrouped))
    try:
        return GroupSwapper(groups)
    except GroupError as exc:  # checked above; kept for the swapper's own rules
        raise ConfigError(key, str(exc)) from None


def _matrix(
    value: Any,
    key: str,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    warnings: list[str],
) -> MatrixSwapper:
    """``matrix``: ``vars`` (short name -> model id), ``evict_costs``, ``sets`` (in order)."""
    spec = _mapping(value, key)
    _warn_unknown(spec, key, set(_MATRIX_KEYS), warnings)
    variables = {
        str(name): _string(model_id, f"{key}.vars.{name}")
        for name, model_id in _mapping(spec.get("vars"), f"{key}.vars").items()
    }
    costs = {
        str(name): _int(cost, f"{key}.evict_costs.{name}")
        for name, cost in _mapping(spec.get("evict_costs"), f"{key}.evict_costs").items()
    }
    sets = [
        (str(name), _string(_default(text, ""), f"{key}.sets.{name}"))
        for name, text in _mapping(spec.get("sets"), f"{key}.sets").items()
    ]
    try:
        return MatrixSwapper.compile(sets, models, variables, costs, aliases)
    except MatrixError as exc:
        raise ConfigError(f"{key}.{exc.where}" if exc.where else key, exc.message) from None


def _lanes(
    value: Any,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    router: Swapper,
) -> tuple[Mapping[str, tuple[str, ...]], Mapping[str, str]]:
    """``routing.scheduler.settings.serial.lanes``: lane name -> [group, model id or alias].

    Called after :func:`_scheduler_settings`, which checked the sections' shapes.
    """
    scheduler = _mapping(_mapping(value, "routing").get("scheduler"), SETTINGS_PREFIX)
    settings = _mapping(scheduler.get("settings"), f"{SETTINGS_PREFIX}.settings")
    serial = _mapping(settings.get("serial"), f"{SETTINGS_PREFIX}.settings.serial")
    group_members = (
        {group.name: group.members for group in router.groups}
        if isinstance(router, GroupSwapper)
        else {}
    )
    lanes: dict[str, tuple[str, ...]] = {}
    lane_of: dict[str, str] = {}
    for raw_name, members in _mapping(serial.get("lanes"), KEY_LANES).items():
        name = str(raw_name)
        lane_key = f"{KEY_LANES}.{name}"
        if not _LANE_NAME.fullmatch(name):
            raise ConfigError(
                lane_key,
                f"a lane name is a letter, then up to 31 letters, digits, '_', '-'; got {name!r}",
            )
        if not isinstance(members, list) or not members:
            raise ConfigError(
                lane_key,
                f"must be a non-empty list of groups, model ids or aliases, got {_kind(members)}",
            )
        on_lane: list[str] = []
        for i, item in enumerate(members):
            member_key = f"{lane_key}[{i}]"
            member = _string(item, member_key)
            if member in group_members:
                if member in models and member not in group_members[member]:
                    raise ConfigError(
                        member_key,
                        f"{member!r} is both a group and a model outside it; ambiguous",
                    )
                model_ids: tuple[str, ...] = group_members[member]
            else:
                model_id = _real_model_id(member, models, aliases)
                if model_id is None:
                    raise ConfigError(member_key, f"unknown group, model or alias {member!r}")
                model_ids = (model_id,)
            for model_id in model_ids:
                other = lane_of.get(model_id)
                if other is None:
                    lane_of[model_id] = name
                    on_lane.append(model_id)
                elif other != name:
                    raise ConfigError(
                        member_key, f"model {model_id!r} is on two lanes: {other!r} and {name!r}"
                    )
        lanes[name] = tuple(on_lane)
    rest = tuple(model_id for model_id in models if model_id not in lane_of)
    if rest or not lanes:
        lanes[DEFAULT_LANE] = lanes.get(DEFAULT_LANE, ()) + rest
        lane_of.update(dict.fromkeys(rest, DEFAULT_LANE))
    return MappingProxyType(lanes), MappingProxyType(lane_of)


def _queue_bounds(value: Any, use: Policy) -> QueueBounds:
    """``maxQueueDepth`` and ``maxWait`` from the serial and fifo sections.

    Both sections are checked. Each setting (``maxQueueDepth``, and each band of
    ``maxWait``) is taken from the section named by ``use`` if it sets it, else from the
    other one. Called after :func:`_scheduler_settings`, which checked the section shapes
    and warned about unknown keys.
    """
    settings = _mapping(_mapping(value, "routing").get("scheduler"), SETTINGS_PREFIX)
    settings = _mapping(settings.get("settings"), f"{SETTINGS_PREFIX}.settings")
    depth: int | None = None
    waits: dict[str, float] = {}
    # The section in use is read last, so its values win.
    for policy in [*(p for p in Policy if p is not use), use]:
        key = f"{SETTINGS_PREFIX}.settings.{policy.value}"
        section = _mapping(settings.get(policy.value), key)
        if section.get("maxQueueDepth") is not None:
            depth = _int(section["maxQueueDepth"], f"{key}.maxQueueDepth", 1)
        max_wait = _mapping(section.get("maxWait"), f"{key}.maxWait")
        for raw_band, seconds in max_wait.items():
            band = str(raw_band)
            band_key = f"{key}.maxWait.{band}"
            if band not in BANDS:
                names = ", ".join(BANDS)
                raise ConfigError(band_key, f"unknown band {band!r} (use one of {names})")
            if seconds is not None:
                waits[band] = _positive(seconds, band_key)
    ordered = {band.value: waits[band] for band in BANDS if band in waits}
    return QueueBounds(max_queue_depth=depth, max_wait=MappingProxyType(ordered))


# --------------------------------------------------------------------------- API keys


def _api_keys(value: Any) -> dict[str, ApiKey]:
    """``apiKeys``: a list of keys (llama-swap) or ``{name, key, priority, scopes}`` mappings.

    A plain key is named ``key-<position>`` (from 1). Keys must be non-empty and contain no
    whitespace; keys and names must be unique. A key without ``scopes`` (a plain string
    key included) may use inference only (:data:`scheduler.keys.DEFAULT_SCOPES`).
    """
    if value is None:
        return {}
    if not isinstance(value, list):
        raise ConfigError("apiKeys", f"must be a list of keys, got {_kind(value)}")
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
                else _string(entry["name"], f"{where}.name").strip()
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
                where, f"must be a key or a mapping of name, key and priority, got {_kind(entry)}"
            )
        key = check_api_key(_string(raw_key, key_path) if raw_key is not None else "", key_path)
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
        raise ConfigError(path, f"must be a list of scopes ({known}), got {_kind(value)}")
    if not value:
        raise ConfigError(path, f"must name at least one scope ({known}); leave it out for inference only")
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
    rule = _mapping(value, path)
    for name in rule:
        if name not in _KEY_POLICY_FIELDS:
            raise ConfigError(f"{path}.{name}", "unknown field (use default, ceiling and offset)")
    default = _priority_value(rule.get("default"), f"{path}.default")
    ceiling = _priority_value(rule.get("ceiling"), f"{path}.ceiling")
    offset = 0
    if rule.get("offset") is not None:
        offset = _int(rule["offset"], f"{path}.offset")
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
            f"must be an integer priority or interactive, normal or batch, got {_kind(value)}",
        )
    return parsed


def _log_time_format(value: Any, warnings: list[str]) -> str:
    """``logTimeFormat``: a Go layout name, lowercased; "" (unset) keeps the default stamp.

    llama-swap prints no timestamp for a name it does not know; we warn and keep ours.
    """
    name = _string(_default(value, ""), "logTimeFormat").strip().lower()
    if name and name not in LOG_TIME_FORMATS:
        warnings.append(
            f"logTimeFormat: unknown format {name!r} (use one of {', '.join(LOG_TIME_FORMATS)}); "
            "using the default timestamp"
        )
        return ""
    return name


def _upstream_ignore_paths(value: Any, warnings: list[str]) -> tuple[PathPattern, ...]:
    """``upstream.ignorePaths``: regular expressions; empty or absent: llama-swap's default.

    Compiled as RE2, as llama-swap compiles them (Go's regexp): the same syntax, and
    matching linear in the path whatever the pattern (no backtracking: a path any client
    sends must not cost quadratic time). What RE2 refuses (backreferences, lookarounds)
    is a ConfigError, as in llama-swap.
    """
    upstream = _mapping(value, "upstream")
    _warn_unknown(upstream, "upstream", {"ignorePaths", "allowPaths"}, warnings)
    patterns = _string_list(upstream.get("ignorePaths"), "upstream.ignorePaths")
    if not patterns:
        return (_compile_re2(DEFAULT_UPSTREAM_IGNORE_PATHS),)
    compiled: list[PathPattern] = []
    for i, pattern in enumerate(patterns):
        try:
            compiled.append(_compile_re2(pattern))
        except re2.error as exc:
            reason = exc.args[0] if exc.args else exc
            if isinstance(reason, bytes):
                reason = reason.decode("utf-8", "replace")
            raise ConfigError(
                f"upstream.ignorePaths[{i}]", f"invalid regular expression {pattern!r}: {reason}"
            ) from None
    return tuple(compiled)


def _upstream_allow_paths(value: Any) -> tuple[PathPattern, ...]:
    """``upstream.allowPaths`` (ours): regular expressions (RE2, searched as
    ``ignorePaths``) naming the paths ``/upstream/<model>/...`` may reach; empty or absent:
    :data:`DEFAULT_UPSTREAM_ALLOW_PATHS`. ``[".*"]`` lets every path through (llama-swap)."""
    upstream = _mapping(value, "upstream")
    patterns = _string_list(upstream.get("allowPaths"), "upstream.allowPaths")
    compiled: list[PathPattern] = []
    for i, pattern in enumerate(patterns or DEFAULT_UPSTREAM_ALLOW_PATHS):
        try:
            compiled.append(_compile_re2(pattern))
        except re2.error as exc:
            reason = exc.args[0] if exc.args else exc
            if isinstance(reason, bytes):
                reason = reason.decode("utf-8", "replace")
            raise ConfigError(
                f"upstream.allowPaths[{i}]", f"invalid regular expression {pattern!r}: {reason}"
            ) from None
    return tuple(compiled)


_CORS_KEYS_LATER = frozenset(
    {"allowCredentials", "allowedMethods", "allowedHeaders", "exposedHeaders", "maxAge"}
)
"""llama-swap's other ``security.cors`` keys: read (and warned about) but not applied yet."""
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _security(value: Any, warnings: list[str]) -> Security:
    """``security``: ``cors.allowedOrigins`` (llama-swap's key; entries ``scheme://host[:port]``
    or ``"*"``; default none here, any in llama-swap) and ``basicAuthChallenge`` (ours)."""
    security = _mapping(value, "security")
    _warn_unknown(security, "security", {"cors", "basicAuthChallenge"}, warnings)
    cors = _mapping(security.get("cors"), "security.cors")
    for name in cors:
        if name in _CORS_KEYS_LATER:
            warnings.append(f"security.cors.{name}: not supported yet; ignored")
        elif name != "allowedOrigins":
            warnings.append(f"security.cors.{name}: unknown key; ignored")
    origins: set[str] = set()
    any_origin = False
    entries = _string_list(cors.get("allowedOrigins"), "security.cors.allowedOrigins")
    for i, entry in enumerate(entries):
        if entry == "*":
            any_origin = True
        else:
            origins.add(_origin(entry, f"security.cors.allowedOrigins[{i}]"))
    challenge = _bool(
        _default(security.get("basicAuthChallenge"), False), "security.basicAuthChallenge"
    )
    return Security(frozenset(origins), any_origin, challenge)


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
            key, f"{text!r} must be a bare origin: no path (not even /), query, fragment, user or spaces"
        )
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    if port is None or port == _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{port}"


def _request_limits(value: Any, warnings: list[str]) -> RequestLimits:
    """``limits``: ``maxBodyBytes`` and ``maxJsonValues`` >= 1, and the client timeouts
    >= 0 (0 disables one)."""
    limits = _mapping(value, "limits")
    _warn_unknown(limits, "limits", set(_LIMIT_KEYS), warnings)
    values: dict[str, Any] = {}
    for setting, name in _LIMIT_KEYS.items():
        if limits.get(setting) is None:
            continue
        if setting in _LIMIT_COUNTS:
            values[name] = _int(limits[setting], f"limits.{setting}", 1)
        else:
            values[name] = _number(limits[setting], f"limits.{setting}")
    return RequestLimits(**values)


def _warn_unknown(
    section: Mapping[str, Any], key: str, known: set[str], warnings: list[str]
) -> None:
    for name in section:
        if name not in known:
            warnings.append(f"{key}.{name}: unknown key; ignored")


# --------------------------------------------------------------------------- typed values


def _default(value: Any, default: Any) -> Any:
    """YAML ``key:`` with no value is null; llama-swap treats it as unset."""
    return default if value is None else value


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    shown = repr(value)  # bounded by check_size; cut short for the message
    return f"{type(value).__name__} {shown if len(shown) <= 200 else shown[:200] + '...'}"


def _int(value: Any, key: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")
    return value


def _number(value: Any, key: str) -> float:
    """A number of seconds >= 0 (int or float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, f"must be a number of seconds, got {_kind(value)}")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(key, f"must be a finite number >= 0, got {value}")
    return value


def _positive(value: Any, key: str) -> float:
    """A number of seconds > 0."""
    seconds = _number(value, key)
    if seconds == 0:
        raise ConfigError(key, "must be > 0 (leave it out for no limit), got 0")
    return seconds


def _string(value: Any, key: str) -> str:
    # A YAML number decodes into a Go string field too (`name: 7` is "7").
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _format(value)
    raise ConfigError(key, f"must be a string, got {_kind(value)}")


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {_kind(value)}")
    return value


def _mapping(value: Any, key: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping, got {_kind(value)}")
    return value


def _string_list(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(key, f"must be a list, got {_kind(value)}")
    return [_string(item, f"{key}[{i}]") for i, item in enumerate(value)]
