"""Admin for the scheduler settings: validated like the config file, applied at once.

Values show as typed (agingDivisor 60, not 60.0), the fifo priorities are edited as a
table of model id and priority, and where each value comes from (config file or an admin
edit, by whom and when) is a table rather than raw JSON.
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import UTC, datetime
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.forms import AdminAuthenticationForm
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.text import capfirst

from dashboard import keys as issued
from dashboard import login_throttle, settings_store
from dashboard.models import (
    SCOPE_CHOICES,
    AccessControl,
    IssuedKey,
    SchedulerSettingsRecord,
    SettingsChange,
)
from dashboard.templatetags.dash import timetag
from proxy.errors import echo
from scheduler.config import ConfigError, key_policy
from scheduler.core.policy import (
    KEY_AGING,
    KEY_AGING_CAP,
    KEY_BAND_SHARE,
    KEY_BONUS,
    KEY_FIFO,
    KEY_USE,
    SchedulerSettings,
    SettingsError,
)
from scheduler.core.priority import BANDS
from scheduler.keys import DEFAULT_SCOPES, KeyPolicy, Scope

log = logging.getLogger("llamaswap.admin")

# SettingsError.key -> form field
_FIELD_OF_KEY = {
    KEY_USE: "use",
    KEY_AGING: "aging_divisor",
    KEY_BONUS: "swap_affinity_bonus",
    KEY_AGING_CAP: "aging_cap",
    KEY_FIFO: "fifo_priority",
}
SHARE_FIELDS = {band: f"share_{band.value}" for band in BANDS}
"""bandShare is edited as one number per band."""

PRECEDENCE = (
    "A saved value reaches the running scheduler for its next pick, and stays in effect "
    "after a restart, until the config file's value for the same key changes: then the "
    "config file wins. Keys never edited here follow the config file."
)

BOUNDS_HELP = (
    "Under sustained overload unbounded aging turns the queue into first come, first "
    "served: batch work that has waited long enough outranks fresh interactive work. "
    "agingCap stops aging at a number of points (below 100 no request crosses a band by "
    "waiting); bandShare guarantees a band a share of GPU time while it has work waiting, "
    "so nothing starves even with a cap. The what-if page replays the recorded history "
    "with candidate values before you apply them."
)

ADMIN_JS = ("dashboard/time.js",)  # times in the viewer's zone, as on the dashboard pages


def _field_for(key: str) -> str:
    if key.startswith(KEY_FIFO):
        return "fifo_priority"
    for band, name in SHARE_FIELDS.items():
        if key == f"{KEY_BAND_SHARE}.{band.value}":
            return name
    if key == KEY_BAND_SHARE:
        return "__all__"
    return _FIELD_OF_KEY.get(key, "__all__")


def show_value(value: Any) -> str:
    """A setting as typed: 60 (not 60.0), 0.5, serial, qwen3=10, llama=5 (or none)."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={show_value(v)}" for k, v in sorted(value.items())) or "none"
    return str(value)


# -- the form --------------------------------------------------------------------------------


class AsTypedFloatField(forms.FloatField):
    """A float shown as typed: 60, not 60.0 (fractions stay: 0.5)."""

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value


