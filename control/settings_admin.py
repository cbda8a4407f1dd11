"""Admin for the scheduler settings: validated like the config file, applied at once.

The form is generated from the settings table (:data:`scheduler.core.settings.SETTINGS`):
one field per setting (``bandShare``: one number per band), labelled and explained by
its row, validated by :meth:`SchedulerSettings.create` so that an error names the config
key exactly as ``llamaswap check`` does. Values show as typed (agingDivisor 60, not
60.0), the fifo priorities are edited as a table of model id and priority, and where
each value comes from (config file or an admin edit, by whom and when) is a table rather
than raw JSON.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.db import transaction
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.text import capfirst

from control import changes as fleet_changes
from control import settings_store
from control.html import timetag
from control.models import SchedulerSettingsRecord, SettingsChange, this_node
from scheduler.config import ConfigError, resolve_fifo_priority
from scheduler.core.policy import SchedulerSettings, SettingsError
from scheduler.core.priority import BANDS
from scheduler.core.settings import BY_NAME, SETTINGS, SOURCE_CONFIG, Kind, Section, Setting

if TYPE_CHECKING:  # generic in django-stubs only
    _RecordForm = forms.ModelForm[SchedulerSettingsRecord]
    _RecordAdmin = admin.ModelAdmin[SchedulerSettingsRecord]
    _ChangeAdmin = admin.ModelAdmin[SettingsChange]
else:
    _RecordForm = forms.ModelForm
    _RecordAdmin = _ChangeAdmin = admin.ModelAdmin

PRECEDENCE = (
    "A saved value reaches the running scheduler for its next pick, and stays in effect "
    "after a restart, until the config file's value for the same key changes: then the "
    "config file wins. Keys never edited here follow the config file. In a fleet, the "
    "row for every node holds fleet-wide edits and a node's row edits for that node "
    "alone: its config file < fleet-wide edit < its own edit."
)

BOUNDS_HELP = (
    "Under sustained overload unbounded aging turns the queue into first come, first "
    "served: batch work that has waited long enough outranks fresh interactive work. "
    "agingCap stops aging at a number of points (below 100 no request crosses a band by "
    "waiting); bandShare guarantees a band a share of GPU time while it has work waiting, "
    "so nothing starves even with a cap. The what-if page replays the recorded history "
    "with candidate values before you apply them."
)

SECTIONS: dict[Section, tuple[str | None, str]] = {
    Section.MAIN: (None, PRECEDENCE),
    Section.BOUNDS: (
        "Starvation bounds (opt-in; off by default, as the scheduling contract says)",
        BOUNDS_HELP,
    ),
    Section.STARTS: ("Model starts", ""),
}
"""The admin page's fieldsets, one per section of the settings table."""

FIFO_KEY = BY_NAME["fifoPriority"].key
"""The fifo priorities' config key, as the table's errors name it."""

ADMIN_JS = ("dashboard/time.js",)  # times in the viewer's zone, as on the dashboard pages


def _fieldsets() -> list[Any]:
    sets: list[Any] = []  # (title, options) pairs, as ModelAdmin.fieldsets takes them
    for section, (title, description) in SECTIONS.items():
        names = [name for row in SETTINGS if row.section is section for name in fields_of(row)]
        if names:
            sets.append((title, {"fields": names, "description": description}))
    sets.append(
        ("Where the values come from", {"fields": ["value_sources", "updated_by", "last_changed"]})
    )
    return sets


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


# -- widgets --------------------------------------------------------------------------------


class AsTypedFloatField(forms.FloatField):
    """A float shown and read as typed: 60, not 60.0 (fractions stay: 0.5), so that an
    error quotes the value as the config file's would."""

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    def to_python(self, value: Any) -> Any:
        return self.prepare_value(super().to_python(value))


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
                raise ValidationError(f"{FIFO_KEY}: not a JSON object ({error})") from None
        result: dict[str, Any] = {}
        for model, priority in value:
            model, priority = model.strip(), priority.strip()
            if not model:
                continue  # a cleared model id removes its row, as the help text says
            if model in result:
                raise ValidationError(f"{FIFO_KEY}.{model}: given twice")
            if not priority:
                raise ValidationError(
                    f"{FIFO_KEY}.{model}: give an integer priority, "
                    "or clear the model id to remove the row"
                )
            try:
                result[model] = int(priority)
            except ValueError:
                result[model] = priority  # refused below, with the scheduler's own message
        return result

    def has_changed(self, initial: Any, data: Any) -> bool:
        try:
            return bool((initial or {}) != self.to_python(data))
        except ValidationError:
            return True


