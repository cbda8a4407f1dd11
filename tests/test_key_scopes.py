"""Key scopes, the key ring that stays keyed, and the login throttle: the logic, without a
server (tests/test_e2e_access.py drives the same through the real one)."""

from __future__ import annotations

import pytest
from django.core.cache.backends.locmem import LocMemCache
from django.urls import reverse

from control import keys as issued
from control.models import AccessControl, IssuedKey, SettingsChange
from dashboard.login_throttle import Limits, LoginThrottle
from scheduler import runtime
from scheduler.config import Config, ConfigError, parse_config
from scheduler.keys import ALL_SCOPES, DEFAULT_SCOPES, ApiKey, KeyRing, Scope, digest
from tests.test_access import RULES, url_patterns
from web.access import EXEMPT, PATH_SCOPES, needs_key, required_scope

INF, MOD, PRO, OPS, MET = (
    Scope.INFERENCE,
    Scope.MODELS,
    Scope.PROFILES,
    Scope.OPERATOR,
    Scope.METRICS,
)

# -- config: apiKeys[].scopes ----------------------------------------------------------------


def _keys(entries) -> dict[str, ApiKey]:
    config = parse_config(
        {"models": {"m": {"cmd": "x", "proxy": "http://127.0.0.1:9"}}, "apiKeys": entries}
    )
    return dict(config.api_keys)


@pytest.mark.parametrize(
    ("entry", "scopes"),
    [
        ("sk-plain", DEFAULT_SCOPES),  # llama-swap's string form: inference only
        ({"key": "sk-a"}, DEFAULT_SCOPES),  # no scopes: the same
        ({"key": "sk-a", "scopes": None}, DEFAULT_SCOPES),
        ({"key": "sk-a", "scopes": ["metrics"]}, frozenset({MET})),  # a scraper: no inference
        ({"key": "sk-a", "scopes": ["models", " operator", "models"]}, frozenset({MOD, OPS})),
        ({"key": "sk-a", "scopes": [s.value for s in Scope]}, ALL_SCOPES),
    ],
)
def test_config_scopes(entry, scopes):
    (key,) = _keys([entry]).values()
    assert key.scopes == scopes


@pytest.mark.parametrize(
    ("entries", "where", "message"),
    [
        (
            [{"key": "sk-a", "scopes": ["inference", "admin"]}],
            "apiKeys[0].scopes[1]",
            "unknown scope 'admin'",
        ),
        (["sk-x", {"key": "sk-a", "scopes": ["Models"]}], "apiKeys[1].scopes[0]", "unknown scope"),
        ([{"key": "sk-a", "scopes": [1]}], "apiKeys[0].scopes[0]", "unknown scope 1"),
        ([{"key": "sk-a", "scopes": "operator"}], "apiKeys[0].scopes", "must be a list"),
        ([{"key": "sk-a", "scopes": []}], "apiKeys[0].scopes", "at least one scope"),
        ([{"key": "sk-a", "scope": ["models"]}], "apiKeys[0].scope", "unknown field"),
    ],
)
def test_config_scope_errors_name_the_key(entries, where, message):
    with pytest.raises(ConfigError) as raised:
        _keys(entries)
    assert raised.value.key == where
    assert message in str(raised.value)


# -- the path table ----------------------------------------------------------------------------

SCOPE_OF_PATTERN = {
    "^upstream/(?P<rest>.+)$": INF,
    "v1/models": INF,
    "running": INF,
    "api/profiles": INF,
    "unload": MOD,
    "api/models/unload": MOD,
    "api/models/unload/<path:model_name>": MOD,
    "api/profiles/active": PRO,
    "api/queue": OPS,
    "logs": OPS,
    "logs/stream": OPS,
    "logs/stream/upstream": OPS,
    "logs/stream/proxy": OPS,
    "logs/stream/<path:model_name>": OPS,
    "api/models/load/<path:model_name>": MOD,
    "api/metrics/activity": OPS,
    "api/metrics/stats": OPS,
    "api/captures/<str:capture_id>": OPS,
    "api/events": OPS,
    "api/inflight/<str:request_id>/cancel": OPS,
    "api/version": INF,
    "api/requests/<str:request_id>": OPS,
    "metrics": MET,
}


def test_every_key_path_in_the_urlconf_has_its_scope():
    """Each URL pattern a key opens needs the scope written here (inference patterns are
    the OpenAI endpoints); a new path without a decision fails."""
    for pattern in url_patterns():
        _kind, (_method, path, _body) = RULES[pattern]
        if not needs_key(path):
            assert pattern not in SCOPE_OF_PATTERN, pattern
            continue
        assert required_scope(path) == SCOPE_OF_PATTERN.get(pattern, INF), (pattern, path)


