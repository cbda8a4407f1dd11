"""The settings records, the change log, the issued keys and access control move here
from ``dashboard`` (its 0006 takes them out of its state). Their tables keep their names
(``db_table``) and their rows: this migration changes Django's state only, and moves the
four content types to this app so that admin log entries and permissions stay attached.
"""

from django.db import migrations, models

MODELS = ("accesscontrol", "issuedkey", "schedulersettingsrecord", "settingschange")


def move_content_types(apps, schema_editor, source="dashboard", target="control"):
    ContentType = apps.get_model("contenttypes", "ContentType")
    db = schema_editor.connection.alias
    for model in MODELS:
        if ContentType.objects.using(db).filter(app_label=target, model=model).exists():
            continue  # already there (created by a post_migrate of the new state)
        ContentType.objects.using(db).filter(app_label=source, model=model).update(app_label=target)


def content_types_back(apps, schema_editor):
    move_content_types(apps, schema_editor, source="control", target="dashboard")


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("dashboard", "0005_settings_values"),
    ]

    state_operations = [
        migrations.CreateModel(
            name="AccessControl",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "keys_required",
                    models.BooleanField(
                        default=False,
                        help_text="On: every API path needs a key granted its scope, or a staff login, even when no key is in force. Off opens the API to everyone: possible only while no key is in force (no config apiKeys, every issued key revoked).",
                        verbose_name="API keys required",
                    ),
                ),
                ("changed_at", models.DateTimeField(auto_now=True)),
                ("changed_by", models.CharField(blank=True, default="", max_length=150)),
            ],
            options={
                "verbose_name": "access control",
                "verbose_name_plural": "access control",
                "db_table": "dashboard_accesscontrol",
            },
        ),
        migrations.CreateModel(
            name="IssuedKey",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "name",
                    models.CharField(
                        help_text="Who or what uses the key.", max_length=100, unique=True
                    ),
                ),
                ("digest", models.CharField(editable=False, max_length=64, unique=True)),
                ("prefix", models.CharField(editable=False, max_length=32)),
                (
                    "priority_default",
                    models.BigIntegerField(
                        blank=True,
                        help_text="When a request sends no X-LlamaSwap-Priority (else 0).",
                        null=True,
                        verbose_name="default priority",
                    ),
                ),
                (
                    "priority_ceiling",
                    models.BigIntegerField(
                        blank=True,
                        help_text="The most a request may claim; more runs at the ceiling. Empty: no ceiling.",
                        null=True,
                        verbose_name="priority ceiling",
                    ),
                ),
                (
                    "priority_offset",
                    models.BigIntegerField(
                        default=0,
                        help_text="Added after the ceiling.",
                        verbose_name="priority offset",
                    ),
                ),
                (
                    "scopes",
                    models.JSONField(
                        blank=True,
                        default=list,
                        help_text="What the key may reach (scheduler.keys.Scope names); empty: inference only.",
                    ),
                ),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("created_by", models.CharField(blank=True, default="", max_length=150)),
                ("revoked_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "verbose_name": "issued API key",
                "db_table": "dashboard_issuedkey",
                "ordering": ["name"],
            },
        ),
        migrations.CreateModel(
            name="SchedulerSettingsRecord",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "values",
                    models.JSONField(
                        blank=True,
                        default=dict,
                        help_text="The values in effect, by config key name (agingDivisor, ...): every setting of scheduler.core.settings.SETTINGS; a missing one takes its default.",
                    ),
                ),
                (
                    "config_values",
                    models.JSONField(
                        blank=True,
                        default=dict,
                        help_text="The config file's values at the last start (decides when the config wins).",
                    ),
                ),
                (
                    "admin_overrides",
                    models.JSONField(
                        blank=True,
                        default=dict,
                        help_text="Keys whose value comes from an admin edit: key -> {by, at}.",
                    ),
                ),
                ("updated_at", models.DateTimeField(auto_now=True)),
                ("updated_by", models.CharField(blank=True, default="", max_length=150)),
            ],
            options={
                "verbose_name": "scheduler settings",
                "verbose_name_plural": "scheduler settings",
                "db_table": "dashboard_schedulersettingsrecord",
            },
        ),
        migrations.CreateModel(
            name="SettingsChange",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("at", models.DateTimeField(auto_now_add=True, db_index=True)),
                ("who", models.CharField(max_length=150)),
                ("field", models.CharField(max_length=100)),
                ("old", models.JSONField(null=True)),
                ("new", models.JSONField(null=True)),
                (
                    "source",
                    models.CharField(
                        choices=[("admin", "admin"), ("config file", "config file")], max_length=20
                    ),
                ),
            ],
            options={
                "verbose_name": "settings change",
                "db_table": "dashboard_settingschange",
                "ordering": ["-at", "-id"],
            },
        ),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(state_operations=state_operations),
        migrations.RunPython(move_content_types, content_types_back),
    ]
