"""Another fleet node changed a control row (``control.changes``): read it again here."""

from __future__ import annotations

import logging

from django.db import DatabaseError, close_old_connections

from control import keys, settings_store
from control.models import this_node

log = logging.getLogger("llamaswap.control")


def apply_remote(kind: str, node: str) -> None:
    """Another node (``node``) changed ``kind``: read it again, as a save here would.
    Blocking (database): run it in a thread."""
    close_old_connections()
    try:
        if kind == "keys":
            keys.reload()
        elif kind == "settings":  # the fleet row's edits under this node's own
            effective = settings_store.effective_on(this_node())
            if effective is not None:
                source = f"{effective.source} (saved on {node})"
                settings_store.push_to_dispatcher(effective.settings, source)
        log.info("fleet: control rows read again", extra={"kind": kind, "node": node})
    except (DatabaseError, ValueError) as exc:
        log.warning(
            "fleet: another node's change not applied",
            extra={"kind": kind, "node": node, "cause": str(exc)},
        )
    finally:
        close_old_connections()
