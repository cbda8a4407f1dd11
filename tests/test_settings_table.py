"""Each scheduler setting is declared once, in scheduler.core.settings.SETTINGS, and
everything else follows from it: the YAML, the validation (the same message from
`llamaswap check`, the admin and `simulate --set`), the admin form, the stored record,
the simulator's --set, the docs, and the precedence between the config file and an
admin edit. A setting added anywhere but the table (a dataclass field without a row, a
form field, a --set name) fails here."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import pytest

from control import settings_store
from control.models import SchedulerSettingsRecord
from control.settings_admin import SchedulerSettingsAdmin, SchedulerSettingsForm, fields_of
from llamaswap_site.management.commands.simulate import Command as SimulateCommand
from scheduler.checks import inspect_config
from scheduler.config import ConfigError, parse_config
from scheduler.core.policy import SchedulerSettings, SettingsError
from scheduler.core.settings import (
    BY_FIELD,
    BY_NAME,
    NAMES,
    SETTINGS,
    Kind,
    Setting,
    assignable_names,
    describe_source,
    docs_table,
    merge_at_start,
    note_admin_edit,
)
from scheduler.core.simulate import parse_overrides

ROOT = Path(__file__).resolve().parent.parent
IDS = [s.name for s in SETTINGS]


def good(row: Setting) -> Any:
    """A valid value other than the default, from the row's kind and range."""
    if row.kind is Kind.CHOICE:
        assert row.choices is not None
        return next(c.value for c in row.choices if c != row.default)
    if row.kind is Kind.NUMBER:
        return (row.minimum or 0) + 1.5
    if row.kind is Kind.INTEGER:
        return int(row.minimum or 0) + 1
    if row.kind is Kind.MODEL_PRIORITIES:
        return {"m": 3}
    return {"batch": 0.25}


def bad(row: Setting) -> Any:
    """An invalid value of the right type (out of range, or an unknown entry)."""
    if row.kind is Kind.CHOICE:
        return "lifo"
    if row.kind in (Kind.NUMBER, Kind.INTEGER):
        assert row.minimum is not None
        return row.minimum - 1
    if row.kind is Kind.MODEL_PRIORITIES:
        return {"m": "high"}
    return {"batch": 2}


def at_path(row: Setting, value: Any) -> dict[str, Any]:
    """``{routing: {scheduler: ...}}`` with ``value`` at the row's place."""
    node: Any = value
    for part in reversed(row.path):
        node = {part: node}
    return {"routing": {"scheduler": node}}


def config_with(row: Setting, value: Any):
    return parse_config(
        {"models": {"m": {"cmd": "x", "proxy": "http://127.0.0.1:1"}}, **at_path(row, value)}
    )


def config_error(row: Setting, value: Any) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        config_with(row, value)
    return caught.value


# -- one row per field, one default --------------------------------------------------------


def test_every_field_of_the_settings_has_exactly_one_row():
    fields = [f.name for f in dataclasses.fields(SchedulerSettings)]
    assert sorted(fields) == sorted(BY_FIELD)
    assert len(SETTINGS) == len(BY_FIELD) == len(BY_NAME)
    assert SchedulerSettings() == SchedulerSettings.create()  # the defaults are the table's
    for row in SETTINGS:
        assert getattr(SchedulerSettings(), row.field) == row.check(row.default), row.name


# -- the YAML and `llamaswap check` --------------------------------------------------------


@pytest.mark.parametrize("row", SETTINGS, ids=IDS)
def test_the_config_file_sets_every_setting(row):
    config = config_with(row, good(row))
    assert getattr(config.scheduler, row.field) == row.check(good(row))
    assert not config.warnings


