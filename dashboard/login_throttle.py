"""Failed admin logins throttled: per username and client address, in Django's cache.

Five failures for one username from one address within five minutes lock that pair for
fifteen minutes: a correct password is refused too until the lock ends (HTTP 429, the
login form saying how long), so guessing costs hours, while the real admin on another
address (or another user on this one) still logs in. A looser limit per address (30
failures in five minutes, any usernames) stops one client from spraying usernames. Each
lock is logged (``llamaswap.admin``).

Why our own and not django-axes: axes wants its middleware on every page, its backend
first in ``AUTHENTICATION_BACKENDS`` (which then refuses any ``authenticate()`` call
without a request: Django's test ``Client.login`` and scripts), and its tables or a cache
handler; the need here is one form on one view. The counters live in the default cache
(the server is one process, so its local-memory cache sees every attempt); a restart
clears them, which costs an attacker nothing worth having.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.cache import cache as default_cache

log = logging.getLogger("llamaswap.admin")


@dataclass(frozen=True)
class Limits:
    failures: int = 5
    """Failures of one username from one address ..."""
    window: float = 300.0
    """... within this many seconds lock the pair ..."""
    lockout: float = 900.0
    """... for this long."""
    address_failures: int = 30
    """Failures from one address, any usernames, within ``window``: the address is locked."""


class LoginThrottle:
    """Counts failures in ``cache``; time from ``clock`` (tests pass their own)."""

    def __init__(
        self,
        limits: Limits | None = None,
        cache: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.limits = limits or Limits()
        self.cache = cache if cache is not None else default_cache
        self.clock = clock

    @staticmethod
    def _key(kind: str, *parts: str) -> str:
        # Hashed: a username may be long or hold characters some cache backends refuse.
        digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
        return f"llamaswap:login:{kind}:{digest}"

    def _keys(self, username: str, address: str) -> tuple[str, str]:
        name = (username or "").strip().casefold()
        return self._key("pair", name, address), self._key("addr", address)

    def locked_for(self, username: str, address: str) -> float:
        """Seconds until this pair may try again; 0 when it may now."""
        now = self.clock()
        until = max(
            (self.cache.get(key + ":lock") or 0.0) for key in self._keys(username, address)
        )
        return max(0.0, until - now)

    def failed(self, username: str, address: str) -> bool:
        """Count a failure; True when it locks the pair (or the address)."""
        now = self.clock()
        limits = self.limits
        locked = False
        for key, limit in zip(
            self._keys(username, address), (limits.failures, limits.address_failures), strict=True
        ):
            recent = [t for t in self.cache.get(key) or () if t > now - limits.window]
            recent.append(now)
            if len(recent) >= limit:
                self.cache.set(key + ":lock", now + limits.lockout, math.ceil(limits.lockout))
                self.cache.delete(key)
                locked = True
            else:
                self.cache.set(key, recent[-limit:], math.ceil(limits.window))
        return locked

    def succeeded(self, username: str, address: str) -> None:
        """A correct login clears the pair's failures (not the address's)."""
        self.cache.delete(self._keys(username, address)[0])


throttle = LoginThrottle()


def client_address(request: Any) -> str:
    """The client's address as daphne gives it (``REMOTE_ADDR``, the socket's peer)."""
    return str(request.META.get("REMOTE_ADDR") or "unknown")


def lock_message(seconds: float) -> str:
    minutes = max(1, math.ceil(seconds / 60))
    return (
        f"Too many failed logins for this username from your address: try again in "
        f"{minutes} minute{'s' if minutes != 1 else ''}."
    )