@pytest.mark.parametrize(
    ("path", "scope"),
    [
        ("/unload/", MOD),  # trailing slashes do not change what a path needs
        ("/api/queue/", OPS),
        ("/metrics/", MET),
        ("/logs/stream/", OPS),
        ("/logs/anything", OPS),
        ("/api/models/unload/", MOD),
        ("/api/models/unload/a/b", MOD),
        ("/api/requests/", OPS),
        ("/api/profiles/active/", PRO),
        ("/upstream/m/slots", INF),
        ("/v1/no-such-endpoint", INF),  # a 404 for any key holder
        ("/api/no-such", INF),
    ],
)
def test_path_variants_need_the_same_scope(path, scope):
    assert needs_key(path)
    assert required_scope(path) == scope


def test_the_table_names_only_key_paths():
    assert all(needs_key(path) for path in PATH_SCOPES if path not in EXEMPT)


# -- the ring stays keyed ----------------------------------------------------------------------


def test_a_ring_that_held_a_key_stays_required():
    ring = KeyRing()
    calls = []
    ring.on_required = lambda: calls.append(1)
    assert not ring.enabled
    ring.set_admin_keys({digest("sk-a"): ApiKey("a", source="admin")})
    assert ring.enabled and ring.required and calls == [1]
    ring.set_admin_keys({})  # the last key revoked
    assert ring.enabled and ring.lookup("sk-a") is None
    ring.set_config_keys({"sk-c": ApiKey("c")})
    ring.set_config_keys({})
    assert calls == [1]  # once: it never stopped being required
    ring.set_required(False)  # the operator's act
    assert not ring.enabled
    assert KeyRing({"sk-c": ApiKey("c")}).required  # config keys at start


@pytest.fixture
def running():
    ring = KeyRing()
    runtime.install(
        runtime.Runtime(config=Config(models={}), dispatcher=None, upstreams=None, keys=ring)  # type: ignore[arg-type]
    )
    yield ring
    runtime.install(None)


def _audit() -> list[tuple[str, object, object, str]]:
    rows = SettingsChange.objects.filter(field=AccessControl.FIELD).order_by("id")
    return [(r.who, r.old, r.new, r.source) for r in rows]


@pytest.mark.django_db
def test_the_first_issued_key_turns_keys_on_and_revoking_it_does_not_turn_them_off(
    running, django_capture_on_commit_callbacks
):
    record = IssuedKey(name="farm")
    issued.assign(record, "sk-llamaswap-farm")
    with django_capture_on_commit_callbacks(execute=True):
        record.save()  # the signal reloads the ring after the commit
    assert running.enabled and issued.keys_required()
    assert _audit() == [("issued API key farm", False, True, "admin")]
    with django_capture_on_commit_callbacks(execute=True):
        record.delete()
    assert running.enabled and running.lookup("sk-llamaswap-farm") is None
    ring = KeyRing()  # a restart: the stored state comes back
    issued.reload(ring)
    assert ring.enabled
    with django_capture_on_commit_callbacks(execute=True):
        assert issued.set_keys_required(False, "alice")
    assert not running.enabled and not issued.keys_required()
    assert _audit()[-1] == ("alice", True, False, "admin")
    assert not issued.set_keys_required(False, "alice")  # no change, no row
    assert len(_audit()) == 2


@pytest.mark.django_db
def test_config_keys_at_start_are_stored():
    ring = KeyRing({"sk-c": ApiKey("c")})
    issued.reload(ring)
    assert issued.keys_required()
    assert _audit() == [("config file apiKeys", False, True, "config file")]


@pytest.mark.django_db
def test_issued_keys_carry_their_scopes(admin_client, running):
    data = {"name": "ops", "priority_default": "", "priority_ceiling": "", "priority_offset": "0"}
    response = admin_client.post(
        reverse("admin:control_issuedkey_add"), {**data, "scopes": ["models", "metrics"]}
    )
    assert response.status_code == 302
    assert IssuedKey.objects.get(name="ops").scopes == ["metrics", "models"]
    admin_client.post(reverse("admin:control_issuedkey_add"), {**data, "name": "plain"})
    assert IssuedKey.objects.get(name="plain").scopes == ["inference"]  # none checked
    scopes = {key.name: key.scopes for key in issued.issued_keys().values()}
    assert scopes == {"ops": frozenset({MOD, MET}), "plain": DEFAULT_SCOPES}
    assert IssuedKey(name="old", scopes=[]).scope_set == DEFAULT_SCOPES  # before scopes


@pytest.fixture
def admin_client(client, django_user_model):
    django_user_model.objects.create_superuser("alice", "alice@example.com", "pw-alice-123")
    client.force_login(django_user_model.objects.get(username="alice"))
    return client


@pytest.mark.django_db
def test_the_add_form_says_what_the_first_key_does(admin_client, running):
    page = admin_client.get(reverse("admin:control_issuedkey_add")).content.decode()
    assert "issuing this key turns access control on" in page
    assert "stays on after the last key is revoked" in page
    issued.set_keys_required(True, "alice")
    page = admin_client.get(reverse("admin:control_issuedkey_add")).content.decode()
    assert "API keys are required already" in page


