"""Scheduler settings in a fleet: config file < fleet-wide admin edit < this node's admin
edit (``scheduler.core.settings.layered`` / ``merge_node_at_start``), stored per node
(``control.settings_store``) so that a node's config file never overwrites what another
node's start or the admin wrote, and every change logged with its node."""

from __future__ import annotations

import uuid

import pytest
import redis
from django.urls import reverse
from hypothesis import given, settings
from hypothesis import strategies as st

from control import settings_store
from control.models import SchedulerSettingsRecord, SettingsChange
from control.settings_store import apply_at_start, effective_on, record_values, save_admin_edit
from fleet.node import Fleet
from scheduler import runtime
from scheduler.config import parse_config
from scheduler.core.policy import SchedulerSettings
from scheduler.core.settings import (
    FROM_CONFIG,
    FROM_FLEET,
    FROM_NODE,
    NAMES,
    layered,
    merge_node_at_start,
)
from scheduler.dispatcher import Dispatcher
from scheduler.testing import FakeProcessFactory
from tests.helpers import make_config, until
from tests.test_fleet import REDIS_URL, needs_redis

BASE = {"use": "serial", "agingDivisor": 60, "swapAffinityBonus": 10}
EDIT = {"by": "alice", "at": "2026-12-01 04:10:17 UTC"}
LATER = {"by": "bob", "at": "2026-12-02 09:00:00 UTC"}

# -- the rule, pure ----------------------------------------------------------------------------


def test_without_edits_a_node_follows_its_config_file():
    out = layered(BASE, {"agingDivisor": 1}, {}, {}, {})
    assert out.values["agingDivisor"] == 60 and out.sources["agingDivisor"] == FROM_CONFIG


def test_a_fleet_edit_beats_the_config_file_and_a_node_edit_beats_both():
    fleet_values = {**BASE, "agingDivisor": 300, "swapAffinityBonus": 40}
    fleet_edits = {"agingDivisor": EDIT, "swapAffinityBonus": EDIT}
    node_values = {**BASE, "swapAffinityBonus": 5}
    out = layered(BASE, fleet_values, fleet_edits, node_values, {"swapAffinityBonus": LATER})
    assert (out.values["agingDivisor"], out.sources["agingDivisor"]) == (300, FROM_FLEET)
    assert (out.values["swapAffinityBonus"], out.sources["swapAffinityBonus"]) == (5, FROM_NODE)
    assert (out.values["use"], out.sources["use"]) == ("serial", FROM_CONFIG)
    assert out.changed == [("agingDivisor", 60, 300)]


def test_a_changed_config_file_outranks_an_older_fleet_edit_on_its_node_only():
    fleet_values, fleet_edits = {"agingDivisor": 300}, {"agingDivisor": EDIT}
    on_a = {**BASE, "agingDivisor": 300}
    changed = {**BASE, "agingDivisor": 90}
    out = merge_node_at_start(changed, BASE, fleet_values, fleet_edits, on_a, {}, {})
    assert out.values["agingDivisor"] == 90 and out.sources["agingDivisor"] == FROM_CONFIG
    assert out.config_wins == {"agingDivisor": EDIT["at"]}
    assert out.changed == [("agingDivisor", 300, 90)]
    # The next start with the same file: still the config file's.
    again = merge_node_at_start(
        changed, changed, fleet_values, fleet_edits, out.values, {}, out.config_wins
    )
    assert again.values["agingDivisor"] == 90 and again.changed == []
    # A node whose config file did not change keeps the fleet edit.
    other = merge_node_at_start(BASE, BASE, fleet_values, fleet_edits, on_a, {}, {})
    assert other.values["agingDivisor"] == 300
    # A newer fleet edit applies again, and the stale mark goes.
    newer = layered(
        changed,
        {"agingDivisor": 500},
        {"agingDivisor": LATER},
        out.values,
        {},
        {"agingDivisor": EDIT["at"]},
    )
    assert newer.values["agingDivisor"] == 500 and newer.config_wins == {}


