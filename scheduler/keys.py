"""API keys: who may use the box, and what priority each key may claim. Pure: no Django.

llama-swap's ``apiKeys`` is a list of strings; here an entry may also be a mapping with a
``name``, the ``key`` and a ``priority`` rule (the spec's free/pro/max tiers are such
rules)::

    apiKeys:
      - "sk-plain-llama-swap-key"            # name "key-1", no priority rule, inference only
      - name: batch-farm
        key: ${env.BATCH_KEY}
        priority: {default: batch, ceiling: normal, offset: 0}
      - name: ops
        key: ${env.OPS_KEY}
        scopes: [inference, models, profiles, operator, metrics]

The rule, applied to the ``X-LlamaSwap-Priority`` header:

* ``default``: the priority when the header is absent or unparseable (else 0);
* ``ceiling``: the header cannot claim more than this (the request is not refused: it
  runs at the ceiling, and its record keeps what was asked for);
* ``offset``: added after the ceiling (a tier bonus that breaks ties inside a band).

What a key may reach is its :class:`Scope` set: inference only unless the key is granted
more (``web.access`` maps every path to the scope it needs). A box "stays keyed"
(:attr:`KeyRing.required`): once any key has been in force, removing the last one does not
open it; only an operator's explicit act does (control/keys.py keeps that in the
database).

A key is presented as llama-swap reads it: the password of ``Authorization: Basic``, then
``Authorization: Bearer``, then ``x-api-key``. Keys are looked up by their SHA-256 digest,
so a :class:`KeyRing` holds no key in the clear once built and admin-issued keys (stored
hashed) join the same lookup.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from scheduler.core.priority import parse_priority, parse_priority_or_none


class Scope(StrEnum):
    """What a key may reach. Declared once; ``web.access.PATH_SCOPES`` says which
    path needs which."""

    INFERENCE = "inference"
    """The OpenAI endpoints, ``/v1/models``, ``/running``, ``/upstream``, reading
    ``/api/profiles``: using the models, never changing what others get."""
    MODELS = "models"
    """``/unload``, ``/api/models/unload[/{model}]``: stopping models (another user's
    answer included)."""
    PROFILES = "profiles"
    """``PUT /api/profiles/active``: switching the active profile for everyone."""
    OPERATOR = "operator"
    """``/api/queue``, ``/logs``, ``/logs/stream``, ``/api/metrics/activity``,
    ``/api/requests/{id}``: other users' requests, prompts in model output, key names."""
    METRICS = "metrics"
    """``/metrics``: counters and gauges only, so a Prometheus scraper reads no prompt."""


ALL_SCOPES: frozenset[Scope] = frozenset(Scope)
DEFAULT_SCOPES: frozenset[Scope] = frozenset({Scope.INFERENCE})
"""A key given no scopes (llama-swap's plain string keys included): inference only."""


def missing_scope_message(scope: Scope, path: str, key_name: str) -> str:
    """The 403's message: which scope the key lacks, and how to grant it."""
    return (
        f"API key {key_name!r} lacks the scope {scope.value!r} that {path} needs; "
        f"grant it in the key's scopes (apiKeys[].scopes, or the admin's issued key)"
    )


@dataclass(frozen=True)
class KeyPolicy:
    """What priority a key's requests may have (see the module docstring)."""

    default: int | None = None
    ceiling: int | None = None
    offset: int = 0

    def grant(self, header: str | bytes | None) -> tuple[int, int | None]:
        """``(granted, requested)``: the priority the request runs at, and what the caller
        asked for when the ceiling cut it (else None)."""
        asked = parse_priority_or_none(header)
        if asked is None:
            asked = self.default if self.default is not None else 0
        granted, cut = asked, None
        if self.ceiling is not None and asked > self.ceiling:
            granted, cut = self.ceiling, asked
        return granted + self.offset, cut


@dataclass(frozen=True)
class ApiKey:
    """One key's identity and rule; never the key itself."""

    name: str
    policy: KeyPolicy = field(default_factory=KeyPolicy)
    source: str = "config"
    """``config`` (the YAML) or ``admin`` (issued in the admin)."""
    scopes: frozenset[Scope] = DEFAULT_SCOPES
    """What the key may reach (:class:`Scope`)."""

    def allows(self, scope: Scope) -> bool:
        return scope in self.scopes


