"""Per-node overrides in a fleet (docs/fleet.md): the settings row gets its node ("" is
the fleet row: the existing row, pk 1, keeps its values and its admin edits, which become
the fleet-wide ones), the change log names the node, an issued key may be limited to some
nodes (empty: every node, as every existing key)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("control", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="issuedkey",
            name="nodes",
            field=models.JSONField(
                blank=True,
                default=list,
                help_text="The node names the key works on; empty: every node (and a single box).",
            ),
        ),
        migrations.AddField(
            model_name="schedulersettingsrecord",
            name="config_wins",
            field=models.JSONField(
                blank=True,
                default=dict,
                help_text="A node's row: keys whose config file changed after a fleet edit of them: key -> that edit's at (a newer fleet edit applies again).",
            ),
        ),
        migrations.AddField(
            model_name="schedulersettingsrecord",
            name="node",
            field=models.CharField(
                blank=True,
                default="",
                editable=False,
                help_text="Empty: the fleet row (every node); else the node these values apply to.",
                max_length=64,
                unique=True,
            ),
        ),
        migrations.AddField(
            model_name="settingschange",
            name="node",
            field=models.CharField(
                blank=True,
                default="",
                help_text="The node whose values changed; empty: fleet-wide (or a single box).",
                max_length=64,
            ),
        ),
    ]
