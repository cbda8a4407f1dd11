"""The admin of the control records: issued API keys and access control here; the
scheduler settings and their change log in :mod:`control.settings_admin` (registered by
importing it). The admin login's throttle is the dashboard's (``dashboard/admin.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from control import keys as issued
from control.html import timetag
from control.models import SCOPE_CHOICES, AccessControl, IssuedKey, SchedulerSettingsRecord
from control.settings_admin import ADMIN_JS
from scheduler.config import ConfigError, key_policy
from scheduler.keys import DEFAULT_SCOPES, KeyPolicy, Scope

if TYPE_CHECKING:  # generic in django-stubs only
    _KeyForm = forms.ModelForm[IssuedKey]
    _KeyAdmin = admin.ModelAdmin[IssuedKey]
    _AccessForm = forms.ModelForm[AccessControl]
    _AccessAdmin = admin.ModelAdmin[AccessControl]
else:
    _KeyForm = _AccessForm = forms.ModelForm
    _KeyAdmin = _AccessAdmin = admin.ModelAdmin

# -- issued API keys -------------------------------------------------------------------------

_POLICY_FIELDS = {  # key_policy()'s error key -> form field
    "priority.default": "priority_default",
    "priority.ceiling": "priority_ceiling",
    "priority.offset": "priority_offset",
}
MAX_KEY_NODES = 256
"""The most node names a key may be limited to (as many nodes as a fleet view keeps)."""
PRIORITY_HELP = "An integer, or interactive (100), normal (0) or batch (-100)."


class IssuedKeyForm(_KeyForm):
    """Name and priority rule, checked as the config's ``apiKeys[].priority`` is; the
    priorities may be given as aliases (stored as integers). The key is never a field."""

    priority_default = forms.CharField(
        label="Default priority",
        required=False,
        help_text=f"When a request sends no X-LlamaSwap-Priority (empty: 0). {PRIORITY_HELP}",
    )
    priority_ceiling = forms.CharField(
        label="Priority ceiling",
        required=False,
        help_text=f"The most a request may claim; more runs at the ceiling (empty: none). "
        f"{PRIORITY_HELP}",
    )
    priority_offset = forms.IntegerField(
        label="Priority offset",
        required=False,
        initial=0,
        help_text="Added after the ceiling, e.g. to order two tiers inside one band.",
    )
    scopes = forms.MultipleChoiceField(
        label="Scopes",
        choices=SCOPE_CHOICES,
        widget=forms.CheckboxSelectMultiple,
        required=False,
        initial=[s.value for s in DEFAULT_SCOPES],
        help_text="What the key may reach; none checked: inference only (as a config key "
        "without scopes). A staff login reaches everything.",
    )

    nodes = forms.CharField(
        label="Nodes",
        required=False,
        help_text="Fleet mode: the node names the key works on, separated by commas or "
        "spaces; empty: every node (and a single box).",
    )

    class Meta:
        model = IssuedKey
        fields = [
            "name",
            "priority_default",
            "priority_ceiling",
            "priority_offset",
            "scopes",
            "nodes",
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:  # [] stored by an older version: inference
            self.initial["scopes"] = sorted(s.value for s in self.instance.scope_set)
            self.initial["nodes"] = ", ".join(self.instance.nodes or ())

    def clean_nodes(self) -> list[str]:
        """``box-a, box-b`` -> ``["box-a", "box-b"]``: sorted, once each, bounded."""
        raw = self.cleaned_data.get("nodes") or ""
        if isinstance(raw, list):  # the stored list, as the form's initial
            raw = " ".join(str(n) for n in raw)
        names = sorted(set(raw.replace(",", " ").split()))
        too_long = [n for n in names if len(n) > SchedulerSettingsRecord.MAX_NODE]
        if too_long:
            raise ValidationError(
                f"nodes: a node name has at most {SchedulerSettingsRecord.MAX_NODE} "
                f"characters, got {too_long[0][:80]!r}"
            )
        if len(names) > MAX_KEY_NODES:
            raise ValidationError(f"nodes: at most {MAX_KEY_NODES} names, got {len(names)}")
        return names

    def clean_scopes(self) -> list[str]:
        chosen = self.cleaned_data.get("scopes") or [s.value for s in DEFAULT_SCOPES]
        return sorted(Scope(name).value for name in chosen)

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if any(name in self.errors for name in _POLICY_FIELDS.values()):
            return data
        rule = {
            "default": data.get("priority_default") or None,
            "ceiling": data.get("priority_ceiling") or None,
            "offset": data.get("priority_offset"),
        }
        try:
            policy = key_policy(rule, "priority")
        except ConfigError as error:
            self.add_error(_POLICY_FIELDS.get(error.key), f"{error.key}: {error.message}")
            return data
        data["priority_default"] = policy.default
        data["priority_ceiling"] = policy.ceiling
        data["priority_offset"] = policy.offset
        return data


def show_policy(policy: KeyPolicy) -> str:
    """``default -100, ceiling 0, offset +5``; ``–`` for no rule."""
    parts = []
    if policy.default is not None:
        parts.append(f"default {policy.default}")
    if policy.ceiling is not None:
        parts.append(f"ceiling {policy.ceiling}")
    if policy.offset:
        parts.append(f"offset {policy.offset:+d}")
    return ", ".join(parts) or "–"


def _takes_effect() -> str:
    from scheduler import runtime

    if runtime.is_running():
        return "In force at once."
    return "No server runs in this process: it takes effect when `llamaswap serve` starts."


@admin.register(IssuedKey)
class IssuedKeyAdmin(_KeyAdmin):
    """Adding generates the key and shows it once; only its digest and prefix are kept."""

    form = IssuedKeyForm
    list_display = [
        "name",
        "key_prefix",
        "policy",
        "scope_list",
        "node_list",
        "created",
        "created_by",
        "revoked",
    ]
    search_fields = ["name", "prefix"]
    actions = ["revoke"]

    class Media:
        js = ADMIN_JS

    def get_fields(self, request: HttpRequest, obj: IssuedKey | None = None) -> list[Any]:
        policy = ["priority_default", "priority_ceiling", "priority_offset", "scopes", "nodes"]
        if obj is None:
            return ["name", *policy]
        return ["name", "key_prefix", *policy, "created", "created_by", "revoked"]

    def get_fieldsets(self, request: HttpRequest, obj: IssuedKey | None = None) -> Any:
        fieldsets = super().get_fieldsets(request, obj)
        if obj is None:  # what issuing a key does to everyone else
            fieldsets = [(None, {**fieldsets[0][1], "description": first_key_note()})]
        return fieldsets

    def get_readonly_fields(self, request: HttpRequest, obj: IssuedKey | None = None) -> list[str]:
        return [] if obj is None else ["key_prefix", "created", "created_by", "revoked"]

    @admin.display(description="key", ordering="prefix")
    def key_prefix(self, obj: IssuedKey) -> SafeString:
        return format_html("<code>{}…</code>", obj.prefix)

    @admin.display(description="priority rule")
    def policy(self, obj: IssuedKey) -> str:
        return show_policy(obj.policy)

    @admin.display(description="scopes")
    def scope_list(self, obj: IssuedKey) -> str:
        return ", ".join(sorted(s.value for s in obj.scope_set))

    @admin.display(description="nodes")
    def node_list(self, obj: IssuedKey) -> str:
        return ", ".join(obj.nodes or ()) or "every node"

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: IssuedKey) -> SafeString | str:
        return timetag(obj.created_at, "zoned")

    @admin.display(description="revoked", ordering="revoked_at")
    def revoked(self, obj: IssuedKey) -> SafeString | str:
        return timetag(obj.revoked_at, "zoned") if obj.revoked_at else "–"

    def save_model(self, request: HttpRequest, obj: IssuedKey, form: Any, change: bool) -> None:
        if not change:
            key = issued.new_key()
            issued.assign(obj, key)
            obj.created_by = request.user.get_username()
            obj._new_key = key  # type: ignore[attr-defined]  # for response_add, never saved
        super().save_model(request, obj, form, change)

    def response_add(
        self, request: HttpRequest, obj: IssuedKey, post_url_continue: str | None = None
    ) -> HttpResponse:
        key = getattr(obj, "_new_key", None)
        if key:
            self.message_user(
                request,
                format_html(
                    'The key of “{}” is <code class="issued-key">{}</code>: copy it now; '
                    "it is not stored and will not be shown again. {}",
                    obj.name,
                    key,
                    _takes_effect(),
                ),
                messages.WARNING,
            )
        return super().response_add(request, obj, post_url_continue)

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[IssuedKey]) -> None:
        now = timezone.now()
        count = 0
        # One save each (not update()): post_save reloads the running key ring.
        for record in queryset.filter(revoked_at__isnull=True):
            record.revoked_at = now
            record.save(update_fields=["revoked_at"])
            count += 1
        if count:
            self.message_user(
                request, f"Revoked {count} key{'s' if count != 1 else ''}. {_takes_effect()}"
            )
        else:
            self.message_user(request, "The selected keys were revoked already.", messages.INFO)


def first_key_note() -> str:
    """The add form's warning: a first key turns access control on for everyone."""
    from scheduler import runtime

    if issued.keys_required() or runtime.is_running() and runtime.current().keys.enabled:
        return (
            "API keys are required already: this key is one more. Access control stays on "
            "when keys are revoked, until a staff member turns it off under Access control."
        )
    return (
        "No API key is required yet: issuing this key turns access control on. From then "
        "on every API client needs a key (the dashboard and the JSON API a login), and it "
        "stays on after the last key is revoked or deleted, until a staff member turns it "
        "off under Access control."
    )


