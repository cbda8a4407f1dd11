"""Admin-issued API keys: made in the admin, shown once, stored hashed, and reloaded into
the running key ring on every save, revoke and delete (control/keys.py)."""

from __future__ import annotations

import re

import pytest
from asgiref.sync import sync_to_async
from django.urls import reverse

from control import keys as issued
from control.admin import IssuedKeyForm
from control.models import IssuedKey
from scheduler import runtime
from scheduler.config import Config, parse_config
from scheduler.keys import ApiKey, KeyPolicy, KeyRing, digest
from tests.asgi import Call, Gate, in_process

pytestmark = pytest.mark.django_db

KEY_SHOWN = re.compile(r'<code class="issued-key">(sk-llamaswap-[A-Za-z0-9_-]+)</code>')
ADD_URL = "admin:control_issuedkey_add"
LIST_URL = "admin:control_issuedkey_changelist"


@pytest.fixture
def admin_client(client, django_user_model):
    django_user_model.objects.create_superuser("alice", "alice@example.com", "pw-alice-123")
    client.login(username="alice", password="pw-alice-123")
    return client


@pytest.fixture
def running():
    """A runtime with one config key; the admin's keys join its ring."""
    ring = KeyRing({"sk-config": ApiKey("from-config")})
    runtime.install(
        runtime.Runtime(config=Config(models={}), dispatcher=None, upstreams=None, keys=ring)  # type: ignore[arg-type]
    )
    yield ring
    runtime.install(None)


def _add(client, name="farm", **fields) -> tuple[str, object]:
    data = {"name": name, "priority_default": "", "priority_ceiling": "", "priority_offset": "0"}
    data.update(fields)
    response = client.post(reverse(ADD_URL), data, follow=True)
    assert response.status_code == 200
    page = response.content.decode()
    shown = KEY_SHOWN.findall(page)
    assert len(shown) == 1, page
    return shown[0], response


def _revoke(client, *records: IssuedKey):
    return client.post(
        reverse(LIST_URL),
        {"action": "revoke", "_selected_action": [r.pk for r in records]},
        follow=True,
    )


# -- adding ------------------------------------------------------------------------------


def test_adding_shows_the_key_once_and_stores_only_its_digest(admin_client, running):
    key, response = _add(admin_client, "farm", priority_default="batch", priority_ceiling="0")
    assert key.startswith(issued.KEY_PREFIX) and len(key) == len(issued.KEY_PREFIX) + 43
    assert "copy it now; it is not stored" in response.content.decode()
    record = IssuedKey.objects.get()
    assert record.digest == digest(key) and record.prefix == key[:21]
    assert record.created_by == "alice" and record.revoked_at is None
    assert (record.priority_default, record.priority_ceiling, record.priority_offset) == (
        -100,
        0,
        0,
    )
    # No column holds the key.
    for field in IssuedKey._meta.concrete_fields:
        assert key not in str(getattr(record, field.attname))
    # Shown once: neither the list nor the change page shows it again.
    for url in (reverse(LIST_URL), reverse("admin:control_issuedkey_change", args=[record.pk])):
        page = admin_client.get(url).content.decode()
        assert key not in page and record.prefix in page


def test_the_key_is_never_a_form_field(admin_client):
    key, _ = _add(admin_client)
    record = IssuedKey.objects.get()
    page = admin_client.get(reverse("admin:control_issuedkey_change", args=[record.pk]))
    html = page.content.decode()
    assert 'name="digest"' not in html and 'name="prefix"' not in html
    # Posting a digest or prefix changes nothing.
    admin_client.post(
        reverse("admin:control_issuedkey_change", args=[record.pk]),
        {
            "name": "renamed",
            "priority_default": "",
            "priority_ceiling": "",
            "priority_offset": "0",
            "digest": "0" * 64,
            "prefix": "x",
        },
    )
    record.refresh_from_db()
    assert record.name == "renamed" and record.digest == digest(key)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("/admin/dashboard/issuedkey/add/", "/admin/control/issuedkey/add/"),
        ("/admin/dashboard/accesscontrol/", "/admin/control/accesscontrol/"),
        (
            "/admin/dashboard/settingschange/?field=accessControl",
            "/admin/control/settingschange/?field=accessControl",
        ),
        ("/admin/dashboard/schedulersettingsrecord/", "/admin/control/schedulersettingsrecord/"),
    ],
)
def test_the_old_admin_addresses_lead_to_the_moved_pages(admin_client, old, new):
    """The pages were under /admin/dashboard/ before the records moved to the control
    app: a bookmark still gets there (permanently, keeping the method and the query)."""
    response = admin_client.get(old)
    assert (response.status_code, response["Location"]) == (308, new)
    landed = admin_client.get(old, follow=True)
    assert landed.status_code == 200 and "/admin/control/" in landed.request["PATH_INFO"]
    # Anything else under /admin/dashboard/ is not redirected.
    assert admin_client.get("/admin/dashboard/other/").status_code == 404


