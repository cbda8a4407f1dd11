"""Admin-issued API keys: made here, stored hashed, loaded into the running key ring.

A key is ``sk-llamaswap-`` and 32 random bytes (URL-safe base64). The database holds its
SHA-256 digest and a display prefix; the key itself is shown once, in the admin's success
message. Saving or deleting an :class:`~dashboard.models.IssuedKey` (creating, editing,
revoking) reloads the admin part of ``runtime.current().keys`` once the transaction
commits, so a key works, or stops working, without a restart. The request path never
queries the database: :class:`scheduler.keys.KeyRing` is in memory, and
:meth:`~scheduler.keys.KeyRing.set_admin_keys` swaps one reference, so calling it from the
admin's worker thread is safe.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from django.db import DatabaseError, transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from dashboard.models import IssuedKey
from scheduler import runtime
from scheduler.keys import ApiKey, KeyRing, digest

log = logging.getLogger("llamaswap.keys")

KEY_PREFIX = "sk-llamaswap-"
SHOWN_RANDOM_CHARS = 8
"""Random characters kept in :attr:`IssuedKey.prefix` to tell keys apart."""


def new_key() -> str:
    """A fresh key: ``sk-llamaswap-`` and 32 random bytes."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def display_prefix(key: str) -> str:
    """What is stored to recognise a key: ``sk-llamaswap-`` and its first random characters
    (the first 12 characters alone would be the same for every key)."""
    return key[: len(KEY_PREFIX) + SHOWN_RANDOM_CHARS]


def assign(record: IssuedKey, key: str) -> None:
    """Store what identifies ``key`` on ``record`` (its digest and prefix), never the key."""
    record.digest = digest(key)
    record.prefix = display_prefix(key)


def issued_keys() -> dict[str, ApiKey]:
    """The issued keys in force, by digest (revoked ones left out), as the ring takes them."""
    return {
        record.digest: ApiKey(name=record.name, policy=record.policy, source="admin")
        for record in IssuedKey.objects.filter(revoked_at__isnull=True)
    }


def reload(ring: KeyRing | None = None) -> dict[str, ApiKey] | None:
    """Put the issued keys into ``ring``, by default the running server's; None (and no
    query) when no ring is given and no server runs in this process."""
    if ring is None:
        if not runtime.is_running():
            return None
        ring = runtime.current().keys
    keys = issued_keys()
    ring.set_admin_keys(keys)
    return keys


def reload_at_start() -> None:
    """:func:`reload` for ``serve``: without the table yet (no ``migrate``), log and go on
    with the config's keys only."""
    try:
        keys = reload()
    except DatabaseError as error:
        log.warning("issued API keys not loaded (run `llamaswap migrate`): %s", error)
        return
    if keys:
        log.info("issued API keys loaded", extra={"count": len(keys)})


@receiver(post_save, sender=IssuedKey, dispatch_uid="llamaswap.issued_key.saved")
@receiver(post_delete, sender=IssuedKey, dispatch_uid="llamaswap.issued_key.deleted")
def _changed(sender: Any, **kwargs: Any) -> None:
    # After the commit: a rolled-back save must not reach the ring. Outside a transaction
    # this runs at once.
    transaction.on_commit(reload, robust=True)