@pytest.mark.django_db
def test_access_control_cannot_be_turned_off_while_a_key_is_in_force(
    admin_client, running, django_capture_on_commit_callbacks
):
    record = IssuedKey(name="farm")
    issued.assign(record, "sk-llamaswap-farm")
    with django_capture_on_commit_callbacks(execute=True):
        record.save()
    url = reverse("admin:control_accesscontrol_change", args=[AccessControl.SINGLETON_PK])
    assert admin_client.get(reverse("admin:control_accesscontrol_changelist")).url == url
    refused = admin_client.post(url, {})
    assert refused.status_code == 200
    assert "Keys are in force (issued key farm)" in refused.content.decode()
    assert issued.keys_required()
    record.revoked_at = record.created_at
    with django_capture_on_commit_callbacks(execute=True):
        record.save()
        assert admin_client.post(url, {}).status_code == 302
    assert not issued.keys_required() and not running.enabled
    assert _audit()[-1] == ("alice", True, False, "admin")


# -- the profile switch checks the scope beside the act ----------------------------------------


@pytest.mark.django_db(transaction=True)
async def test_the_profile_api_refuses_a_key_without_the_profiles_scope(running, rf):
    from dashboard.profiles import active_profile_api

    request = rf.put("/api/profiles/active", b'{"name": null}', content_type="application/json")
    request.scope = {"llamaswap.api_key": ApiKey("capped")}
    answer = await active_profile_api(request)
    assert answer.status_code == 403
    assert b"insufficient_scope" in answer.content and b"'profiles'" in answer.content


# -- the login throttle ------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def throttle():
    clock = Clock()
    cache = LocMemCache("throttle-test", {})
    cache.clear()
    limits = Limits(failures=3, window=60, lockout=120, address_failures=5)
    return LoginThrottle(limits, cache, clock), clock


def test_failures_within_the_window_lock_the_pair(throttle):
    t, clock = throttle
    assert not t.failed("bob", "10.0.0.1") and not t.failed("bob", "10.0.0.1")
    assert t.locked_for("bob", "10.0.0.1") == 0
    assert t.failed("bob", "10.0.0.1")  # the third
    assert t.locked_for("bob", "10.0.0.1") == 120
    assert t.locked_for("BOB ", "10.0.0.1") == 120  # the same user, however typed
    assert t.locked_for("bob", "10.0.0.2") == 0  # another address
    assert t.locked_for("alice", "10.0.0.1") == 0  # another user
    clock.now += 119
    assert t.locked_for("bob", "10.0.0.1") == pytest.approx(1)
    clock.now += 1
    assert t.locked_for("bob", "10.0.0.1") == 0


def test_old_failures_and_a_success_do_not_count(throttle):
    t, clock = throttle
    t.failed("bob", "a")
    t.failed("bob", "a")
    clock.now += 61  # out of the window
    assert not t.failed("bob", "a") and not t.failed("bob", "a")
    t.succeeded("bob", "a")
    assert not t.failed("bob", "a") and not t.failed("bob", "a")


def test_one_address_spraying_usernames_is_locked(throttle):
    t, _ = throttle
    locks = [t.failed(f"user{i}", "10.0.0.9") for i in range(5)]
    assert locks == [False, False, False, False, True]
    assert t.locked_for("someone-else", "10.0.0.9") == 120
    assert t.locked_for("user0", "10.0.0.8") == 0


@pytest.mark.django_db
def test_the_admin_login_form_is_throttled(client, django_user_model):
    from dashboard.login_throttle import throttle as shared

    django_user_model.objects.create_user("bob", password="pw-bob-123", is_staff=True)
    shared.cache.clear()
    url = reverse("admin:login")
    statuses = [
        client.post(url, {"username": "bob", "password": "nope"}).status_code for _ in range(5)
    ]
    assert statuses == [200, 200, 200, 200, 429]
    locked = client.post(url, {"username": "bob", "password": "pw-bob-123"})
    assert locked.status_code == 429 and "Too many failed logins" in locked.content.decode()
    shared.cache.clear()
    assert client.post(url, {"username": "bob", "password": "pw-bob-123"}).status_code == 302


@pytest.mark.django_db(transaction=True)
def test_a_config_reload_that_brings_the_first_key_is_stored(running):
    import threading

    issued.reload_at_start()  # installs the ring's hook
    assert not running.enabled and not issued.keys_required()
    running.set_config_keys({"sk-c": ApiKey("c")})  # what llamaswap_site/reload.py does
    for thread in threading.enumerate():
        if thread.name == "llamaswap-keys-required":
            thread.join(timeout=10)
    assert issued.keys_required()
    assert _audit() == [("config file apiKeys (reload)", False, True, "config file")]
    running.set_config_keys({})  # and a later reload without keys leaves it keyed
    assert running.enabled