# -- the form, generated from the settings table -----------------------------------------------


def share_field(band_value: str) -> str:
    """bandShare is edited as one number per band: ``share_batch``."""
    return f"share_{band_value}"


def form_fields(row: Setting) -> dict[str, forms.Field]:
    """The form fields of one setting, by name (a setting's field name; a share per band)."""
    label = f"{capfirst(row.label)} ({row.name})"
    if row.kind is Kind.CHOICE:
        assert row.choices is not None
        # A select, checked by the table (not by Django's choices), so that a wrong value
        # gets the config file's message naming the key.
        choices = [(c.value, c.value) for c in row.choices]
        widget = forms.Select(choices=choices)
        return {row.field: forms.CharField(label=label, widget=widget, help_text=row.help)}
    if row.kind is Kind.NUMBER:
        field = AsTypedFloatField(label=label, help_text=row.help, required=not row.absent)
        return {row.field: field}
    if row.kind is Kind.INTEGER:
        return {row.field: forms.IntegerField(label=label, help_text=row.help)}
    if row.kind is Kind.MODEL_PRIORITIES:
        help_text = f"{row.help} Clear a model id to remove its row; save to get more empty rows."
        return {row.field: FifoPriorityField(label=label, required=False, help_text=help_text)}
    shares: dict[str, forms.Field] = {}
    for i, band in enumerate(BANDS):
        shares[share_field(band.value)] = AsTypedFloatField(
            label=f"{capfirst(band.value)} share ({row.name}.{band.value})",
            required=False,
            help_text=row.help if i == len(BANDS) - 1 else "",
        )
    return shares


def fields_of(row: Setting) -> list[str]:
    if row.kind is Kind.BAND_SHARES:
        return [share_field(band.value) for band in BANDS]
    return [row.field]


def field_for_key(key: str) -> str:
    """The form field an error's config key belongs to (``__all__``: the whole form)."""
    for row in SETTINGS:
        if key == row.key or key.startswith(row.key + "."):
            if row.kind is Kind.BAND_SHARES:
                band = key.removeprefix(row.key + ".")
                return share_field(band) if key != row.key else "__all__"
            return row.field
    return "__all__"


def _declared_fields() -> dict[str, forms.Field]:
    fields: dict[str, forms.Field] = {}
    for row in SETTINGS:
        fields.update(form_fields(row))
    return fields


class _SettingsForm(_RecordForm):
    """One field per setting of the table (declared by :data:`SchedulerSettingsForm`);
    saved into the record's ``values``."""

    class Meta:
        model = SchedulerSettingsRecord
        fields: list[str] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        values = settings_store.record_values(self.instance)
        for row in SETTINGS:
            value = values.get(row.name)
            if row.kind is Kind.BAND_SHARES:
                for band in BANDS:
                    self.fields[share_field(band.value)].initial = (value or {}).get(band.value)
            else:
                self.fields[row.field].initial = value

    def raw_values(self) -> dict[str, Any]:
        """The cleaned data by config key name, as :meth:`SchedulerSettings.from_names`
        takes them."""
        data = self.cleaned_data
        raw: dict[str, Any] = {}
        for row in SETTINGS:
            if row.kind is Kind.BAND_SHARES:
                raw[row.name] = {
                    band.value: data[share_field(band.value)]
                    for band in BANDS
                    if data.get(share_field(band.value)) not in (None, 0)
                }
            elif row.kind is Kind.MODEL_PRIORITIES:
                raw[row.name] = data.get(row.field) or {}
            else:
                raw[row.name] = data.get(row.field)
        return raw

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if self.errors:
            return data
        try:
            self.validated = settings_store.to_settings(self.raw_values())
        except SettingsError as error:
            self.add_error(field_for_key(error.key), str(error))
            return data
        self._check_fifo_models()
        return data

    def _check_fifo_models(self) -> None:
        """fifoPriority names models of the running config, by the rule `llamaswap check`
        applies to the file (scheduler.config.resolve_fifo_priority)."""
        from scheduler import runtime

        if not runtime.is_running():
            return  # no config here to check against: `serve` checks it at start
        config = runtime.current().config
        try:
            resolved = resolve_fifo_priority(
                self.validated.fifo_priority, config.models, config.aliases
            )
        except ConfigError as error:
            self.add_error(field_for_key(FIFO_KEY), f"{error.key}: {error.message}")
            return
        self.validated = self.validated.with_changes(fifo_priority=resolved)

    def save(self, commit: bool = True) -> SchedulerSettingsRecord:
        self.instance.values = self.validated.as_dict()
        record: SchedulerSettingsRecord = super().save(commit)
        return record


