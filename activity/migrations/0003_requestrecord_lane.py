from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("activity", "0002_api_key_and_requested_priority"),
    ]

    operations = [
        migrations.AddField(
            model_name="requestrecord",
            name="lane",
            field=models.CharField(blank=True, default="default", max_length=64),
        ),
    ]
