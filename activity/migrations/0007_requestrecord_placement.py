# The fleet's placement decision and its reason, for the why-page (docs/fleet.md).

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("activity", "0006_requestrecord_node"),
    ]

    operations = [
        migrations.AddField(
            model_name="requestrecord",
            name="placement",
            field=models.CharField(blank=True, default="", max_length=500),
        ),
    ]