SchedulerSettingsForm = type(
    "SchedulerSettingsForm", (_SettingsForm,), {"__module__": __name__, **_declared_fields()}
)
"""The admin form: :class:`_SettingsForm` with the fields of every setting declared."""


# -- the admin pages -------------------------------------------------------------------------


def _stamp_tag(stamp: str) -> SafeString | str:
    """An override's time ("2026-12-01 04:10:17 UTC", settings_store's stamp) as a <time>."""
    try:
        when = datetime.strptime(stamp, settings_store.STAMP_FORMAT).replace(tzinfo=UTC)
    except (TypeError, ValueError):
        return stamp or "?"
    return timetag(when, "zoned")


@admin.register(SchedulerSettingsRecord)
class SchedulerSettingsAdmin(_RecordAdmin):
    form = SchedulerSettingsForm
    fieldsets = _fieldsets()
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
        fleet = SchedulerSettingsRecord.objects.filter(node="").first() if obj.node else None
        fleet_edits = (fleet.admin_overrides or {}) if fleet is not None else {}
        wins = obj.config_wins or {}
        rows = []
        for key in settings_store.FIELDS:
            info, fleet_info = overrides.get(key), fleet_edits.get(key)
            if info:
                source = format_html(
                    "admin edit{} by {} at {}",
                    " for this node" if obj.node else "",
                    info.get("by") or "?",
                    _stamp_tag(info.get("at", "")),
                )
            elif fleet_info and wins.get(key) != fleet_info.get("at"):
                source = format_html(
                    "fleet-wide admin edit by {} at {}",
                    fleet_info.get("by") or "?",
                    _stamp_tag(fleet_info.get("at", "")),
                )
            else:
                source = format_html("{}", SOURCE_CONFIG)
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

    list_display = ["applies_to", "updated_by", "last_changed"]

    @admin.display(description="applies to", ordering="node")
    def applies_to(self, obj: SchedulerSettingsRecord) -> str:
        return f"node {obj.node} (over the fleet-wide edits)" if obj.node else "every node"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # the fleet row: the list creates it; a node's row: its first start

    def has_delete_permission(
        self, request: HttpRequest, obj: SchedulerSettingsRecord | None = None
    ) -> bool:
        return False

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> Any:
        """One row (a single box): go straight to it (created from the running settings if
        the server has not stored any yet). A fleet: the fleet row and each node's row."""
        if SchedulerSettingsRecord.objects.exclude(node="").exists():
            return super().changelist_view(request, extra_context)
        record = SchedulerSettingsRecord.objects.filter(
            pk=SchedulerSettingsRecord.SINGLETON_PK
        ).first()
        if record is None:
            record = _initial_record()
        return HttpResponseRedirect(
            reverse("admin:control_schedulersettingsrecord_change", args=[record.pk])
        )

    def save_model(
        self, request: HttpRequest, obj: SchedulerSettingsRecord, form: Any, change: bool
    ) -> None:
        before = SchedulerSettingsRecord.objects.filter(pk=obj.pk).first()
        old = settings_store.record_values(before) if before is not None else {}
        super().save_model(request, obj, form, change)
        settings, source, changes = settings_store.save_admin_edit(
            obj, old, request.user.get_username()
        )
        if not changes:
            return
        # fleet mode: every other node reads it again, once it is committed
        transaction.on_commit(lambda: fleet_changes.changed("settings"), robust=True)
        here = this_node()
        if obj.node and obj.node != here:
            self.message_user(request, f"Saved: node {obj.node} applies it.")
            return
        if here:  # a named node: the fleet row's edits under its own, over its config file
            effective = settings_store.effective_on(here)
            if effective is not None:
                settings, source = effective.settings, effective.source
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
    record.values = settings_store.settings_values(settings)
    record.config_values = record.values
    record.save()
    return record


@admin.register(SettingsChange)
class SettingsChangeAdmin(_ChangeAdmin):
    list_display = ["when", "who", "field", "old_value", "new_value", "source", "node"]
    list_filter = ["source", "field", "node"]

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

    def has_change_permission(
        self, request: HttpRequest, obj: SettingsChange | None = None
    ) -> bool:
        return False

    def has_delete_permission(
        self, request: HttpRequest, obj: SettingsChange | None = None
    ) -> bool:
        return False
