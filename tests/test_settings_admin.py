"""Admin-editable scheduler settings: validation, the running dispatcher, the audit trail,
and the precedence between the config file and admin edits across restarts."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.urls import reverse

from control.models import SchedulerSettingsRecord, SettingsChange
from control.settings_store import apply_at_start, apply_at_start_or_config, save_admin_edit
from scheduler import runtime
from scheduler.config import parse_config
from scheduler.core.policy import SchedulerSettings
from scheduler.core.settings import BY_FIELD

pytestmark = pytest.mark.django_db

CONFIG = SchedulerSettings.create(aging_divisor=60, swap_affinity_bonus=10)


def _admin_edit(user: str = "alice", **values) -> None:
    record = SchedulerSettingsRecord.objects.get()
    from control.settings_store import record_values

    old = record_values(record)
    for field, value in values.items():
        record.values[BY_FIELD[field].name] = value
    record.save()
    save_admin_edit(record, old, user)


# -- precedence across restarts ----------------------------------------------------------


def test_first_start_stores_the_config_file_values():
    effective = apply_at_start(CONFIG)
    assert effective.settings == CONFIG and effective.source == "config file"
    record = SchedulerSettingsRecord.objects.get()
    assert record.config_values == {
        "use": "serial",
        "agingDivisor": 60,
        "swapAffinityBonus": 10,
        "agingCap": None,
        "bandShare": {},
        "fifoPriority": {},
        "startFailureCooldown": 5,
    }


def test_an_admin_edit_survives_a_restart_with_the_same_config():
    apply_at_start(CONFIG)
    _admin_edit(swap_affinity_bonus=30)
    effective = apply_at_start(CONFIG)
    assert effective.settings.swap_affinity_bonus == 30
    assert effective.settings.aging_divisor == 60
    assert effective.source.startswith("admin edit: swapAffinityBonus by alice at ")


def test_a_changed_config_value_wins_over_an_older_admin_edit():
    apply_at_start(CONFIG)
    _admin_edit(swap_affinity_bonus=30)
    effective = apply_at_start(CONFIG.with_changes(swap_affinity_bonus=20))
    assert effective.settings.swap_affinity_bonus == 20
    assert effective.source == "config file"
    change = SettingsChange.objects.filter(source="config file").get()
    assert (change.field, change.old, change.new, change.who) == (
        "swapAffinityBonus",
        30,
        20,
        "config file",
    )


def test_precedence_is_per_key():
    apply_at_start(CONFIG)
    _admin_edit(swap_affinity_bonus=30, aging_divisor=120)
    # the config file changes agingDivisor only: that key follows it, the bonus stays edited
    effective = apply_at_start(CONFIG.with_changes(aging_divisor=90))
    assert (effective.settings.aging_divisor, effective.settings.swap_affinity_bonus) == (90, 30)
    assert "swapAffinityBonus" in effective.source and "agingDivisor" not in effective.source


def test_keys_never_edited_follow_the_config_file():
    apply_at_start(CONFIG)
    effective = apply_at_start(CONFIG.with_changes(aging_divisor=5, fifo_priority={"m": 3}))
    assert effective.settings.aging_divisor == 5 and dict(effective.settings.fifo_priority) == {
        "m": 3
    }
    assert {c.field for c in SettingsChange.objects.all()} == {"agingDivisor", "fifoPriority"}


@pytest.mark.django_db(transaction=True)
def test_without_tables_the_config_file_is_used(monkeypatch):
    from django.db import DatabaseError

    def broken(settings, node=""):
        raise DatabaseError("no such table: dashboard_schedulersettingsrecord")

    monkeypatch.setattr("control.settings_store.apply_at_start", broken)
    effective = apply_at_start_or_config(CONFIG)
    assert effective.settings == CONFIG and effective.source == "config file"


# -- the admin ---------------------------------------------------------------------------


class _Dispatcher:
    def __init__(self) -> None:
        self.settings = CONFIG
        self.calls: list[tuple[SchedulerSettings, str]] = []

    def set_settings(self, settings: SchedulerSettings, source: str = "admin") -> None:
        self.calls.append((settings, source))
        self.settings = settings


@pytest.fixture
def running():
    dispatcher = _Dispatcher()
    runtime.install(runtime.Runtime(config=RUNNING_CONFIG, dispatcher=dispatcher, upstreams=None))  # type: ignore[arg-type]
    yield dispatcher
    runtime.install(None)


RUNNING_CONFIG = parse_config(
    {
        "models": {
            name: {"cmd": "fake --port ${PORT}", "aliases": aliases}
            for name, aliases in (("qwen3", ["qwen"]), ("llama", []), ("m", []))
        }
    }
)
"""The running server's models: fifoPriority may name them (or their aliases) only."""


@pytest.fixture
def admin_client(client, django_user_model):
    django_user_model.objects.create_superuser("alice", "alice@example.com", "pw-alice-123")
    client.login(username="alice", password="pw-alice-123")
    return client


def _form(**changes) -> dict:
    data = {
        "use": "serial",
        "aging_divisor": "60",
        "swap_affinity_bonus": "10",
        "fifo_priority": "{}",
        "start_failure_cooldown": "5",
        "_save": "Save",
    }
    data.update(changes)
    return data


