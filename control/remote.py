"""Another fleet node changed a control row (``control.changes``): read it again here."""

from __future__ import annotations

import logging

from django.db import DatabaseError, close_old_connections

from control import keys, settings_store
from control.models import SchedulerSettingsRecord
from scheduler.core.settings import describe_source

log = logging.getLogger("llamaswap.control")


def apply_remote(kind: str, node: str) -> None:
    """Another node (``node``) changed ``kind``: read it again, as a save here would.
    Blocking (database): run it in a thread."""
    close_old_connections()
    try:
        if kind == "keys":
            keys.reload()
        elif kind == "settings":
            pk = SchedulerSettingsRecord.SINGLETON_PK
            record = SchedulerSettingsRecord.objects.filter(pk=pk).first()
            if record is not None:
                settings = settings_store.to_settings(settings_store.record_values(record))
                source = describe_source(record.admin_overrides or {})
                settings_store.push_to_dispatcher(settings, f"{source} (saved on {node})")
        log.info("fleet: control rows read again", extra={"kind": kind, "node": node})
    except (DatabaseError, ValueError) as exc:
        log.warning(
            "fleet: another node's change not applied",
            extra={"kind": kind, "node": node, "cause": str(exc)},
        )
    finally:
        close_old_connections()