def test_keys_are_distinct(admin_client):
    first, _ = _add(admin_client, "a")
    second, _ = _add(admin_client, "b")
    assert first != second


@pytest.mark.parametrize(
    ("fields", "policy"),
    [
        ({}, KeyPolicy()),
        ({"priority_default": "interactive"}, KeyPolicy(default=100)),
        ({"priority_default": " Batch ", "priority_ceiling": "normal"}, KeyPolicy(-100, 0)),
        ({"priority_ceiling": "50", "priority_offset": "5"}, KeyPolicy(ceiling=50, offset=5)),
        ({"priority_default": "-7", "priority_offset": ""}, KeyPolicy(default=-7)),
    ],
)
def test_the_form_reads_priorities_like_the_config(fields, policy):
    data = {"name": "k", "priority_default": "", "priority_ceiling": "", "priority_offset": "0"}
    form = IssuedKeyForm(data={**data, **fields})
    assert form.is_valid(), form.errors
    assert form.save(commit=False).policy == policy


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"priority_default": "urgent"}, "priority_default", "priority.default: must be"),
        ({"priority_ceiling": "1.5"}, "priority_ceiling", "priority.ceiling: must be"),
        ({"priority_offset": "batch"}, "priority_offset", "Enter a whole number"),
        (
            {"priority_default": "interactive", "priority_ceiling": "normal"},
            "priority_default",
            "above the ceiling",
        ),
        ({"name": ""}, "name", "required"),
    ],
)
def test_the_form_refuses_what_the_config_refuses(fields, field, message):
    data = {"name": "k", "priority_default": "", "priority_ceiling": "", "priority_offset": "0"}
    form = IssuedKeyForm(data={**data, **fields})
    assert not form.is_valid()
    assert message in " ".join(form.errors[field]), form.errors


def test_names_are_unique(admin_client):
    _add(admin_client, "farm")
    response = admin_client.post(
        reverse(ADD_URL),
        {"name": "farm", "priority_default": "", "priority_ceiling": "", "priority_offset": "0"},
    )
    assert response.status_code == 200 and "already exists" in response.content.decode()
    assert IssuedKey.objects.count() == 1


# -- issued_keys() and revoking ----------------------------------------------------------


def test_issued_keys_leave_out_revoked_ones(admin_client):
    key, _ = _add(admin_client, "farm", priority_ceiling="normal", priority_offset="3")
    record = IssuedKey.objects.get()
    assert issued.issued_keys() == {
        digest(key): ApiKey("farm", KeyPolicy(ceiling=0, offset=3), source="admin")
    }
    response = _revoke(admin_client, record)
    assert "Revoked 1 key." in response.content.decode()
    record.refresh_from_db()
    assert record.revoked_at is not None
    assert issued.issued_keys() == {}
    # Revoking again changes nothing.
    revoked_at = record.revoked_at
    assert "revoked already" in _revoke(admin_client, record).content.decode()
    record.refresh_from_db()
    assert record.revoked_at == revoked_at


def test_reload_without_a_server_does_nothing():
    assert not runtime.is_running()
    assert issued.reload() is None


def test_reload_into_a_given_ring():
    key = issued.new_key()
    record = IssuedKey(name="k", priority_default=-100)
    issued.assign(record, key)
    record.save()
    ring = KeyRing({"sk-config": ApiKey("c")})
    issued.reload(ring)
    assert ring.lookup(key) == ApiKey("k", KeyPolicy(default=-100), source="admin")
    assert ring.lookup("sk-config") == ApiKey("c")


# -- the running key ring follows the admin (signals, after the commit) -----------------


def test_the_running_ring_follows_add_edit_revoke_and_delete(
    admin_client, running, django_capture_on_commit_callbacks
):
    assert running.lookup("sk-config") == ApiKey("from-config")
    with django_capture_on_commit_callbacks(execute=True):
        key, response = _add(admin_client, "farm", priority_default="batch")
    assert "In force at once." in response.content.decode()
    assert runtime.current().keys.lookup(key) == ApiKey(
        "farm", KeyPolicy(default=-100), source="admin"
    )
    assert running.enabled and running.lookup("sk-config") == ApiKey("from-config")

    record = IssuedKey.objects.get()
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(
            reverse("admin:control_issuedkey_change", args=[record.pk]),
            {
                "name": "farm",
                "priority_default": "batch",
                "priority_ceiling": "normal",
                "priority_offset": "0",
            },
        )
    assert running.lookup(key).policy == KeyPolicy(default=-100, ceiling=0)

    with django_capture_on_commit_callbacks(execute=True):
        _revoke(admin_client, record)
    assert runtime.current().keys.lookup(key) is None
    assert running.lookup("sk-config") == ApiKey("from-config")

    with django_capture_on_commit_callbacks(execute=True):
        other, _ = _add(admin_client, "other")
    assert running.lookup(other) is not None
    with django_capture_on_commit_callbacks(execute=True):
        IssuedKey.objects.get(name="other").delete()
    assert running.lookup(other) is None


