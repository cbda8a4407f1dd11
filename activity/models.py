"""The activity log: one row per inference request that reached the queue.

Written by :mod:`activity.recorder` when the request's turn ends (completed, failed,
cancelled while waiting or while running), read by ``dashboard.api``. A row carries the
whole story: when it arrived, was picked and finished, and why it was picked (the
:class:`~scheduler.core.policy.Decision`), so "why did my request take 20 minutes" has an
answer after the fact, and the reorder columns make ``agingDivisor`` and
``swapAffinityBonus`` tunable from data.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from scheduler.dispatcher import Outcome


class RecordOutcome(models.TextChoices):
    """How the request's turn ended: the dispatcher's Outcome, as database choices. Spelled
    out (the class form types under django-stubs, the functional one does not) and held to
    ``Outcome`` member for member just below, so the two cannot drift apart."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED_WAITING = "cancelled_waiting"
    CANCELLED_RUNNING = "cancelled_running"
    REJECTED = "rejected"
    QUEUE_FULL = "queue_full"
    EXPIRED = "expired"


if [(c.name, c.value) for c in RecordOutcome] != [(o.name, o.value) for o in Outcome]:
    raise ImportError("activity.models.RecordOutcome must list scheduler's Outcome exactly")

_WORDS = {
    "cancelled_waiting": "cancelled while waiting",
    "cancelled_running": "cancelled while running",
    "queue_full": "refused: queue full",
    "expired": "expired while waiting",
}
OUTCOME_WORDS: dict[str, str] = {
    o.value: _WORDS.get(o.value, o.value.replace("_", " ")) for o in Outcome
}
"""Each outcome in words, for people (the history page, its filter, the API's
``outcome_text``); the code stays the stored and filtered value."""


def this_node() -> str:
    """The name of the node that writes a record: ``--node`` / ``LLAMASWAP_NODE`` (fleet
    mode, fleet/), "" on a single box. One value per server, so it needs no place in the
    journal's snapshot: the row takes it when it is written."""
    return str(getattr(settings, "LLAMASWAP_NODE", "") or "")[:64]


def outcome_words(code: str) -> str:
    """``cancelled_waiting`` -> "cancelled while waiting"; an unknown code as it is."""
    return OUTCOME_WORDS.get(code, code)


