"""Stored scheduler settings: what the config file says, what the admin changed, what wins.

The rule is pure and lives in the core (:func:`scheduler.core.settings.merge_at_start`
at a start or reload, :func:`~scheduler.core.settings.note_admin_edit` on an admin save;
also in docs/dashboard.md); this module stores what they return and decides nothing:

* At every start, ``manage.py serve`` stores the config file's scheduler values
  (``config_values``).
* A value saved in the admin is in effect at once (the running dispatcher gets it for its
  next pick) and stays in effect across restarts ...
* ... until the config file's value *for that key* differs from the one stored at the
  previous start: a changed config file wins over an older admin edit. Keys the admin
  never edited always follow the config file.

Every change, by the admin or by a changed config file, is a :class:`SettingsChange` row
naming its node.

In a fleet (docs/fleet.md) a named node stores its config file in its own row, never in
the fleet row, and takes config file < fleet-wide edit < its own edit
(:func:`~scheduler.core.settings.merge_node_at_start`, :func:`effective_on`). A server
without a node name uses the fleet row as above.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import DatabaseError, transaction
from django.db.models import Max
from django.utils import timezone

from control.models import SchedulerSettingsRecord, SettingsChange, this_node
from scheduler.core.policy import SchedulerSettings
from scheduler.core.settings import (
    FROM_CONFIG,
    FROM_FLEET,
    NAMES,
    SETTINGS,
    SOURCE_CONFIG,
    Layered,
    describe_source,
    layered,
    merge_at_start,
    merge_node_at_start,
    note_admin_edit,
)

log = logging.getLogger("llamaswap.settings")

FIELDS: tuple[str, ...] = NAMES
"""The stored keys: every setting's config key name, in the table's order."""


def settings_values(settings: SchedulerSettings) -> dict[str, Any]:
    """Every key as JSON values."""
    return settings.as_dict()


def record_values(record: SchedulerSettingsRecord) -> dict[str, Any]:
    """The stored values by key, as JSON; a key stored before its setting existed (or
    not stored at all) reads as the setting's default."""
    stored = record.values or {}
    return {
        s.name: s.plain(stored[s.name]) if s.name in stored else s.plain(s.default)
        for s in SETTINGS
    }


def to_settings(values: dict[str, Any]) -> SchedulerSettings:
    """Validate (raises SettingsError naming the config key)."""
    return SchedulerSettings.from_names(values)


def stored_settings(node: str | None = None) -> SchedulerSettings | None:
    """The settings stored at the last start of ``node`` (default: this server's; merged
    with admin edits since), or None when nothing is stored or the database is not ready.
    For replays of the history."""
    node = this_node() if node is None else node
    try:
        record = SchedulerSettingsRecord.objects.filter(node=node).first()
        if record is None and node:
            record = SchedulerSettingsRecord.objects.filter(node="").first()
    except DatabaseError:
        return None
    if record is None:
        return None
    try:
        return to_settings(record_values(record))
    except ValueError:
        return None


STAMP_FORMAT = "%Y-%m-%d %H:%M:%S UTC"
"""How an admin edit's time is noted in ``admin_overrides`` (and read back by the admin)."""


def stamp(when: datetime) -> str:
    return when.astimezone(UTC).strftime(STAMP_FORMAT)


@dataclass(frozen=True)
class Effective:
    settings: SchedulerSettings
    source: str


def _change(name: str, old: Any, new: Any, who: str, source: str, node: str = "") -> SettingsChange:
    return SettingsChange(who=who, field=name, old=old, new=new, source=source, node=node)


def apply_at_start(config_settings: SchedulerSettings, node: str = "") -> Effective:
    """Merge the config file's settings with stored admin edits (the rule:
    :func:`~scheduler.core.settings.merge_at_start`; a named node:
    :func:`~scheduler.core.settings.merge_node_at_start`), store the result, and return
    the settings the dispatcher starts with."""
    if node:
        return _apply_at_node_start(config_settings, node)
    config_vals = settings_values(config_settings)
    with transaction.atomic():
        record = (
            SchedulerSettingsRecord.objects.select_for_update()
            .filter(pk=SchedulerSettingsRecord.SINGLETON_PK)
            .first()
        )
        first = record is None
        if record is None:  # the first start: as if the config file had always said this
            record = SchedulerSettingsRecord(pk=SchedulerSettingsRecord.SINGLETON_PK)
            record.values = record.config_values = config_vals
        merged = merge_at_start(
            config_vals,
            record.config_values or {},
            record_values(record),
            record.admin_overrides or {},
        )
        changes = [
            _change(name, old, new, SOURCE_CONFIG, SettingsChange.SOURCE_CONFIG)
            for name, old, new in merged.changed
        ]
        values, overrides = merged.values, merged.overrides
        try:
            effective = to_settings(values)
        except ValueError:
            log.warning("stored scheduler settings are invalid; using the config file's")
            values, overrides, effective = config_vals, {}, config_settings
        record.values = values
        record.config_values = config_vals
        record.admin_overrides = overrides
        if changes or first:
            record.updated_by = SOURCE_CONFIG
        record.save()
        SettingsChange.objects.bulk_create(changes)
    return Effective(effective, describe_source(overrides))


def _fleet_row(lock: bool = False) -> SchedulerSettingsRecord | None:
    rows = SchedulerSettingsRecord.objects
    query = rows.select_for_update() if lock else rows.all()
    return query.filter(pk=SchedulerSettingsRecord.SINGLETON_PK).first()