class FifoPriorityWidget(forms.Widget):
    """fifo.priority as a table: one row per model (model id, priority) and empty rows to
    add more; clearing a row's model id removes it. Posts ``<name>-model-N`` and
    ``<name>-priority-N``; a raw JSON object under ``<name>`` is still read (scripts)."""

    EXTRA_ROWS = 3

    def _row_keys(self, data: Any, name: str) -> list[int]:
        prefix = f"{name}-model-"
        return sorted(
            int(key[len(prefix) :])
            for key in data
            if key.startswith(prefix) and key[len(prefix) :].isdigit()
        )

    def value_from_datadict(self, data: Any, files: Any, name: str) -> Any:
        rows = self._row_keys(data, name)
        if not rows:
            return data.get(name)  # a raw JSON object, or nothing
        return [
            (data.get(f"{name}-model-{i}", ""), data.get(f"{name}-priority-{i}", "")) for i in rows
        ]

    def value_omitted_from_data(self, data: Any, files: Any, name: str) -> bool:
        return name not in data and not self._row_keys(data, name)

    @staticmethod
    def _pairs(value: Any) -> list[tuple[str, str]]:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except ValueError:
                value = {}
        if isinstance(value, dict):
            return [(str(k), show_value(v)) for k, v in sorted(value.items())]
        if isinstance(value, list | tuple):
            return [(str(m), str(p)) for m, p in value]
        return []

    def render(self, name: str, value: Any, attrs: Any = None, renderer: Any = None) -> SafeString:
        pairs = [p for p in self._pairs(value) if p != ("", "")]
        pairs += [("", "")] * self.EXTRA_ROWS
        first_id = (attrs or {}).get("id") or f"id_{name}"
        rows = format_html_join(
            "\n",
            '<tr><td><input type="text" name="{}-model-{}" id="{}" value="{}" '
            'aria-label="model id, row {}" placeholder="model id" class="vTextField"></td>'
            '<td><input type="number" step="1" name="{}-priority-{}" value="{}" '
            'aria-label="priority, row {}" placeholder="0"></td></tr>',
            (
                (
                    name,
                    i,
                    first_id if i == 0 else f"{first_id}-model-{i}",
                    model,
                    i + 1,
                    name,
                    i,
                    priority,
                    i + 1,
                )
                for i, (model, priority) in enumerate(pairs)
            ),
        )
        return format_html(
            '<table class="fifo-priority"><thead><tr><th>model id</th><th>priority</th></tr>'
            "</thead><tbody>{}</tbody></table>",
            rows,
        )


class FifoPriorityField(forms.Field):
    """The rows as ``{model id: priority}``; the values are checked by the scheduler's own
    validation (``fifo.priority.<model>: must be an integer``) in the form's clean()."""

    widget = FifoPriorityWidget

    def to_python(self, value: Any) -> Any:
        if value in (None, "", [], (), {}):
            return {}
        if isinstance(value, dict):
            return value
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError as error:
                raise ValidationError(f"fifo.priority: not a JSON object ({error})") from None
        result: dict[str, Any] = {}
        for number, (model, priority) in enumerate(value, start=1):
            model, priority = model.strip(), priority.strip()
            if not model and not priority:
                continue
            if not model:
                raise ValidationError(
                    f"fifo.priority: row {number} has the priority {priority!r} but no model id"
                )
            if model in result:
                raise ValidationError(f"fifo.priority.{model}: given twice")
            if not priority:
                raise ValidationError(
                    f"fifo.priority.{model}: give an integer priority, "
                    "or clear the model id to remove the row"
                )
            try:
                result[model] = int(priority)
            except ValueError:
                result[model] = priority  # refused below, with the scheduler's own message
        return result

    def has_changed(self, initial: Any, data: Any) -> bool:
        try:
            return (initial or {}) != self.to_python(data)
        except ValidationError:
            return True