def test_a_changed_config_file_drops_the_nodes_own_edit_of_that_key():
    node_values = {**BASE, "swapAffinityBonus": 30}
    edits = {"swapAffinityBonus": EDIT}
    same = merge_node_at_start(BASE, BASE, {}, {}, node_values, edits, {})
    assert same.values["swapAffinityBonus"] == 30 and same.node_overrides == edits
    changed = {**BASE, "swapAffinityBonus": 20}
    out = merge_node_at_start(changed, BASE, {}, {}, node_values, edits, {})
    assert out.values["swapAffinityBonus"] == 20 and out.node_overrides == {}


def test_a_first_start_takes_the_fleet_edits():
    out = merge_node_at_start(
        BASE, None, {"agingDivisor": 300}, {"agingDivisor": EDIT}, BASE, {}, {}
    )
    assert out.values["agingDivisor"] == 300 and out.config_wins == {}


_value = st.integers(0, 3)
_layer = st.dictionaries(st.sampled_from(NAMES), _value)
_edits = st.dictionaries(
    st.sampled_from(NAMES), st.sampled_from([EDIT, LATER]).map(dict), max_size=len(NAMES)
)


@settings(max_examples=200, deadline=None)
@given(_layer, _layer, _layer, _edits, _layer, _edits)
def test_each_value_comes_from_the_highest_layer_that_has_it(
    config, previous, fleet_values, fleet_edits, node_values, node_edits
):
    out = merge_node_at_start(
        config, previous, fleet_values, fleet_edits, node_values, node_edits, {}
    )
    for name in NAMES:
        config_changed = previous.get(name) != config.get(name)
        if name in node_edits and not config_changed:
            assert (out.values[name], out.sources[name]) == (node_values.get(name), FROM_NODE)
        elif name in fleet_edits and not config_changed:
            assert (out.values[name], out.sources[name]) == (fleet_values.get(name), FROM_FLEET)
        else:
            assert (out.values[name], out.sources[name]) == (config.get(name), FROM_CONFIG)
    # A restart with the same config file changes nothing.
    again = merge_node_at_start(
        config, config, fleet_values, fleet_edits, out.values, out.node_overrides, out.config_wins
    )
    assert again.values == out.values and again.changed == []


# -- stored per node ---------------------------------------------------------------------------

CONFIG_A = SchedulerSettings.create(aging_divisor=60, swap_affinity_bonus=10)
CONFIG_B = SchedulerSettings.create(aging_divisor=120, swap_affinity_bonus=20)


def _edit(record: SchedulerSettingsRecord, user: str = "alice", **values) -> None:
    old = record_values(record)
    record.values = {**record.values, **values}
    record.save()
    save_admin_edit(record, old, user)


def _fleet_row() -> SchedulerSettingsRecord:
    return SchedulerSettingsRecord.objects.get(node="")


@pytest.mark.django_db
def test_two_nodes_with_different_config_files_keep_their_own():
    apply_at_start(CONFIG_A, "box-a")
    apply_at_start(CONFIG_B, "box-b")
    a = apply_at_start(CONFIG_A, "box-a")  # restarting in any order
    assert a.settings == CONFIG_A and a.source == "config file"
    assert effective_on("box-b").settings == CONFIG_B  # type: ignore[union-attr]
    assert not SettingsChange.objects.exists()  # nobody's config overwrote anyone's