@pytest.mark.parametrize("row", SETTINGS, ids=IDS)
def test_an_invalid_value_names_its_key_everywhere_alike(row, tmp_path):
    """The config file, `llamaswap check` and SchedulerSettings.create say the same."""
    error = config_error(row, bad(row))
    assert error.key.startswith(row.key)
    with pytest.raises(SettingsError) as caught:
        SchedulerSettings.create(**{row.field: bad(row)})
    assert f"{error.key}: {error.message}" == str(caught.value)
    path = tmp_path / "config.yaml"
    path.write_text(
        "models: {m: {cmd: x, proxy: 'http://127.0.0.1:1'}}\n"
        + textwrap.dedent(_yaml(at_path(row, bad(row))))
    )
    config, messages = inspect_config(str(path))
    assert config is None and [m.msg for m in messages] == [str(caught.value)]


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data)


def test_an_unknown_key_beside_the_settings_warns():
    config = parse_config(
        {
            "models": {"m": {"cmd": "x", "proxy": "http://127.0.0.1:1"}},
            "routing": {"scheduler": {"startFailureCoolDown": 1}},  # a typo
        }
    )
    assert config.warnings == ("routing.scheduler.startFailureCoolDown: unknown key; ignored",)


# -- the admin -------------------------------------------------------------------------------


def test_the_admin_form_has_exactly_the_tables_fields():
    expected = [name for row in SETTINGS for name in fields_of(row)]
    assert list(SchedulerSettingsForm.base_fields) == expected
    on_page = [
        name
        for _title, spec in SchedulerSettingsAdmin.fieldsets
        for name in spec["fields"]
        if name not in SchedulerSettingsAdmin.readonly_fields
    ]
    assert sorted(on_page) == sorted(expected)


def _form_data(values: dict[str, Any]) -> dict[str, str]:
    """The admin's POST for values by YAML name."""
    import json

    data: dict[str, str] = {}
    for row in SETTINGS:
        value = values[row.name]
        if row.kind is Kind.BAND_SHARES:
            for band in ("interactive", "normal", "batch"):
                data[f"share_{band}"] = "" if band not in value else str(value[band])
        elif row.kind is Kind.MODEL_PRIORITIES:
            data[row.field] = json.dumps(value)
        else:
            data[row.field] = "" if value is None else str(value)
    return data


@pytest.mark.django_db
@pytest.mark.parametrize("row", SETTINGS, ids=IDS)
def test_the_admin_refuses_with_the_config_files_message(row):
    values = {**SchedulerSettings().as_dict(), row.name: bad(row)}
    form = SchedulerSettingsForm(data=_form_data(values), instance=SchedulerSettingsRecord(pk=1))
    assert not form.is_valid()
    error = config_error(row, bad(row))
    shown = [m for messages in form.errors.values() for m in messages]
    assert f"{error.key}: {error.message}" in shown


@pytest.mark.django_db
@pytest.mark.parametrize("row", SETTINGS, ids=IDS)
def test_the_admin_saves_every_setting(row):
    values = {**SchedulerSettings().as_dict(), row.name: good(row)}
    form = SchedulerSettingsForm(data=_form_data(values), instance=SchedulerSettingsRecord(pk=1))
    assert form.is_valid(), form.errors
    record = form.save()
    settings = settings_store.to_settings(settings_store.record_values(record))
    assert getattr(settings, row.field) == row.check(good(row))


# -- the stored record -----------------------------------------------------------------------


def test_the_store_keeps_every_setting_and_reads_missing_ones_as_defaults():
    settings = SchedulerSettings.create(**{row.field: good(row) for row in SETTINGS})
    assert tuple(settings_store.settings_values(settings)) == NAMES
    record = SchedulerSettingsRecord(values=settings_store.settings_values(settings))
    assert settings_store.to_settings(settings_store.record_values(record)) == settings
    # A row stored before a setting existed (no startFailureCooldown): its default.
    old = {
        k: v
        for k, v in settings_store.settings_values(settings).items()
        if k != "startFailureCooldown"
    }
    restored = settings_store.to_settings(
        settings_store.record_values(SchedulerSettingsRecord(values=old))
    )
    assert restored.start_failure_cooldown == BY_NAME["startFailureCooldown"].default


# -- the simulator's --set -------------------------------------------------------------------


def _assignment(row: Setting) -> str:
    value = good(row)
    if isinstance(value, dict):
        return ",".join(f"{row.name}.{k}={v}" for k, v in value.items())
    return f"{row.name}={value}"


