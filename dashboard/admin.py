"""Admin for the scheduler settings: validated like the config file, applied at once."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest, HttpResponseRedirect
from django.urls import reverse

from dashboard import settings_store
from dashboard.models import SchedulerSettingsRecord, SettingsChange
from scheduler.core.policy import (
    KEY_AGING,
    KEY_BONUS,
    KEY_FIFO,
    KEY_USE,
    SchedulerSettings,
    SettingsError,
)

# SettingsError.key -> form field
_FIELD_OF_KEY = {
    KEY_USE: "use",
    KEY_AGING: "aging_divisor",
    KEY_BONUS: "swap_affinity_bonus",
    KEY_FIFO: "fifo_priority",
}

PRECEDENCE = (
    "A saved value reaches the running scheduler for its next pick, and stays in effect "
    "after a restart, until the config file's value for the same key changes: then the "
    "config file wins. Keys never edited here follow the config file."
)


def _field_for(key: str) -> str:
    if key.startswith(KEY_FIFO):
        return "fifo_priority"
    return _FIELD_OF_KEY.get(key, "__all__")


class SchedulerSettingsForm(forms.ModelForm):
    class Meta:
        model = SchedulerSettingsRecord
        fields = ["use", "aging_divisor", "swap_affinity_bonus", "fifo_priority"]

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
                }
            )
        except SettingsError as error:
            self.add_error(
                _field_for(error.key), f"{error.key}: {error.reason} (got {error.value!r})"
            )
        return data


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
            "Where the values come from",
            {"fields": ["admin_overrides", "config_values", "updated_by", "updated_at"]},
        ),
    ]
    readonly_fields = ["admin_overrides", "config_values", "updated_by", "updated_at"]

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
    list_display = ["at", "who", "field", "old", "new", "source"]
    list_filter = ["source", "field"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return False
