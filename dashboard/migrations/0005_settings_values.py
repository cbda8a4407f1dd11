"""The scheduler settings record keeps its values in one JSON column keyed by config key
name (agingDivisor, ...), as ``config_values`` already did: adding a setting to
scheduler.core.settings.SETTINGS then needs no migration. The old columns are copied in
(and back out on reverse)."""

from django.db import migrations, models

# The columns this migration retires: column -> config key name. Frozen here on purpose
# (a migration describes the schema as it was, not the settings table as it is).
COLUMNS = {
    "use": "use",
    "aging_divisor": "agingDivisor",
    "swap_affinity_bonus": "swapAffinityBonus",
    "aging_cap": "agingCap",
    "band_share": "bandShare",
    "fifo_priority": "fifoPriority",
}


def columns_to_values(apps, schema_editor):
    Record = apps.get_model("dashboard", "SchedulerSettingsRecord")
    for record in Record.objects.all():
        record.values = {name: getattr(record, column) for column, name in COLUMNS.items()}
        record.save(update_fields=["values"])


def values_to_columns(apps, schema_editor):
    Record = apps.get_model("dashboard", "SchedulerSettingsRecord")
    for record in Record.objects.all():
        values = record.values or {}
        for column, name in COLUMNS.items():
            if values.get(name) is not None or column == "aging_cap":
                setattr(record, column, values.get(name))
        record.save()


class Migration(migrations.Migration):
    dependencies = [
        ("dashboard", "0004_key_scopes_access_control"),
    ]

    operations = [
        migrations.AddField(
            model_name="schedulersettingsrecord",
            name="values",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text=(
                    "The values in effect, by config key name (agingDivisor, ...): every "
                    "setting of scheduler.core.settings.SETTINGS; a missing one takes its "
                    "default."
                ),
            ),
        ),
        migrations.RunPython(columns_to_values, values_to_columns),
        migrations.RemoveField(model_name="schedulersettingsrecord", name="use"),
        migrations.RemoveField(model_name="schedulersettingsrecord", name="aging_divisor"),
        migrations.RemoveField(model_name="schedulersettingsrecord", name="swap_affinity_bonus"),
        migrations.RemoveField(model_name="schedulersettingsrecord", name="aging_cap"),
        migrations.RemoveField(model_name="schedulersettingsrecord", name="band_share"),
        migrations.RemoveField(model_name="schedulersettingsrecord", name="fifo_priority"),
    ]