@pytest.mark.parametrize("row", SETTINGS, ids=IDS)
def test_simulate_set_takes_every_setting(row):
    settings = parse_overrides([_assignment(row)])
    assert getattr(settings, row.field) == row.check(good(row))


def test_simulate_set_names_exactly_the_table():
    with pytest.raises(SettingsError) as caught:
        parse_overrides(["agingDivisr=5"])
    assert caught.value.reason == f"unknown setting (known: {', '.join(assignable_names())})"
    assert len(assignable_names()) == len(SETTINGS)
    parser = SimulateCommand().create_parser("manage.py", "simulate")
    (action,) = [a for a in parser._actions if "--set" in a.option_strings]
    assert action.help == f"override a setting (repeatable): {', '.join(assignable_names())}"


# -- the docs --------------------------------------------------------------------------------


def test_the_docs_list_every_setting():
    text = (ROOT / "docs" / "scheduling.md").read_text()
    start = "<!-- settings table: generated by scheduler.core.settings.docs_table() -->\n"
    end = "\n<!-- end of settings table -->"
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == docs_table(), (
        "regenerate: python -c 'from scheduler.core.settings import docs_table; print(docs_table())'"
    )
    for row in SETTINGS:
        assert f"`{row.name}`" in table


# -- precedence: the config file or an admin edit ------------------------------------------

A = {"agingDivisor": 60, "swapAffinityBonus": 10}


@pytest.mark.parametrize(
    ("config", "previous", "current", "overrides", "values", "kept"),
    [
        # Never edited in the admin: the config file's value.
        ({**A, "agingDivisor": 90}, A, A, {}, {**A, "agingDivisor": 90}, set()),
        # Edited, and the config file says what it said at the last start: the edit stays.
        (
            A,
            A,
            {**A, "swapAffinityBonus": 30},
            {"swapAffinityBonus": {}},
            {**A, "swapAffinityBonus": 30},
            {"swapAffinityBonus"},
        ),
        # Edited, but the config file's value for that key changed: the config file wins.
        (
            {**A, "swapAffinityBonus": 20},
            A,
            {**A, "swapAffinityBonus": 30},
            {"swapAffinityBonus": {}},
            {**A, "swapAffinityBonus": 20},
            set(),
        ),
        # Another key's change in the file does not undo an edit.
        (
            {**A, "agingDivisor": 90},
            A,
            {**A, "swapAffinityBonus": 30},
            {"swapAffinityBonus": {}},
            {"agingDivisor": 90, "swapAffinityBonus": 30},
            {"swapAffinityBonus"},
        ),
    ],
)
def test_precedence(config, previous, current, overrides, values, kept):
    merged = merge_at_start(config, previous, current, overrides)
    assert {k: merged.values[k] for k in A} == values
    assert set(merged.overrides) == kept
    assert {(n, o, v) for n, o, v in merged.changed if n in A} == {
        (n, current.get(n), values[n]) for n in A if current.get(n) != values[n]
    }


def test_an_admin_edit_takes_over_exactly_the_keys_it_changed():
    earlier = {"agingDivisor": {"by": "bob", "at": "t0"}}
    edit = note_admin_edit(
        {**A, "agingDivisor": 90},
        {**A, "agingDivisor": 90, "swapAffinityBonus": 30},
        earlier,
        "alice",
        "t1",
    )
    assert edit.overrides == {  # bob's older edit stays; alice's is noted
        "agingDivisor": {"by": "bob", "at": "t0"},
        "swapAffinityBonus": {"by": "alice", "at": "t1"},
    }
    assert edit.changed == [("swapAffinityBonus", 10, 30)]
    assert earlier == {"agingDivisor": {"by": "bob", "at": "t0"}}  # the input is not changed
    # Saving without a change takes nothing over.
    same = note_admin_edit(A, A, {}, "alice", "t1")
    assert (same.overrides, same.changed) == ({}, [])


