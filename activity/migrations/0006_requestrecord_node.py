# The fleet node that recorded a request (fleet/, docs/fleet.md).

from django.db import migrations, models

import activity.models


class Migration(migrations.Migration):
    dependencies = [
        ("activity", "0005_history_filter_indexes"),
    ]

    operations = [
        migrations.AddField(
            model_name="requestrecord",
            name="node",
            field=models.CharField(blank=True, default=activity.models.this_node, max_length=64),
        ),
        migrations.AddIndex(
            model_name="requestrecord",
            index=models.Index(fields=["node", "arrived_at"], name="record_node_arrived"),
        ),
    ]
