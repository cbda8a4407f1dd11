from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("activity", "0003_requestrecord_lane"),
    ]

    operations = [
        migrations.AddField(
            model_name="requestrecord",
            name="peer",
            field=models.CharField(blank=True, default="", max_length=255),
        ),
        migrations.AddField(
            model_name="requestrecord",
            name="requested_model",
            field=models.CharField(blank=True, default="", max_length=255),
        ),
    ]