def _change_url() -> str:
    return reverse("admin:control_schedulersettingsrecord_change", args=[1])


def test_the_admin_needs_a_login(client):
    response = client.get(reverse("admin:control_schedulersettingsrecord_changelist"))
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_the_settings_list_goes_to_the_one_row(admin_client, running):
    response = admin_client.get(reverse("admin:control_schedulersettingsrecord_changelist"))
    assert response.status_code == 302 and response["Location"] == _change_url()
    assert SchedulerSettingsRecord.objects.get().values["swapAffinityBonus"] == 10


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("swap_affinity_bonus", "100", "swapAffinityBonus: must be an integer 0..99"),
        ("swap_affinity_bonus", "-1", "swapAffinityBonus: must be an integer 0..99"),
        ("aging_divisor", "-5", "agingDivisor: must be a finite number &gt;= 0"),
        ("fifo_priority", '{"qwen": "high"}', "fifo.priority.qwen: must be an integer"),
    ],
)
def test_invalid_values_are_refused_with_the_config_key(
    admin_client, running, field, value, message
):
    apply_at_start(CONFIG)
    response = admin_client.post(_change_url(), _form(**{field: value}))
    assert response.status_code == 200
    assert message in response.content.decode()
    assert running.calls == []
    assert not SettingsChange.objects.exists()


def test_a_saved_change_reaches_the_running_dispatcher_and_is_recorded(admin_client, running):
    apply_at_start(CONFIG)
    response = admin_client.post(_change_url(), _form(swap_affinity_bonus="25"))
    assert response.status_code == 302
    ((settings, source),) = running.calls
    assert settings.swap_affinity_bonus == 25 and settings.aging_divisor == 60
    assert source.startswith("admin edit: swapAffinityBonus by alice at ")
    change = SettingsChange.objects.get()
    assert (change.who, change.field, change.old, change.new, change.source) == (
        "alice",
        "swapAffinityBonus",
        10,
        25,
        "admin",
    )
    record = SchedulerSettingsRecord.objects.get()
    assert record.updated_by == "alice" and set(record.admin_overrides) == {"swapAffinityBonus"}


def test_saving_without_a_change_records_nothing(admin_client, running):
    apply_at_start(CONFIG)
    assert admin_client.post(_change_url(), _form()).status_code == 302
    assert running.calls == [] and not SettingsChange.objects.exists()


def test_ensure_admin_creates_the_account_from_the_environment(
    monkeypatch, django_user_model, capsys
):
    monkeypatch.setenv("LLAMASWAP_ADMIN_PASSWORD", "s3cret-pass")
    monkeypatch.setenv("LLAMASWAP_ADMIN_USER", "ops")
    call_command("ensure_admin")
    user = django_user_model.objects.get(username="ops")
    assert user.is_superuser and user.check_password("s3cret-pass")
    monkeypatch.delenv("LLAMASWAP_ADMIN_PASSWORD")
    call_command("ensure_admin")
    assert "createsuperuser" in capsys.readouterr().out


# -- how the admin shows the values ------------------------------------------------------


def test_numbers_show_as_typed_and_the_sources_as_a_table(admin_client, running):
    apply_at_start(CONFIG.with_changes(fifo_priority={"qwen3": 10, "llama": -5}))
    _admin_edit(swap_affinity_bonus=30)
    html = admin_client.get(_change_url()).content.decode()
    assert 'name="aging_divisor" value="60"' in html and "60.0" not in html
    # fifo.priority: a row per model, then empty rows to add more
    assert 'name="fifo_priority-model-0" id="id_fifo_priority" value="llama"' in html
    assert 'name="fifo_priority-priority-0" value="-5"' in html
    assert 'name="fifo_priority-model-1" id="id_fifo_priority-model-1" value="qwen3"' in html
    assert 'name="fifo_priority-model-4"' in html and 'name="fifo_priority-model-5"' not in html
    assert "{&quot;" not in html and '{"' not in html.split("<form")[1]  # no raw JSON
    sources = html.split('class="value-sources"')[1].split("</table>")[0]
    assert "<td><code>agingDivisor</code></td><td>60</td><td>60</td><td>config file</td>" in sources
    assert "<td><code>fifoPriority</code></td><td>llama=-5, qwen3=10</td>" in sources
    assert (
        "<td><code>swapAffinityBonus</code></td><td>30</td><td>10</td><td>admin edit by alice at <time"
        in sources
    )
    assert 'data-show="zoned"' in sources and "/static/dashboard/time.js" in html


def test_fractional_numbers_keep_their_fraction(admin_client, running):
    apply_at_start(CONFIG.with_changes(aging_divisor=0.5))
    html = admin_client.get(_change_url()).content.decode()
    assert 'name="aging_divisor" value="0.5"' in html


def _rows(*pairs, extra: int = 2) -> dict:
    data = {}
    for i, (model, priority) in enumerate([*pairs, *[("", "")] * extra]):
        data[f"fifo_priority-model-{i}"] = model
        data[f"fifo_priority-priority-{i}"] = priority
    return data


