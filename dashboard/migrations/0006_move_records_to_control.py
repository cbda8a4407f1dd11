"""The settings records, the change log, the issued keys and access control now belong to
the ``control`` app (its 0001 takes them into its state). State only: the tables and
their rows stay as they are (``control.models`` names them with ``db_table``)."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("dashboard", "0005_settings_values"),
        ("control", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.DeleteModel(name="AccessControl"),
                migrations.DeleteModel(name="IssuedKey"),
                migrations.DeleteModel(name="SchedulerSettingsRecord"),
                migrations.DeleteModel(name="SettingsChange"),
            ]
        ),
    ]
