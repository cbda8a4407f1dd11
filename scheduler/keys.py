"""API keys: who may use the box, and what priority each key may claim. Pure: no Django.

llama-swap's ``apiKeys`` is a list of strings; here an entry may also be a mapping with a
``name``, the ``key`` and a ``priority`` rule (the spec's free/pro/max tiers are such
rules)::

    apiKeys:
      - "sk-plain-llama-swap-key"            # name "key-1", no priority rule
      - name: batch-farm
        key: ${env.BATCH_KEY}
        priority: {default: batch, ceiling: normal, offset: 0}

The rule, applied to the ``X-LlamaSwap-Priority`` header:

* ``default``: the priority when the header is absent or unparseable (else 0);
* ``ceiling``: the header cannot claim more than this (the request is not refused: it
  runs at the ceiling, and its record keeps what was asked for);
* ``offset``: added after the ceiling (a tier bonus that breaks ties inside a band).

A key is presented as llama-swap reads it: the password of ``Authorization: Basic``, then
``Authorization: Bearer``, then ``x-api-key``. Keys are looked up by their SHA-256 digest,
so a :class:`KeyRing` holds no key in the clear once built and admin-issued keys (stored
hashed) join the same lookup.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from scheduler.core.priority import parse_priority_or_none


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


def digest(key: str) -> str:
    """The SHA-256 hex digest a key is looked up (and stored) by."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """Every key in force: the config's and the admin's. Lookups cost one hash and one
    dict access, never a database query; :meth:`set_admin_keys` replaces the admin part
    when an operator creates or revokes a key."""

    def __init__(self, config_keys: Mapping[str, ApiKey] | None = None) -> None:
        self._config = {digest(k): v for k, v in (config_keys or {}).items()}
        self._admin: dict[str, ApiKey] = {}
        self._all: Mapping[str, ApiKey] = MappingProxyType(dict(self._config))

    @property
    def enabled(self) -> bool:
        """Are keys required? (Any key configured or issued, revoked ones aside.)"""
        return bool(self._all)

    def lookup(self, presented: str | None) -> ApiKey | None:
        if not presented:
            return None
        return self._all.get(digest(presented))

    def set_config_keys(self, config_keys: Mapping[str, ApiKey]) -> None:
        """The config's ``apiKeys`` after a reload (the admin-issued ones stay)."""
        self._config = {digest(k): v for k, v in config_keys.items()}
        self._all = MappingProxyType({**self._admin, **self._config})

    def set_admin_keys(self, digests: Mapping[str, ApiKey]) -> None:
        """The admin-issued keys in force, by :func:`digest` (revoked ones left out)."""
        self._admin = dict(digests)
        self._all = MappingProxyType({**self._admin, **self._config})

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
