"""Scheduler settings edited in the admin, and the audit trail of every change.

Precedence between the config file and admin edits (see dashboard/settings_store.py and
docs/dashboard.md): at each start the config file's values are stored in ``config_values``;
a value edited in the admin stays in effect until the config file's value *for that key*
differs from the one stored at the previous start, and then the config file wins.
"""

from __future__ import annotations

from django.db import models


class SchedulerSettingsRecord(models.Model):
    """The scheduler settings in effect: one row (pk 1)."""

    SINGLETON_PK = 1

    use = models.CharField(
        "scheduler (use)",
        max_length=10,
        choices=[("serial", "serial"), ("fifo", "fifo")],
        default="serial",
    )
    aging_divisor = models.FloatField(
        "aging divisor (agingDivisor)",
        default=60,
        help_text="Seconds of waiting per priority point; 0 disables aging.",
    )
    swap_affinity_bonus = models.IntegerField(
        "swap affinity bonus (swapAffinityBonus)",
        default=10,
        help_text="Bonus for a request that needs no model swap, 0..99; 0 disables it.",
    )
    fifo_priority = models.JSONField(
        "fifo priorities (fifo.priority)",
        default=dict,
        blank=True,
        help_text='fifo scheduler: model id -> integer priority, e.g. {"qwen3": 10}.',
    )
    config_values = models.JSONField(
        default=dict,
        blank=True,
        help_text="The config file's values at the last start (decides when the config wins).",
    )
    admin_overrides = models.JSONField(
        default=dict,
        blank=True,
        help_text="Keys whose value comes from an admin edit: key -> {by, at}.",
    )
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=150, blank=True, default="")

    class Meta:
        verbose_name = "scheduler settings"
        verbose_name_plural = "scheduler settings"

    def __str__(self) -> str:
        return (
            f"use={self.use} agingDivisor={self.aging_divisor:g} "
            f"swapAffinityBonus={self.swap_affinity_bonus}"
        )


class SettingsChange(models.Model):
    """One changed value: who (or the config file), when, old and new."""

    SOURCE_ADMIN = "admin"
    SOURCE_CONFIG = "config file"

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    who = models.CharField(max_length=150)
    field = models.CharField(max_length=100)
    """The config key name: use, agingDivisor, swapAffinityBonus, fifoPriority."""
    old = models.JSONField(null=True)
    new = models.JSONField(null=True)
    source = models.CharField(
        max_length=20, choices=[(SOURCE_ADMIN, "admin"), (SOURCE_CONFIG, "config file")]
    )

    class Meta:
        ordering = ["-at", "-id"]
        verbose_name = "settings change"

    def __str__(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r} ({self.source}, {self.who})"