class SchedulerSettingsForm(forms.ModelForm):
    aging_divisor = AsTypedFloatField(
        label=capfirst(SchedulerSettingsRecord._meta.get_field("aging_divisor").verbose_name),
        help_text=SchedulerSettingsRecord._meta.get_field("aging_divisor").help_text,
    )
    fifo_priority = FifoPriorityField(
        label="Fifo priorities (fifo.priority)",
        required=False,
        help_text=(
            "fifo scheduler: a priority per model id (higher goes first). "
            "Clear a model id to remove its row; save to get more empty rows."
        ),
    )

    aging_cap = AsTypedFloatField(
        label=capfirst(SchedulerSettingsRecord._meta.get_field("aging_cap").verbose_name),
        help_text=SchedulerSettingsRecord._meta.get_field("aging_cap").help_text,
        required=False,
    )
    share_interactive = AsTypedFloatField(
        label="Interactive share (bandShare.interactive)", required=False
    )
    share_normal = AsTypedFloatField(label="Normal share (bandShare.normal)", required=False)
    share_batch = AsTypedFloatField(
        label="Batch share (bandShare.batch)",
        required=False,
        help_text=(
            "Opt-in: the share of GPU time (0..1; the shares sum to at most 1) a band gets "
            "while it has work waiting: when it has had less than its share since it last "
            "had nothing waiting, its best request goes next. Empty or 0: no share (the "
            "default). E.g. batch 0.2: a batch flood gets at least a fifth of the GPU."
        ),
    )

    class Meta:
        model = SchedulerSettingsRecord
        fields = [
            "use",
            "aging_divisor",
            "swap_affinity_bonus",
            "aging_cap",
            "fifo_priority",
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        shares = (self.instance.band_share or {}) if self.instance is not None else {}
        for band, name in SHARE_FIELDS.items():
            value = shares.get(band.value)
            self.fields[name].initial = value

    def band_share(self) -> dict[str, float]:
        data = self.cleaned_data
        return {
            band.value: data[name]
            for band, name in SHARE_FIELDS.items()
            if data.get(name) not in (None, 0)
        }

    def save(self, commit: bool = True) -> SchedulerSettingsRecord:
        self.instance.band_share = self.band_share()
        return super().save(commit)

    def clean_fifo_priority(self):
        value = self.cleaned_data.get("fifo_priority")
        return {} if value in (None, "") else value

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        try:
            self.validated = settings_store.to_settings(
                {
                    "use": data.get("use"),
                    "agingDivisor": data.get("aging_divisor"),
                    "swapAffinityBonus": data.get("swap_affinity_bonus"),
                    "fifoPriority": data.get("fifo_priority") or {},
                    "agingCap": data.get("aging_cap"),
                    "bandShare": self.band_share(),
                }
            )
        except SettingsError as error:
            self.add_error(
                _field_for(error.key), f"{error.key}: {error.reason} (got {error.value!r})"
            )
        return data


# -- the admin pages -------------------------------------------------------------------------


def _stamp_tag(stamp: str) -> SafeString | str:
    """An override's time ("2026-12-01 04:10:17 UTC", settings_store's stamp) as a <time>."""
    try:
        when = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S UTC").replace(tzinfo=UTC)
    except (TypeError, ValueError):
        return stamp or "?"
    return timetag(when, "zoned")


@admin.register(SchedulerSettingsRecord)
class SchedulerSettingsAdmin(admin.ModelAdmin):
    form = SchedulerSettingsForm
    fieldsets = [
        (
            None,
            {
                "fields": ["use", "aging_divisor", "swap_affinity_bonus", "fifo_priority"],
                "description": PRECEDENCE,
            },
        ),
        (
            "Starvation bounds (opt-in; off by default, as the scheduling contract says)",
            {
                "fields": ["aging_cap", "share_interactive", "share_normal", "share_batch"],
                "description": BOUNDS_HELP,
            },
        ),
        (
            "Where the values come from",
            {"fields": ["value_sources", "updated_by", "last_changed"]},
        ),
    ]
    readonly_fields = ["value_sources", "updated_by", "last_changed"]

    class Media:
        js = ADMIN_JS
        css = {"all": ("dashboard/admin.css",)}

    @admin.display(description="values")
    def value_sources(self, obj: SchedulerSettingsRecord) -> SafeString:
        """Per key: the value in effect, the config file's (at the last start), and where
        the one in effect comes from."""
        if obj.pk is None:
            return format_html("{}", "–")
        values = settings_store.record_values(obj)
        config = obj.config_values or {}
        overrides = obj.admin_overrides or {}
        rows = []
        for key in settings_store.FIELDS:
            info = overrides.get(key)
            if info:
                source = format_html(
                    "admin edit by {} at {}", info.get("by") or "?", _stamp_tag(info.get("at", ""))
                )
            else:
                source = format_html("{}", "config file")
            rows.append(
                (
                    key,
                    show_value(values.get(key)),
                    show_value(config.get(key)) if key in config else "–",
                    source,
                )
            )
        return format_html(
            '<table class="value-sources"><thead><tr><th>key</th><th>in effect</th>'
            "<th>config file (at the last start)</th><th>from</th></tr></thead>"
            "<tbody>{}</tbody></table>",
            format_html_join(
                "\n",
                "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td></tr>",
                rows,
            ),
        )

    @admin.display(description="last changed")
    def last_changed(self, obj: SchedulerSettingsRecord) -> SafeString | str:
        return timetag(obj.updated_at, "zoned") if obj.updated_at else "–"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return not SchedulerSettingsRecord.objects.exists() and super().has_add_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context=None):
        """There is one row: go straight to it (created from the running settings if the
        server has not stored any yet)."""
        record = SchedulerSettingsRecord.objects.filter(
            pk=SchedulerSettingsRecord.SINGLETON_PK
        ).first()
        if record is None:
            record = _initial_record()
        return HttpResponseRedirect(
            reverse("admin:dashboard_schedulersettingsrecord_change", args=[record.pk])
        )

    def save_model(
        self, request: HttpRequest, obj: SchedulerSettingsRecord, form, change: bool
    ) -> None:
        before = SchedulerSettingsRecord.objects.filter(pk=obj.pk).first()
        old = settings_store.record_values(before) if before is not None else {}
        super().save_model(request, obj, form, change)
        settings, source, changes = settings_store.save_admin_edit(
            obj, old, request.user.get_username()
        )
        if not changes:
            return
        if settings_store.push_to_dispatcher(settings, source):
            self.message_user(request, "Applied to the running scheduler from its next pick on.")
        else:
            self.message_user(
                request,
                "Saved. No server runs in this process: it takes effect when `manage.py serve` starts.",
                messages.WARNING,
            )