def test_an_admin_edit_lasts_until_the_config_file_changes_that_key():
    """The two halves together: an edit, restarts with the same file, then a new value."""
    config = dict(A)
    edit = note_admin_edit(config, {**config, "swapAffinityBonus": 30}, {}, "alice", "t1")
    current, overrides = edit.values, edit.overrides
    for _ in range(2):  # restarts with the same config file keep the edit
        merged = merge_at_start(config, config, current, overrides)
        assert merged.values["swapAffinityBonus"] == 30 and merged.changed == []
        current, overrides = merged.values, merged.overrides
    merged = merge_at_start({**config, "swapAffinityBonus": 20}, config, current, overrides)
    assert merged.values["swapAffinityBonus"] == 20 and merged.overrides == {}
    assert merged.changed == [("swapAffinityBonus", 30, 20)]


def test_the_source_names_each_admin_edit_in_force():
    assert describe_source({}) == "config file"
    assert describe_source({"gone": {"by": "x", "at": "t"}}) == "config file"  # no setting
    assert describe_source(
        {"swapAffinityBonus": {"by": "alice", "at": "t1"}, "agingDivisor": {"at": "t0"}}
    ) == (
        "admin edit: agingDivisor by ? at t0; swapAffinityBonus by alice at t1 "
        "(the rest from the config file)"
    )


def test_serve_and_reload_use_the_one_rule():
    """serve and reload go through the store, which applies merge_at_start; neither has
    a rule of its own."""
    for path in ("llamaswap_site/reload.py", "llamaswap_site/management/commands/serve.py"):
        text = (ROOT / path).read_text()
        assert "apply_at_start_or_config" in text and "admin_overrides" not in text
    store = (ROOT / "control" / "settings_store.py").read_text()
    assert "merge_at_start(" in store and "previous_config.get(" not in store
    assert "note_admin_edit(" in store and "overrides[" not in store


def test_llamaswap_check_lists_every_invalid_setting(tmp_path):
    import io

    from django.core.management import call_command

    path = tmp_path / "config.yaml"
    path.write_text(
        "models: {m: {cmd: x, proxy: 'http://127.0.0.1:1'}}\n"
        "routing:\n"
        "  scheduler:\n"
        "    use: lifo\n"
        "    startFailureCooldown: -1\n"
        "    settings: {serial: {swapAffinityBonus: 100}}\n"
    )
    err = io.StringIO()
    with pytest.raises(SystemExit) as exit_status:
        call_command("check_config", str(path), stderr=err, stdout=io.StringIO())
    assert exit_status.value.code == 1
    errors = [line for line in err.getvalue().splitlines() if ": error: " in line]
    assert errors == [
        f"{path}: error: routing.scheduler.use: must be 'serial' or 'fifo', got 'lifo'",
        f"{path}: error: routing.scheduler.settings.serial.swapAffinityBonus: "
        "must be an integer 0..99, got 100",
        f"{path}: error: routing.scheduler.startFailureCooldown: "
        "must be a finite number >= 0, got -1",
    ]


# -- the stored record across the migration to one JSON column ------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_record_stored_in_columns_keeps_its_values_across_the_migration():
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before = [("dashboard", "0004_key_scopes_access_control")]
    after = [("dashboard", "0005_settings_values")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    try:
        old = executor.loader.project_state(before[0]).apps
        old.get_model("dashboard", "SchedulerSettingsRecord").objects.create(
            pk=1,
            use="fifo",
            aging_divisor=90.0,
            swap_affinity_bonus=30,
            fifo_priority={"qwen": 5},
            band_share={"batch": 0.2},
            admin_overrides={"swapAffinityBonus": {"by": "alice", "at": "x"}},
        )
        MigrationExecutor(connection).migrate(after)
    finally:  # the schema the other tests expect
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())
    record = SchedulerSettingsRecord.objects.get()
    settings = settings_store.to_settings(settings_store.record_values(record))
    assert settings == SchedulerSettings.create(
        use="fifo",
        aging_divisor=90,
        swap_affinity_bonus=30,
        fifo_priority={"qwen": 5},
        band_share={"batch": 0.2},
    )
    assert record.admin_overrides == {"swapAffinityBonus": {"by": "alice", "at": "x"}}