class RequestRecord(models.Model):
    """One inference request, its scheduling decision and what the upstream reported."""

    request_id = models.CharField(max_length=64, unique=True)
    """The ``X-LlamaSwap-Request-Id`` value."""
    model = models.CharField(max_length=255)
    """The model that ran it: a local model id, or ``peer/model`` for a peer's."""
    requested_model = models.CharField(max_length=255, blank=True, default="")
    """The name the client asked for, when a profile pin, a selector or a
    ``setParamsByID`` alias resolved it to ``model``; empty when it asked for ``model``."""
    peer = models.CharField(max_length=255, blank=True, default="")
    """The peer (``peers.<id>``) it was forwarded to; empty for a local model. A peer
    request takes no local turn: it is never queued or dispatched here."""
    node = models.CharField(max_length=64, blank=True, default=this_node)
    """The fleet node the client sent it to (it ran there, or on ``peer`` when placed on
    another node); empty on a single box."""
    placement = models.CharField(max_length=500, blank=True, default="")
    """Fleet mode: where it was placed and why ("sent to box-b: model loaded there, ...";
    a node that went away before answering is named), as ``fleet.placing`` decided it;
    empty when it was not placed (a single box, or a request another node placed here)."""
    path = models.CharField(max_length=255)
    priority = models.BigIntegerField()
    """The caller's priority (header value; signed 64-bit)."""
    band = models.CharField(max_length=16)
    api_key = models.CharField(max_length=64, blank=True, default="")
    """The name of the API key the request came with (never the key); empty without keys."""
    requested_priority = models.BigIntegerField(null=True, blank=True)
    """What the caller asked for, when its key's ceiling cut it to ``priority``."""
    policy = models.CharField(max_length=8)
    """``serial`` or ``fifo``: the scheduler that ordered it; ``peer`` for a request
    forwarded to a peer (no scheduler here)."""
    lane = models.CharField(max_length=64, blank=True, default="default")
    """The lane (GPU) whose queue it waited in; ``default`` on a one-lane box."""

    arrived_at = models.DateTimeField()
    dispatched_at = models.DateTimeField(null=True, blank=True)
    """When it was picked (null: never dispatched)."""
    ready_at = models.DateTimeField(null=True, blank=True)
    """When its model was ready and the request was sent upstream."""
    finished_at = models.DateTimeField()

    outcome = models.CharField(max_length=24, choices=RecordOutcome.choices)
    status = models.IntegerField(null=True, blank=True)
    """The HTTP status relayed (or the error status llamaswap answered with)."""
    error = models.TextField(blank=True, default="")
    duration_ms = models.FloatField()
    """Arrival to finish: the whole time the caller waited, streams included."""
    queue_wait_ms = models.FloatField(null=True, blank=True)
    """Arrival to the pick, not counting a model load (that is ``load_ms``)."""
    load_ms = models.FloatField(null=True, blank=True)
    """How long the model load this request waited for took (null: no swap)."""
    run_ms = models.FloatField(null=True, blank=True)
    """Ready to finish: the upstream's time."""

    # The decision (null when never dispatched).
    score = models.FloatField(null=True, blank=True)
    affinity = models.FloatField(null=True, blank=True)
    aging = models.FloatField(null=True, blank=True)
    reordered_by = models.JSONField(default=list, blank=True)
    """Terms that changed the pick: ``["aging"]``, ``["swap_affinity"]``, both or none."""
    runner_up_id = models.CharField(max_length=64, blank=True, default="")
    runner_up_score = models.FloatField(null=True, blank=True)
    needs_swap = models.BooleanField(null=True, blank=True)
    fifo_priority = models.BigIntegerField(null=True, blank=True)
    """Under fifo: model priority + header priority, the value it queued at."""
    waiting_after = models.IntegerField(null=True, blank=True)
    """Requests still waiting right after this pick."""
    aging_divisor = models.FloatField(null=True, blank=True)
    swap_affinity_bonus = models.IntegerField(null=True, blank=True)

    # What the upstream reported (usage / llama.cpp timings), streaming included.
    prompt_tokens = models.IntegerField(null=True, blank=True)
    completion_tokens = models.IntegerField(null=True, blank=True)
    cached_tokens = models.IntegerField(null=True, blank=True)
    prompt_per_second = models.FloatField(null=True, blank=True)
    tokens_per_second = models.FloatField(null=True, blank=True)
    usage = models.JSONField(null=True, blank=True)
    timings = models.JSONField(null=True, blank=True)

    class Meta:
        db_table = "scheduler_requestrecord"  # its table from before the activity app
        ordering = ("-arrived_at", "-id")
        indexes = (
            models.Index(fields=("arrived_at",), name="record_arrived"),
            models.Index(fields=("dispatched_at",), name="record_dispatched"),
            models.Index(fields=("model", "arrived_at"), name="record_model_arrived"),
            models.Index(fields=("band", "arrived_at"), name="record_band_arrived"),
            models.Index(fields=("outcome", "arrived_at"), name="record_outcome_arrived"),
            models.Index(fields=("lane", "arrived_at"), name="record_lane_arrived"),
            models.Index(fields=("node", "arrived_at"), name="record_node_arrived"),
        )

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.outcome}"

    @property
    def dispatched(self) -> bool:
        return self.dispatched_at is not None

    def metadata(self) -> dict[str, object]:
        """The spec's activity-log keys ("Observability"), with their exact names and types.

        Serial: ``serial_priority`` (int), ``serial_band`` (str), and once dispatched
        ``serial_score`` (number) and ``serial_queue_wait_ms`` (number). Fifo:
        ``fifo_priority`` (int) on every dispatched row.
        """
        if self.peer:
            return {"peer": str(self.peer)}
        if self.policy == "fifo":
            if self.fifo_priority is None:
                return {}
            return {"fifo_priority": int(self.fifo_priority)}
        meta: dict[str, object] = {
            "serial_priority": int(self.priority),
            "serial_band": str(self.band),
        }
        if self.score is not None:
            meta["serial_score"] = float(self.score)
            meta["serial_queue_wait_ms"] = float(self.queue_wait_ms or 0.0)
        return meta