def _initial_record() -> SchedulerSettingsRecord:
    from scheduler import runtime

    # Never started yet: the defaults stand in for the config file's values.
    settings = (
        runtime.current().dispatcher.settings if runtime.is_running() else SchedulerSettings()
    )
    record = SchedulerSettingsRecord(pk=SchedulerSettingsRecord.SINGLETON_PK)
    values = settings_store.settings_values(settings)
    for key, field in settings_store.FIELDS.items():
        setattr(record, field, values[key])
    record.config_values = values
    record.save()
    return record


@admin.register(SettingsChange)
class SettingsChangeAdmin(admin.ModelAdmin):
    list_display = ["when", "who", "field", "old_value", "new_value", "source"]
    list_filter = ["source", "field"]

    class Media:
        js = ADMIN_JS

    @admin.display(description="at", ordering="at")
    def when(self, obj: SettingsChange) -> SafeString | str:
        return timetag(obj.at, "zoned")

    @admin.display(description="old")
    def old_value(self, obj: SettingsChange) -> str:
        return show_value(obj.old)

    @admin.display(description="new")
    def new_value(self, obj: SettingsChange) -> str:
        return show_value(obj.new)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


# -- issued API keys -------------------------------------------------------------------------

_POLICY_FIELDS = {  # key_policy()'s error key -> form field
    "priority.default": "priority_default",
    "priority.ceiling": "priority_ceiling",
    "priority.offset": "priority_offset",
}
PRIORITY_HELP = "An integer, or interactive (100), normal (0) or batch (-100)."


