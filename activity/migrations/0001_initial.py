"""RequestRecord, moved here from the ``scheduler`` app with its table (see
``scheduler/migrations/0003_requestrecord_moves_to_activity.py``): state only."""

from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [("scheduler", "0003_requestrecord_moves_to_activity")]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[],
            state_operations=[
                migrations.CreateModel(
                    name="RequestRecord",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("request_id", models.CharField(max_length=64, unique=True)),
                        ("model", models.CharField(max_length=255)),
                        ("path", models.CharField(max_length=255)),
                        ("priority", models.BigIntegerField()),
                        ("band", models.CharField(max_length=16)),
                        ("policy", models.CharField(max_length=8)),
                        ("arrived_at", models.DateTimeField()),
                        ("dispatched_at", models.DateTimeField(blank=True, null=True)),
                        ("ready_at", models.DateTimeField(blank=True, null=True)),
                        ("finished_at", models.DateTimeField()),
                        (
                            "outcome",
                            models.CharField(
                                choices=[
                                    ("completed", "Completed"),
                                    ("failed", "Failed"),
                                    ("cancelled_waiting", "Cancelled Waiting"),
                                    ("cancelled_running", "Cancelled Running"),
                                    ("rejected", "Rejected"),
                                    ("queue_full", "Queue Full"),
                                    ("expired", "Expired"),
                                ],
                                max_length=24,
                            ),
                        ),
                        ("status", models.IntegerField(blank=True, null=True)),
                        ("error", models.TextField(blank=True, default="")),
                        ("duration_ms", models.FloatField()),
                        ("queue_wait_ms", models.FloatField(blank=True, null=True)),
                        ("load_ms", models.FloatField(blank=True, null=True)),
                        ("run_ms", models.FloatField(blank=True, null=True)),
                        ("score", models.FloatField(blank=True, null=True)),
                        ("affinity", models.FloatField(blank=True, null=True)),
                        ("aging", models.FloatField(blank=True, null=True)),
                        ("reordered_by", models.JSONField(blank=True, default=list)),
                        ("runner_up_id", models.CharField(blank=True, default="", max_length=64)),
                        ("runner_up_score", models.FloatField(blank=True, null=True)),
                        ("needs_swap", models.BooleanField(blank=True, null=True)),
                        ("fifo_priority", models.BigIntegerField(blank=True, null=True)),
                        ("waiting_after", models.IntegerField(blank=True, null=True)),
                        ("aging_divisor", models.FloatField(blank=True, null=True)),
                        ("swap_affinity_bonus", models.IntegerField(blank=True, null=True)),
                        ("prompt_tokens", models.IntegerField(blank=True, null=True)),
                        ("completion_tokens", models.IntegerField(blank=True, null=True)),
                        ("cached_tokens", models.IntegerField(blank=True, null=True)),
                        ("prompt_per_second", models.FloatField(blank=True, null=True)),
                        ("tokens_per_second", models.FloatField(blank=True, null=True)),
                        ("usage", models.JSONField(blank=True, null=True)),
                        ("timings", models.JSONField(blank=True, null=True)),
                    ],
                    options={
                        "db_table": "scheduler_requestrecord",
                        "ordering": ("-arrived_at", "-id"),
                        "indexes": [
                            models.Index(fields=["arrived_at"], name="record_arrived"),
                            models.Index(fields=["dispatched_at"], name="record_dispatched"),
                            models.Index(
                                fields=["model", "arrived_at"], name="record_model_arrived"
                            ),
                            models.Index(fields=["band", "arrived_at"], name="record_band_arrived"),
                        ],
                    },
                ),
            ],
        )
    ]