def priority_of(key: ApiKey | None, header: str | bytes | None) -> tuple[int, int | None, str]:
    """``(priority, requested, key name)`` a request runs at: its header's priority without a
    key; with one, the key's rule (its default when the header is absent, its ceiling, its
    offset: :meth:`KeyPolicy.grant`). HTTP requests and relayed websockets alike."""
    if key is None:
        return parse_priority(header), None, ""
    granted, requested = key.policy.grant(header)
    return granted, requested, key.name


def digest(key: str) -> str:
    """The SHA-256 hex digest a key is looked up (and stored) by."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """Every key in force: the config's and the admin's. Lookups cost one hash and one
    dict access, never a database query; :meth:`set_admin_keys` replaces the admin part
    when an operator creates or revokes a key.

    Once it has held a key the ring stays :attr:`required` when the last one goes (a
    revoked or deleted key, a config reload without ``apiKeys``): every key-needing path
    then refuses everyone but staff sessions until :meth:`set_required` turns it off, an
    operator's explicit act. ``on_required`` is called when the ring becomes required by
    itself (a key arrived), so the composition can persist it; it must not block.
    """

    def __init__(self, config_keys: Mapping[str, ApiKey] | None = None) -> None:
        self._config = {digest(k): v for k, v in (config_keys or {}).items()}
        self._admin: dict[str, ApiKey] = {}
        self._all: Mapping[str, ApiKey] = MappingProxyType(dict(self._config))
        self._required = bool(self._all)
        self.on_required: Callable[[], None] | None = None

    @property
    def enabled(self) -> bool:
        """Are keys required? (Any key in force, or the box stays keyed: :attr:`required`.)"""
        return self._required or bool(self._all)

    @property
    def required(self) -> bool:
        """Has access control been turned on and not explicitly off since?"""
        return self._required

    @property
    def has_config_keys(self) -> bool:
        return bool(self._config)

    def set_required(self, required: bool) -> None:
        """Turn access control on or off on purpose (the admin's act, or the stored state
        at start). Off opens the box only when no key is in force."""
        self._required = required

    def _keys_changed(self) -> None:
        if self._all and not self._required:
            self._required = True
            if self.on_required is not None:
                self.on_required()

    def lookup(self, presented: str | None) -> ApiKey | None:
        if not presented:
            return None
        return self._all.get(digest(presented))

    def set_config_keys(self, config_keys: Mapping[str, ApiKey]) -> None:
        """The config's ``apiKeys`` after a reload (the admin-issued ones stay)."""
        self._config = {digest(k): v for k, v in config_keys.items()}
        self._all = MappingProxyType({**self._admin, **self._config})
        self._keys_changed()

    def set_admin_keys(self, digests: Mapping[str, ApiKey]) -> None:
        """The admin-issued keys in force, by :func:`digest` (revoked ones left out)."""
        self._admin = dict(digests)
        self._all = MappingProxyType({**self._admin, **self._config})
        self._keys_changed()

    def names(self) -> list[str]:
        return sorted({k.name for k in self._all.values()})


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key a request presents, as llama-swap reads it: the password of
    ``Authorization: Basic``, then ``Authorization: Bearer``, then ``x-api-key``."""
    authorization = api_key = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == b"authorization" and authorization is None:
            authorization = value
        elif lowered == b"x-api-key" and api_key is None:
            api_key = value
    if authorization is not None:
        scheme, _, credentials = authorization.strip().partition(b" ")
        scheme = scheme.lower()
        credentials = credentials.strip()
        if scheme == b"basic":
            try:
                decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                decoded = ""
            _, sep, password = decoded.partition(":")
            if sep and password:
                return password
        elif scheme == b"bearer" and credentials:
            return credentials.decode("latin-1")
    if api_key is not None and api_key.strip():
        return api_key.strip().decode("latin-1")
    return None