def test_a_rolled_back_save_does_not_reach_the_ring(running, django_capture_on_commit_callbacks):
    from django.db import transaction

    key = issued.new_key()
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        try:
            with transaction.atomic():
                record = IssuedKey(name="k")
                issued.assign(record, key)
                record.save()
                raise RuntimeError("abort")
        except RuntimeError:
            pass
    assert callbacks == [] and running.lookup(key) is None


def test_reload_at_start_goes_on_without_the_table(running, monkeypatch, caplog):
    from django.db import DatabaseError

    def broken():
        raise DatabaseError("no such table: dashboard_issuedkey")

    monkeypatch.setattr(issued, "issued_keys", broken)
    issued.reload_at_start()  # logs, does not raise
    assert "issued API keys not loaded" in caplog.text
    assert running.lookup("sk-config") == ApiKey("from-config")


# -- end to end: the admin and the proxy in one process -----------------------------------


@pytest.mark.django_db(transaction=True)
async def test_a_key_revoked_in_the_admin_stops_working_on_the_very_next_request(
    client, django_user_model
):
    config = parse_config({"models": {"m": {"cmd": "fake", "proxy": "http://model.invalid:9000"}}})
    body = b'{"model": "m", "messages": []}'
    ring = KeyRing({"sk-config": ApiKey("from-config")})
    async with in_process(config, transport=Gate(opened=True), keys=ring) as world:
        await sync_to_async(django_user_model.objects.create_superuser)(
            "bob", "b@example.com", "pw-bob-123"
        )
        await sync_to_async(client.login)(username="bob", password="pw-bob-123")
        key, _ = await sync_to_async(_add)(client, "farm")

        def ask() -> Call:
            return Call(
                world.app,
                "/v1/chat/completions",
                body,
                headers=[(b"authorization", b"Bearer " + key.encode())],
            )

        served = ask()
        await served.done()
        assert served.status == 200, served.body
        record = await IssuedKey.objects.aget()
        await sync_to_async(_revoke)(client, record)
        refused = ask()
        await refused.done()
        assert refused.status == 401
        assert b"www-authenticate" not in refused.headers  # no Basic challenge by default


# -- a fleet: keys for every node, or limited to some ------------------------------------------


def test_a_key_limited_to_some_nodes_is_in_their_rings_only(admin_client, settings):
    everywhere, _ = _add(admin_client, "everywhere")
    only_b, _ = _add(admin_client, "only-b", nodes="box-b, box-c box-b")
    assert IssuedKey.objects.get(name="only-b").nodes == ["box-b", "box-c"]
    assert set(issued.issued_keys("box-b")) == {digest(everywhere), digest(only_b)}
    assert set(issued.issued_keys("box-a")) == {digest(everywhere)}
    assert set(issued.issued_keys("")) == {digest(everywhere)}  # a single box: unlimited ones
    # What a client notices: box-a's ring refuses the key, box-b's takes it.
    settings.LLAMASWAP_NODE = "box-a"
    ring_a = KeyRing()
    issued.reload(ring_a)
    settings.LLAMASWAP_NODE = "box-b"
    ring_b = KeyRing()
    issued.reload(ring_b)
    assert ring_a.lookup(only_b) is None and ring_a.lookup(everywhere) is not None
    assert ring_b.lookup(only_b) == ApiKey("only-b", KeyPolicy(), source="admin")
    # Lifting the limit: every node.
    record = IssuedKey.objects.get(name="only-b")
    edit = reverse("admin:control_issuedkey_change", args=[record.pk])
    page = admin_client.get(edit).content.decode()
    assert 'value="box-b, box-c"' in page
    data = {"name": "only-b", "priority_default": "", "priority_ceiling": "", "nodes": ""}
    assert admin_client.post(edit, {**data, "priority_offset": "0"}).status_code == 302
    assert set(issued.issued_keys("box-a")) == {digest(everywhere), digest(only_b)}


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ("x" * 65, "nodes: a node name has at most 64 characters"),
        (" ".join(f"n{i}" for i in range(257)), "nodes: at most 256 names, got 257"),
    ],
)
def test_the_node_list_is_bounded(nodes, message):
    data = {"name": "k", "priority_default": "", "priority_ceiling": "", "priority_offset": "0"}
    form = IssuedKeyForm(data={**data, "nodes": nodes})
    assert not form.is_valid()
    assert message in " ".join(form.errors["nodes"]), form.errors