class IssuedKeyForm(forms.ModelForm):
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

    class Meta:
        model = IssuedKey
        fields = ["name", "priority_default", "priority_ceiling", "priority_offset", "scopes"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:  # [] stored by an older version: inference
            self.initial["scopes"] = sorted(s.value for s in self.instance.scope_set)

    def clean_scopes(self) -> list[str]:
        chosen = self.cleaned_data.get("scopes") or [s.value for s in DEFAULT_SCOPES]
        return sorted(Scope(name).value for name in chosen)

    def clean(self):
        data = super().clean()
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
class IssuedKeyAdmin(admin.ModelAdmin):
    """Adding generates the key and shows it once; only its digest and prefix are kept."""

    form = IssuedKeyForm
    list_display = ["name", "key_prefix", "policy", "scope_list", "created", "created_by", "revoked"]
    search_fields = ["name", "prefix"]
    actions = ["revoke"]

    class Media:
        js = ADMIN_JS

    def get_fields(self, request: HttpRequest, obj: IssuedKey | None = None) -> list[str]:
        policy = ["priority_default", "priority_ceiling", "priority_offset", "scopes"]
        if obj is None:
            return ["name", *policy]
        return ["name", "key_prefix", *policy, "created", "created_by", "revoked"]

    def get_fieldsets(self, request: HttpRequest, obj: IssuedKey | None = None):
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

    @admin.display(description="created", ordering="created_at")
    def created(self, obj: IssuedKey) -> SafeString | str:
        return timetag(obj.created_at, "zoned")

    @admin.display(description="revoked", ordering="revoked_at")
    def revoked(self, obj: IssuedKey) -> SafeString | str:
        return timetag(obj.revoked_at, "zoned") if obj.revoked_at else "–"

    def save_model(self, request: HttpRequest, obj: IssuedKey, form, change: bool) -> None:
        if not change:
            key = issued.new_key()
            issued.assign(obj, key)
            obj.created_by = request.user.get_username()
            obj._new_key = key  # type: ignore[attr-defined]  # for response_add, never saved
        super().save_model(request, obj, form, change)

    def response_add(self, request: HttpRequest, obj: IssuedKey, post_url_continue=None):
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
    def revoke(self, request: HttpRequest, queryset) -> None:
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


class AccessControlForm(forms.ModelForm):
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
class AccessControlAdmin(admin.ModelAdmin):
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

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context=None):
        """There is one row: go straight to it."""
        record, _ = AccessControl.objects.get_or_create(pk=AccessControl.SINGLETON_PK)
        return HttpResponseRedirect(reverse("admin:dashboard_accesscontrol_change", args=[record.pk]))

    def save_model(self, request: HttpRequest, obj: AccessControl, form, change: bool) -> None:
        # Through dashboard.keys: the change-log row, the log line and the running ring.
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


# -- the admin login, throttled (dashboard/login_throttle.py) --------------------------------


class ThrottledLoginForm(AdminAuthenticationForm):
    """The admin's login form, refusing a locked username and address before checking
    the password, and counting each failure."""

    def clean(self) -> dict[str, Any]:
        username = self.cleaned_data.get("username") or ""
        address = login_throttle.client_address(self.request)
        wait = login_throttle.throttle.locked_for(username, address)
        if wait:
            self.request.login_throttled = True  # type: ignore[union-attr]  # the view's 429
            log.info(
                "admin login refused: locked",
                extra={"username": echo(username, 50), "client": address, "seconds": round(wait)},
            )
            raise ValidationError(login_throttle.lock_message(wait), code="throttled")
        try:
            data = super().clean()
        except ValidationError:
            if login_throttle.throttle.failed(username, address):
                self.request.login_throttled = True  # type: ignore[union-attr]
                limits = login_throttle.throttle.limits
                log.warning(
                    "admin login locked after repeated failures",
                    extra={
                        "username": echo(username, 50),
                        "client": address,
                        "failures": limits.failures,
                        "lockout_seconds": limits.lockout,
                    },
                )
                raise ValidationError(
                    login_throttle.lock_message(limits.lockout), code="throttled"
                ) from None
            raise
        login_throttle.throttle.succeeded(username, address)
        return data


def _throttled_status(login_view):
    """The admin's login view answering 429 (not 200) while the form says "locked"."""

    @functools.wraps(login_view)
    def view(request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        response = login_view(request, extra_context)
        if getattr(request, "login_throttled", False):
            response.status_code = 429
        return response

    return view


admin.site.login_form = ThrottledLoginForm
admin.site.login = _throttled_status(admin.site.login)  # type: ignore[method-assign]