@pytest.mark.django_db
def test_a_fleet_edit_reaches_every_node_and_a_node_edit_only_its_node():
    apply_at_start(CONFIG_A, "box-a")
    apply_at_start(CONFIG_B, "box-b")
    _edit(_fleet_row(), agingDivisor=300)
    _edit(SchedulerSettingsRecord.objects.get(node="box-a"), "bob", swapAffinityBonus=50)

    a, b = effective_on("box-a"), effective_on("box-b")
    assert a is not None and b is not None
    assert (a.settings.aging_divisor, a.settings.swap_affinity_bonus) == (300, 50)
    assert (b.settings.aging_divisor, b.settings.swap_affinity_bonus) == (300, 20)
    assert "agingDivisor by alice" in a.source and "(fleet-wide)" in a.source
    assert "swapAffinityBonus by bob" in a.source and "(this node)" in a.source
    assert "swapAffinityBonus" not in b.source

    # Restarts with the same config files keep both edits.
    assert apply_at_start(CONFIG_A, "box-a").settings == a.settings
    assert apply_at_start(CONFIG_B, "box-b").settings == b.settings
    # box-b's config file changes agingDivisor: box-b follows it, box-a keeps the fleet edit.
    b2 = apply_at_start(CONFIG_B.with_changes(aging_divisor=90), "box-b")
    assert b2.settings.aging_divisor == 90
    assert apply_at_start(CONFIG_A, "box-a").settings.aging_divisor == 300

    log = {(c.node, c.field, c.old, c.new, c.source) for c in SettingsChange.objects.all()}
    assert log == {
        ("", "agingDivisor", 60, 300, "admin"),
        ("box-a", "swapAffinityBonus", 10, 50, "admin"),
        ("box-b", "agingDivisor", 300, 90, "config file"),
    }


@pytest.mark.django_db
def test_a_single_box_keeps_using_the_fleet_row():
    apply_at_start(CONFIG_A)
    _edit(_fleet_row(), swapAffinityBonus=30)
    effective = apply_at_start(CONFIG_A)
    assert effective.settings.swap_affinity_bonus == 30
    assert SchedulerSettingsRecord.objects.count() == 1
    # Upgraded to a fleet: the box's admin edits become the fleet-wide ones.
    named = apply_at_start(CONFIG_B, "box-b")
    assert (named.settings.swap_affinity_bonus, named.settings.aging_divisor) == (30, 120)


# -- the admin ---------------------------------------------------------------------------------


class _Dispatcher:
    def __init__(self) -> None:
        self.calls: list[tuple[SchedulerSettings, str]] = []

    def set_settings(self, settings: SchedulerSettings, source: str = "admin") -> None:
        self.calls.append((settings, source))


@pytest.fixture
def on_box_a(settings, client, django_user_model):
    """This process is node box-a, with a running (fake) dispatcher and a staff login."""
    settings.LLAMASWAP_NODE = "box-a"
    dispatcher = _Dispatcher()
    config = parse_config({"models": {"m": {"cmd": "fake --port ${PORT}"}}})
    runtime.install(runtime.Runtime(config=config, dispatcher=dispatcher, upstreams=None))  # type: ignore[arg-type]
    django_user_model.objects.create_superuser("alice", "alice@example.com", "pw-alice-123")
    client.login(username="alice", password="pw-alice-123")
    yield client, dispatcher
    runtime.install(None)


def _form(record: SchedulerSettingsRecord, **changes: str) -> dict[str, str]:
    values = record_values(record)
    data = {
        "use": values["use"],
        "aging_divisor": str(values["agingDivisor"]),
        "swap_affinity_bonus": str(values["swapAffinityBonus"]),
        "fifo_priority": "{}",
        "start_failure_cooldown": str(values["startFailureCooldown"]),
        "_save": "Save",
    }
    return {**data, **changes}


def _url(record: SchedulerSettingsRecord) -> str:
    return reverse("admin:control_schedulersettingsrecord_change", args=[record.pk])