def _node_source(fleet_overrides: dict[str, Any], merged: Layered) -> str:
    """The source in words on a node: the fleet's edits and the node's, as in force."""
    edits = {
        name: (fleet_overrides if source == FROM_FLEET else merged.node_overrides).get(name)
        for name, source in merged.sources.items()
        if source != FROM_CONFIG
    }
    return describe_source({k: v for k, v in edits.items() if v}, merged.sources)


def _apply_at_node_start(config_settings: SchedulerSettings, node: str) -> Effective:
    """A named node: its config file goes into its own row, never into the fleet row."""
    config_vals = settings_values(config_settings)
    with transaction.atomic():
        fleet = _fleet_row(lock=True)
        if fleet is None:  # no fleet edits yet; the row the admin's fleet-wide form edits
            fleet = SchedulerSettingsRecord(pk=SchedulerSettingsRecord.SINGLETON_PK, node="")
            fleet.values, fleet.updated_by = config_vals, SOURCE_CONFIG
            fleet.save()
        record = SchedulerSettingsRecord.objects.select_for_update().filter(node=node).first()
        first = record is None
        if record is None:  # a pk of its own: the fleet row's pk 1 was not from the sequence
            top = SchedulerSettingsRecord.objects.aggregate(top=Max("pk"))["top"] or 0
            record = SchedulerSettingsRecord(pk=top + 1, node=node, values=config_vals)
        fleet_overrides = fleet.admin_overrides or {}
        merged = merge_node_at_start(
            config_vals,
            None if first else record.config_values or {},
            record_values(fleet),
            fleet_overrides,
            record_values(record),
            record.admin_overrides or {},
            record.config_wins or {},
        )
        try:
            effective = Effective(to_settings(merged.values), _node_source(fleet_overrides, merged))
        except ValueError:
            log.warning("stored scheduler settings are invalid; using the config file's")
            merged = layered(config_vals, {}, {}, record_values(record), {})
            effective = Effective(config_settings, SOURCE_CONFIG)
        changes = [
            _change(name, old, new, SOURCE_CONFIG, SettingsChange.SOURCE_CONFIG, node)
            for name, old, new in merged.changed
            if merged.sources[name] == FROM_CONFIG
        ]
        record.values, record.config_values = merged.values, config_vals
        record.admin_overrides, record.config_wins = merged.node_overrides, merged.config_wins
        if changes or first:
            record.updated_by = SOURCE_CONFIG
        record.save()
        SettingsChange.objects.bulk_create(changes)
    return effective


def effective_on(node: str) -> Effective | None:
    """The settings in effect on ``node`` now, from the stored rows (after an admin edit
    of the fleet row or of the node's row, here or on another node); a named node's row
    is brought up to date. None when nothing is stored for it yet."""
    with transaction.atomic():
        fleet = _fleet_row(lock=True)
        if not node:
            if fleet is None:
                return None
            values = record_values(fleet)
            return Effective(to_settings(values), describe_source(fleet.admin_overrides or {}))
        record = SchedulerSettingsRecord.objects.select_for_update().filter(node=node).first()
        if record is None:
            return None
        fleet_overrides = (fleet.admin_overrides or {}) if fleet is not None else {}
        merged = layered(
            record.config_values or {},
            record_values(fleet) if fleet is not None else {},
            fleet_overrides,
            record_values(record),
            record.admin_overrides or {},
            record.config_wins or {},
        )
        settings = to_settings(merged.values)
        if merged.changed:
            record.values = merged.values
            record.save(update_fields=["values", "updated_at"])
    return Effective(settings, _node_source(fleet_overrides, merged))


def apply_at_start_or_config(
    config_settings: SchedulerSettings, node: str | None = None
) -> Effective:
    """:func:`apply_at_start` for ``node`` (default: this server's), or the config file
    alone when the database is not ready (no ``manage.py migrate`` yet): admin edits are
    then unavailable, nothing else is."""
    try:
        return apply_at_start(config_settings, this_node() if node is None else node)
    except DatabaseError as error:
        log.warning(
            "settings store unavailable (run `llamaswap migrate`); using the config file",
            extra={"cause": str(error)},
        )
        return Effective(config_settings, SOURCE_CONFIG)


def save_admin_edit(
    record: SchedulerSettingsRecord, old: dict[str, Any], user: str
) -> tuple[SchedulerSettings, str, list[SettingsChange]]:
    """After the admin saved ``record``: note which keys it now overrides
    (:func:`~scheduler.core.settings.note_admin_edit`), record the changes (old -> new),
    and return the new settings and their source description."""
    new = record_values(record)
    edit = note_admin_edit(old, new, record.admin_overrides or {}, user, stamp(timezone.now()))
    changes = [
        _change(name, before, after, user, SettingsChange.SOURCE_ADMIN, record.node)
        for name, before, after in edit.changed
    ]
    record.admin_overrides = edit.overrides
    record.updated_by = user
    record.save(update_fields=["admin_overrides", "updated_by", "updated_at"])
    SettingsChange.objects.bulk_create(changes)
    return to_settings(new), describe_source(edit.overrides), changes


def push_to_dispatcher(settings: SchedulerSettings, source: str) -> bool:
    """Hand new settings to the running dispatcher (same process under daphne).
    False when no server runs in this process."""
    from scheduler import runtime

    if not runtime.is_running():
        return False
    runtime.current().dispatcher.set_settings(settings, source=source)
    return True
