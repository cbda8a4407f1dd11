"""Scheduler settings edited in the admin, the audit trail of every change, the
admin-issued API keys and whether keys stay required.

The tables keep the names they had when these models lived in ``dashboard`` (``db_table``;
moved in ``dashboard`` 0006 / ``control`` 0001 without touching the data).

Precedence between the config file and admin edits (the rule is
``scheduler.core.settings.merge_at_start``; see docs/dashboard.md): at each start the
config file's values are stored in ``config_values``; a value edited in the admin stays in
effect until the config file's value *for that key* differs from the one stored at the
previous start, and then the config file wins.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from scheduler.core import settings as table
from scheduler.keys import DEFAULT_SCOPES, KeyPolicy, Scope

SCOPE_CHOICES = [
    (Scope.INFERENCE.value, "inference: the OpenAI endpoints, /v1/models, /running, /upstream"),
    (Scope.MODELS.value, "models: unload models (/unload, /api/models/unload)"),
    (Scope.PROFILES.value, "profiles: switch the active profile for everyone"),
    (Scope.OPERATOR.value, "operator: /api/queue, /logs, the activity log API"),
    (Scope.METRICS.value, "metrics: /metrics (a Prometheus scraper)"),
]


def this_node() -> str:
    """This server's node name (``--node`` / ``LLAMASWAP_NODE``, set by ``serve`` before
    the control rows are read); "" on a single box."""
    return str(getattr(settings, "LLAMASWAP_NODE", "") or "")[: SchedulerSettingsRecord.MAX_NODE]


class SchedulerSettingsRecord(models.Model):
    """The scheduler settings: the fleet row (pk 1, ``node`` ""), and in a fleet one row
    per named node (docs/fleet.md). A server without a node name is a fleet of one: the
    fleet row is its row, its config file merged into it as before. A named node never
    writes its config file into the fleet row: it takes the fleet row's admin edits
    (``admin_overrides`` and their ``values``) and keeps its config file, its own edits
    and the values in effect on it in its own row."""

    SINGLETON_PK = 1
    """The fleet row's."""
    MAX_NODE = 64

    node = models.CharField(
        max_length=MAX_NODE,
        unique=True,
        default="",
        blank=True,
        editable=False,
        help_text="Empty: the fleet row (every node); else the node these values apply to.",
    )

    values = models.JSONField(
        default=dict,
        blank=True,
        help_text=(
            "The values in effect, by config key name (agingDivisor, ...): every setting of "
            "scheduler.core.settings.SETTINGS; a missing one takes its default."
        ),
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
    config_wins = models.JSONField(
        default=dict,
        blank=True,
        help_text=(
            "A node's row: keys whose config file changed after a fleet edit of them: "
            "key -> that edit's at (a newer fleet edit applies again)."
        ),
    )
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=150, blank=True, default="")

    class Meta:
        db_table = "dashboard_schedulersettingsrecord"
        verbose_name = "scheduler settings"
        verbose_name_plural = "scheduler settings"

    def __str__(self) -> str:
        return f"node {self.node}" if self.node else "fleet-wide"


class SettingsChange(models.Model):
    """One changed value: who (or the config file), when, old and new."""

    SOURCE_ADMIN = "admin"
    SOURCE_CONFIG = table.SOURCE_CONFIG  # "config file"

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    who = models.CharField(max_length=150)
    field = models.CharField(max_length=100)
    """The config key name: a setting's (scheduler.core.settings.SETTINGS); also profile
    (dashboard/profiles.py) and accessControl (AccessControl)."""
    old = models.JSONField(null=True)
    new = models.JSONField(null=True)
    source = models.CharField(
        max_length=20, choices=[(SOURCE_ADMIN, "admin"), (SOURCE_CONFIG, "config file")]
    )
    node = models.CharField(
        max_length=SchedulerSettingsRecord.MAX_NODE,
        blank=True,
        default="",
        help_text="The node whose values changed; empty: fleet-wide (or a single box).",
    )

    class Meta:
        db_table = "dashboard_settingschange"
        ordering = ["-at", "-id"]
        verbose_name = "settings change"

    def __str__(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r} ({self.source}, {self.who})"


class IssuedKey(models.Model):
    """An API key issued in the admin. Only its SHA-256 digest and a display prefix are
    stored: the key itself is shown once, when it is created (control/keys.py loads the
    ones not revoked into the running server's key ring)."""

    name = models.CharField(max_length=100, unique=True, help_text="Who or what uses the key.")
    digest = models.CharField(max_length=64, unique=True, editable=False)
    """SHA-256 hex of the key (scheduler.keys.digest); never the key."""
    prefix = models.CharField(max_length=32, editable=False)
    """The key's start, to recognise it: ``sk-llamaswap-`` and 8 of its random characters."""
    priority_default = models.BigIntegerField(
        "default priority",
        null=True,
        blank=True,
        help_text="When a request sends no X-LlamaSwap-Priority (else 0).",
    )
    priority_ceiling = models.BigIntegerField(
        "priority ceiling",
        null=True,
        blank=True,
        help_text="The most a request may claim; more runs at the ceiling. Empty: no ceiling.",
    )
    priority_offset = models.BigIntegerField(
        "priority offset", default=0, help_text="Added after the ceiling."
    )
    scopes = models.JSONField(
        default=list,
        blank=True,
        help_text="What the key may reach (scheduler.keys.Scope names); empty: inference only.",
    )
    nodes = models.JSONField(
        default=list,
        blank=True,
        help_text="The node names the key works on; empty: every node (and a single box).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.CharField(max_length=150, blank=True, default="")
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "dashboard_issuedkey"
        ordering = ["name"]
        verbose_name = "issued API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    @property
    def policy(self) -> KeyPolicy:
        return KeyPolicy(
            default=self.priority_default,
            ceiling=self.priority_ceiling,
            offset=self.priority_offset or 0,
        )

    def valid_on(self, node: str) -> bool:
        """Whether the key works on ``node`` (its ring holds it): no restriction, or named."""
        return not self.nodes or node in self.nodes

    @property
    def scope_set(self) -> frozenset[Scope]:
        """The stored scopes; none (or only names this version does not know): inference."""
        known = {s.value for s in Scope}
        granted = frozenset(Scope(name) for name in self.scopes or () if name in known)
        return granted or DEFAULT_SCOPES


class AccessControl(models.Model):
    """Whether API keys are required: one row (pk 1), so a restart keeps it.

    Turned on by the first key in force (one issued here, or the config's ``apiKeys`` at a
    start or reload: control/keys.py) and kept on when the last key is revoked, deleted
    or removed from the config: then every key-needing path refuses everyone but staff
    sessions. Only a staff member turns it off, in the admin; each change is a
    :class:`SettingsChange` row (field ``accessControl``) and a log line."""

    SINGLETON_PK = 1
    FIELD = "accessControl"
    """The ``SettingsChange.field`` of a change."""

    keys_required = models.BooleanField(
        "API keys required",
        default=False,
        help_text=(
            "On: every API path needs a key granted its scope, or a staff login, even "
            "when no key is in force. Off opens the API to everyone: possible only while "
            "no key is in force (no config apiKeys, every issued key revoked)."
        ),
    )
    changed_at = models.DateTimeField(auto_now=True)
    changed_by = models.CharField(max_length=150, blank=True, default="")

    class Meta:
        db_table = "dashboard_accesscontrol"
        verbose_name = "access control"
        verbose_name_plural = "access control"

    def __str__(self) -> str:
        return "API keys required" if self.keys_required else "API keys not required"
