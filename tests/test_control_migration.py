"""The settings records, the change log, the issued keys and access control moved from
``dashboard`` to ``control`` without touching the data: a database written by the old
version (dashboard 0005) migrates forward and the new models read every row, the running
key ring takes the key, and admin log entries stay attached to the same content type.

Runs on the database the suite uses: SQLite by default, PostgreSQL with
``DATABASE_URL=postgres://postgres@127.0.0.1:5432/test``.
"""

from __future__ import annotations

import pytest
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from control import keys as issued
from control import settings_store
from control.models import AccessControl, IssuedKey, SchedulerSettingsRecord, SettingsChange
from scheduler.core.policy import SchedulerSettings
from scheduler.keys import KeyRing, Scope, digest

OLD = ("dashboard", "0005_settings_values")
"""The last state in which dashboard held the models."""

KEY = "sk-llamaswap-written-by-the-old-version"
STORED = {
    "use": "fifo",
    "agingDivisor": 90,
    "swapAffinityBonus": 30,
    "fifoPriority": {"qwen": 5},
    "bandShare": {"batch": 0.2},
}


def _migrate(targets: list[tuple[str, str]]) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    return executor


@pytest.mark.django_db(transaction=True)
def test_rows_written_before_the_move_are_read_by_the_control_models():
    content_type = ContentType.objects.get_for_model(IssuedKey).pk
    executor = _migrate([("control", None), OLD])  # the old version had no control app
    try:
        old = executor.loader.project_state(OLD).apps
        old.get_model(OLD[0], "SchedulerSettingsRecord").objects.create(
            pk=1,
            values=STORED,
            config_values={**STORED, "swapAffinityBonus": 10},
            admin_overrides={"swapAffinityBonus": {"by": "alice", "at": "2026-12-01 04:10:17 UTC"}},
        )
        old.get_model(OLD[0], "SettingsChange").objects.create(
            who="alice", field="swapAffinityBonus", old=10, new=30, source="admin"
        )
        old.get_model(OLD[0], "IssuedKey").objects.create(
            name="farm",
            digest=digest(KEY),
            prefix=KEY[:21],
            priority_ceiling=0,
            priority_offset=-5,
            scopes=["inference", "metrics"],
        )
        old.get_model(OLD[0], "AccessControl").objects.create(pk=1, keys_required=True)
        # The old state's content type is dashboard's (moved back on the way down).
        assert ContentType.objects.get(pk=content_type).app_label == "dashboard"
    finally:  # forward again: the schema every other test expects
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())

    settings = settings_store.stored_settings()
    assert settings == SchedulerSettings.create(
        use="fifo",
        aging_divisor=90,
        swap_affinity_bonus=30,
        fifo_priority={"qwen": 5},
        band_share={"batch": 0.2},
    )
    record = SchedulerSettingsRecord.objects.get()
    assert record.admin_overrides["swapAffinityBonus"]["by"] == "alice"
    change = SettingsChange.objects.get()
    assert (change.field, change.old, change.new, change.who) == (
        "swapAffinityBonus",
        10,
        30,
        "alice",
    )
    key = IssuedKey.objects.get()
    assert (key.name, key.policy.ceiling, key.policy.offset) == ("farm", 0, -5)
    assert key.scope_set == {Scope.INFERENCE, Scope.METRICS}
    assert AccessControl.objects.get().keys_required

    # What a client notices: the key issued before the upgrade still opens the API.
    ring = KeyRing()
    issued.reload(ring)
    assert ring.required
    found = ring.lookup(KEY)
    assert found is not None and (found.name, found.source) == ("farm", "admin")
    # Admin log entries and permissions stay attached: the content type moved, same row.
    moved = ContentType.objects.get(pk=content_type)
    assert (moved.app_label, moved.model) == ("control", "issuedkey")

    # The precedence goes on from the stored record: the admin's edit survives a start
    # with the same config file.
    assert settings is not None
    config = settings.with_changes(swap_affinity_bonus=10)
    effective = settings_store.apply_at_start(config)
    assert effective.settings.swap_affinity_bonus == 30
    assert effective.source.startswith("admin edit: swapAffinityBonus by alice")


BEFORE_NODES = ("control", "0001_initial")
"""The last state before per-node overrides (control 0002)."""


@pytest.mark.django_db(transaction=True)
def test_rows_written_before_per_node_overrides_become_the_fleet_wide_ones():
    executor = _migrate([BEFORE_NODES])
    try:
        old = executor.loader.project_state(BEFORE_NODES).apps
        old.get_model("control", "SchedulerSettingsRecord").objects.create(
            pk=1,
            values=STORED,
            config_values={**STORED, "swapAffinityBonus": 10},
            admin_overrides={"swapAffinityBonus": {"by": "alice", "at": "2026-12-01 04:10:17 UTC"}},
        )
        old.get_model("control", "SettingsChange").objects.create(
            who="alice", field="swapAffinityBonus", old=10, new=30, source="admin"
        )
        old.get_model("control", "IssuedKey").objects.create(
            name="farm", digest=digest(KEY), prefix=KEY[:21], scopes=["inference"]
        )
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())

    record = SchedulerSettingsRecord.objects.get()
    assert (record.node, record.values, record.config_wins) == ("", STORED, {})
    assert SettingsChange.objects.get().node == ""
    key = IssuedKey.objects.get()
    assert key.nodes == [] and key.valid_on("box-a") and key.valid_on("")
    # The box's admin edit is now fleet-wide: a named node starting with its own config
    # file takes it, and keeps its own values for the rest.
    config = SchedulerSettings.create(aging_divisor=7)
    effective = settings_store.apply_at_start(config, "box-a")
    assert (effective.settings.swap_affinity_bonus, effective.settings.aging_divisor) == (30, 7)
    assert SchedulerSettingsRecord.objects.get(node="").values == STORED  # not overwritten