@pytest.mark.django_db
def test_the_admin_lists_the_fleet_row_and_each_node_and_edits_them(on_box_a):
    client, dispatcher = on_box_a
    apply_at_start(CONFIG_A, "box-a")
    apply_at_start(CONFIG_B, "box-b")
    html = client.get(reverse("admin:control_schedulersettingsrecord_changelist")).content.decode()
    assert "every node" in html and "node box-a" in html and "node box-b" in html

    fleet = _fleet_row()
    response = client.post(_url(fleet), _form(fleet, aging_divisor="300"))
    assert response.status_code == 302
    ((pushed, source),) = dispatcher.calls  # box-a: the fleet edit over its config file
    assert (pushed.aging_divisor, pushed.swap_affinity_bonus) == (300, 10)
    assert "(fleet-wide)" in source

    b = SchedulerSettingsRecord.objects.get(node="box-b")
    assert client.post(_url(b), _form(b, swap_affinity_bonus="77")).status_code == 302
    assert len(dispatcher.calls) == 1  # box-b's edit is box-b's: not pushed here
    assert effective_on("box-b").settings.swap_affinity_bonus == 77  # type: ignore[union-attr]
    refused = client.post(_url(b), _form(b, swap_affinity_bonus="100"))
    assert "swapAffinityBonus: must be an integer 0..99" in refused.content.decode()
    html = client.get(_url(SchedulerSettingsRecord.objects.get(node="box-b"))).content.decode()
    assert "fleet-wide admin edit by alice" in html and "admin edit for this node by" in html
    assert {(c.node, c.field) for c in SettingsChange.objects.all()} == {
        ("", "agingDivisor"),
        ("box-b", "swapAffinityBonus"),
    }


@pytest.mark.django_db(transaction=True)  # apply_remote closes its thread's connection
def test_another_nodes_change_is_read_with_this_nodes_own_rows(on_box_a):
    from control.remote import apply_remote

    _, dispatcher = on_box_a
    apply_at_start(CONFIG_A, "box-a")
    apply_at_start(CONFIG_B, "box-b")
    _edit(_fleet_row(), "carol", swapAffinityBonus=42)  # saved on box-b
    apply_remote("settings", "box-b")
    ((pushed, source),) = dispatcher.calls
    assert (pushed.aging_divisor, pushed.swap_affinity_bonus) == (60, 42)
    assert source.endswith("(saved on box-b)")
    assert settings_store.stored_settings() == pushed  # replays read this node's values


# -- through two real nodes on Redis -------------------------------------------------------------


@needs_redis
@pytest.mark.django_db(transaction=True)
async def test_edits_saved_on_box_a_reach_box_b_with_box_bs_own_config(settings):
    """box-a saves a fleet-wide edit and an edit for itself alone, and announces them;
    box-b's running scheduler takes the fleet edit over its own config file's values and
    nothing of box-a's own edit."""
    from asgiref.sync import sync_to_async

    from control import changes

    prefix = f"llamaswap-test:{uuid.uuid4().hex}"
    built: list[tuple[Fleet, Dispatcher]] = []
    try:
        for name in ("box-b", "box-a"):  # box-a last: this process's announcer
            dispatcher = Dispatcher(make_config("qwen"), process_factory=FakeProcessFactory())
            await dispatcher.start()
            fleet = Fleet(name, f"http://{name}:8080", REDIS_URL, dispatcher, prefix=prefix)
            await fleet.start()
            built.append((fleet, dispatcher))
        (b, on_b), (a, _) = built
        await until(lambda: not a.degraded() and not b.degraded(), timeout=2.0)
        settings.LLAMASWAP_NODE = "box-b"  # the receiving node's process
        runtime.install(runtime.Runtime(config=on_b.config, dispatcher=on_b, upstreams=None))  # type: ignore[arg-type]
        config_b = on_b.settings.with_changes(swap_affinity_bonus=20)

        def save_on_box_a() -> None:
            apply_at_start(CONFIG_A, "box-a")
            apply_at_start(config_b, "box-b")
            _edit(SchedulerSettingsRecord.objects.get(node="box-a"), "bob", swapAffinityBonus=50)
            _edit(_fleet_row(), agingDivisor=300)

        await sync_to_async(save_on_box_a)()
        changes.changed("settings")  # what box-a's admin save does once committed
        await until(lambda: on_b.settings.aging_divisor == 300, timeout=2.0)
        assert on_b.settings.swap_affinity_bonus == 20
        assert "(fleet-wide)" in on_b.settings_source and "saved on box-a" in on_b.settings_source
    finally:
        runtime.install(None)
        for fleet, dispatcher in built:
            await fleet.stop()
            await dispatcher.stop(grace=0)
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{prefix}:*"):
            client.delete(key)
