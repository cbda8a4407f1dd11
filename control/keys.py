"""Admin-issued API keys: made here, stored hashed, loaded into the running key ring.

A key is ``sk-llamaswap-`` and 32 random bytes (URL-safe base64). The database holds its
SHA-256 digest and a display prefix; the key itself is shown once, in the admin's success
message. Saving or deleting an :class:`~control.models.IssuedKey` (creating, editing,
revoking) reloads the admin part of ``runtime.current().keys`` once the transaction
commits, so a key works, or stops working, without a restart. The request path never
queries the database: :class:`scheduler.keys.KeyRing` is in memory, and
:meth:`~scheduler.keys.KeyRing.set_admin_keys` swaps one reference, so calling it from the
admin's worker thread is safe.

The box stays keyed (:class:`~control.models.AccessControl`): once a key has been in
force, :func:`reload` stores that, and the stored state is put in the ring at every start
and reload, so revoking or deleting the last key (or a restart with a config without
``apiKeys``) leaves every key-needing path refusing everyone but staff sessions. Only
:func:`set_keys_required` (the admin's access control page) turns it off, logged and in
the change log.
"""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Any

from django.db import DatabaseError, close_old_connections, transaction
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver

from control import changes
from control.models import AccessControl, IssuedKey, SettingsChange, this_node
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


def issued_keys(node: str | None = None) -> dict[str, ApiKey]:
    """The issued keys in force on ``node`` (default: this server's), by digest, as the
    ring takes them: revoked ones and those limited to other nodes left out."""
    node = this_node() if node is None else node
    return {
        record.digest: ApiKey(
            name=record.name, policy=record.policy, source="admin", scopes=record.scope_set
        )
        for record in IssuedKey.objects.filter(revoked_at__isnull=True)
        if record.valid_on(node)
    }


def keys_required() -> bool:
    """The stored state: has access control been turned on and not off since?"""
    return bool(
        AccessControl.objects.filter(pk=AccessControl.SINGLETON_PK, keys_required=True).exists()
    )


def set_keys_required(
    required: bool, who: str, source: str = SettingsChange.SOURCE_ADMIN, *, follow: bool = True
) -> bool:
    """Store whether keys are required, with a change-log row and a log line when it
    changes; the running ring follows after the commit. Returns whether it changed.

    Turning it off is for a staff member, on purpose (the admin refuses while a key is in
    force); turning it on is also what the first key in force does (:func:`reload`)."""
    with transaction.atomic():
        record, _ = AccessControl.objects.select_for_update().get_or_create(
            pk=AccessControl.SINGLETON_PK
        )
        if record.keys_required == required:
            return False
        record.keys_required = required
        record.changed_by = who[:150]
        record.save()
        SettingsChange.objects.create(
            who=who[:150], field=AccessControl.FIELD, old=not required, new=required, source=source
        )
    if required:
        log.info("API keys required from now on", extra={"action": "access_control", "who": who})
    else:
        log.warning(
            "access control turned off: the API is open to every caller",
            extra={"action": "access_control", "who": who},
        )
    if follow:  # the running ring, once the change is committed
        transaction.on_commit(reload, robust=True)
        transaction.on_commit(lambda: changes.changed("keys"), robust=True)  # other nodes
    return True


def reload(ring: KeyRing | None = None) -> dict[str, ApiKey] | None:
    """Put the issued keys into ``ring``, by default the running server's; None (and no
    query) when no ring is given and no server runs in this process."""
    if ring is None:
        if not runtime.is_running():
            return None
        ring = runtime.current().keys
    keys = issued_keys()
    stored = keys_required()
    if not stored and (keys or ring.has_config_keys):  # the first key: keys stay from now on
        if keys:
            who = f"issued API key {min(k.name for k in keys.values())}"
            source = SettingsChange.SOURCE_ADMIN
        else:
            who, source = "config file apiKeys", SettingsChange.SOURCE_CONFIG
        set_keys_required(True, who, source, follow=False)
        stored = True
    # The stored state first, so the ring's own "a key arrived" hook does not fire here.
    ring.set_required(stored)
    ring.set_admin_keys(keys)
    return keys


def _persist_required() -> None:
    """The ring's ``on_required`` hook (a config reload brought the first key): stored from
    a thread of its own, as the hook is called on the event loop."""

    def store() -> None:
        close_old_connections()
        try:
            set_keys_required(
                True, "config file apiKeys (reload)", SettingsChange.SOURCE_CONFIG, follow=False
            )
        except DatabaseError:
            log.warning(
                "API keys required, but not stored: a restart may open the box", exc_info=True
            )
        finally:
            close_old_connections()

    threading.Thread(target=store, name="llamaswap-keys-required", daemon=True).start()


def reload_at_start() -> None:
    """:func:`reload` for ``serve``: without the table yet (no ``migrate``), log and go on
    with the config's keys only."""
    if runtime.is_running():
        runtime.current().keys.on_required = _persist_required
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
    transaction.on_commit(lambda: changes.changed("keys"), robust=True)  # fleet: other nodes