def test_fifo_priorities_are_edited_as_rows(admin_client, running):
    apply_at_start(CONFIG)
    form = _form(**_rows(("qwen3", "10"), ("llama", " -5 ")))
    del form["fifo_priority"]
    assert admin_client.post(_change_url(), form).status_code == 302
    assert SchedulerSettingsRecord.objects.get().values["fifoPriority"] == {
        "llama": -5,
        "qwen3": 10,
    }
    ((settings, _),) = running.calls
    assert dict(settings.fifo_priority) == {"qwen3": 10, "llama": -5}
    # clearing a row's model id removes it (its priority left as it was), as the help says
    page = admin_client.get(_change_url()).content.decode()
    assert "Clear a model id to remove its row" in page
    form = _form(**_rows(("", "10"), ("llama", "-5")))
    del form["fifo_priority"]
    assert admin_client.post(_change_url(), form).status_code == 302
    assert SchedulerSettingsRecord.objects.get().values["fifoPriority"] == {"llama": -5}


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ((("qwen", "high"),), "fifo.priority.qwen: must be an integer"),
        ((("qwen", "1.5"),), "fifo.priority.qwen: must be an integer"),
        ((("qwen", ""),), "fifo.priority.qwen: give an integer priority"),
        ((("qwen", "1"), ("qwen", "2")), "fifo.priority.qwen: given twice"),
    ],
)
def test_invalid_fifo_rows_are_refused_and_kept(admin_client, running, rows, message):
    apply_at_start(CONFIG)
    form = _form(**_rows(*rows))
    del form["fifo_priority"]
    response = admin_client.post(_change_url(), form)
    html = response.content.decode()
    assert response.status_code == 200 and message in html
    assert 'value="qwen"' in html  # the rows come back as typed, to fix
    assert running.calls == [] and not SettingsChange.objects.exists()


def test_the_change_log_shows_values_as_typed(admin_client, running):
    apply_at_start(CONFIG)
    _admin_edit(aging_divisor=90.0, fifo_priority={"m": 3})
    html = admin_client.get(reverse("admin:control_settingschange_changelist")).content.decode()
    assert '<td class="field-old_value">60</td><td class="field-new_value">90</td>' in html
    assert '<td class="field-old_value">none</td><td class="field-new_value">m=3</td>' in html
    assert 'data-show="zoned"' in html


# -- the opt-in starvation bounds (issue 13) ---------------------------------------------


def test_the_bounds_are_edited_in_the_admin_and_reach_the_dispatcher(admin_client, running):
    apply_at_start(CONFIG)
    page = admin_client.get(_change_url()).content.decode()
    assert "Starvation bounds" in page and 'name="share_batch"' in page
    response = admin_client.post(
        _change_url(), _form(aging_cap="100", share_batch="0.2", share_normal="")
    )
    assert response.status_code == 302
    ((settings, _source),) = running.calls
    assert settings.aging_cap == 100 and {b.value: s for b, s in settings.band_share.items()} == {
        "batch": 0.2
    }
    record = SchedulerSettingsRecord.objects.get()
    assert record.values["bandShare"] == {"batch": 0.2} and record.values["agingCap"] == 100
    assert set(record.admin_overrides) == {"agingCap", "bandShare"}
    fields = sorted(SettingsChange.objects.values_list("field", flat=True))
    assert fields == ["agingCap", "bandShare"]
    # Shown as typed on the next visit; clearing them turns the bounds off again.
    page = admin_client.get(_change_url()).content.decode()
    assert 'name="aging_cap" value="100"' in page and 'name="share_batch" value="0.2"' in page
    assert admin_client.post(_change_url(), _form()).status_code == 302
    assert not running.calls[-1][0].bounded


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"aging_cap": "0"}, "agingCap: must be a finite number &gt; 0"),
        ({"share_batch": "1.5"}, "bandShare.batch: must be a number from 0 to 1"),
        ({"share_batch": "0.6", "share_normal": "0.6"}, "more than 1"),
    ],
)
def test_invalid_bounds_are_refused_with_the_config_key(admin_client, running, changes, message):
    apply_at_start(CONFIG)
    response = admin_client.post(_change_url(), _form(**changes))
    assert response.status_code == 200
    assert message in response.content.decode()
    assert running.calls == []


def test_fifo_priority_names_models_of_the_running_config_as_check_does(admin_client, running):
    apply_at_start(CONFIG)
    form = _form(**_rows(("nosuch", "5")))
    del form["fifo_priority"]
    response = admin_client.post(_change_url(), form)
    assert response.status_code == 200
    assert "fifo.priority.nosuch: unknown model &#x27;nosuch&#x27;" in response.content.decode()
    assert running.calls == [] and not SettingsChange.objects.exists()
    # An alias is applied and stored as its model's id, by the config file's rule.
    form = _form(**_rows(("qwen", "5")))
    del form["fifo_priority"]
    assert admin_client.post(_change_url(), form).status_code == 302
    ((settings, _),) = running.calls
    assert dict(settings.fifo_priority) == {"qwen3": 5}