# -- access control: whether keys stay required -----------------------------------------------


def keys_in_force() -> list[str]:
    """What keeps access control on: the config's keys and the issued keys not revoked."""
    from scheduler import runtime

    issued_names = IssuedKey.objects.filter(revoked_at__isnull=True).values_list("name", flat=True)
    found = [f"issued key {name}" for name in issued_names]
    if runtime.is_running() and runtime.current().keys.has_config_keys:
        found.insert(0, "the config file's apiKeys")
    return found


class AccessControlForm(_AccessForm):
    class Meta:
        model = AccessControl
        fields = ["keys_required"]

    def clean_keys_required(self) -> bool:
        required = bool(self.cleaned_data.get("keys_required"))
        if not required and (found := keys_in_force()):
            raise ValidationError(
                "Keys are in force (%(keys)s): revoke the issued keys and remove apiKeys "
                "from the config first; while a key exists, keys stay required.",
                params={"keys": ", ".join(found)},
                code="keys_in_force",
            )
        return required


@admin.register(AccessControl)
class AccessControlAdmin(_AccessAdmin):
    """One row: whether the API needs keys when none is in force (the box stays keyed
    until a staff member turns this off here; every change is in the change log)."""

    form = AccessControlForm
    fields = ["keys_required", "in_force", "changed_by", "last_changed"]
    readonly_fields = ["in_force", "changed_by", "last_changed"]

    class Media:
        js = ADMIN_JS

    @admin.display(description="keys in force")
    def in_force(self, obj: AccessControl) -> str:
        return ", ".join(keys_in_force()) or "none"

    @admin.display(description="last changed")
    def last_changed(self, obj: AccessControl) -> SafeString | str:
        return timetag(obj.changed_at, "zoned") if obj.changed_at else "–"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: AccessControl | None = None) -> bool:
        return False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponseRedirect:
        """There is one row: go straight to it."""
        record, _ = AccessControl.objects.get_or_create(pk=AccessControl.SINGLETON_PK)
        return HttpResponseRedirect(reverse("admin:control_accesscontrol_change", args=[record.pk]))

    def save_model(self, request: HttpRequest, obj: AccessControl, form: Any, change: bool) -> None:
        # Through control.keys: the change-log row, the log line and the running ring.
        required = form.cleaned_data["keys_required"]
        if issued.set_keys_required(required, request.user.get_username()):
            if required:
                self.message_user(request, "API keys are required on every API path from now on.")
            else:
                self.message_user(
                    request,
                    "Access control is off: the API is open to every caller until a key is "
                    "issued or configured.",
                    messages.WARNING,
                )
        obj.refresh_from_db()
