"""The activity log's JSON API: read-only views over ``activity.models.RequestRecord``.

* ``GET /api/metrics/activity`` (llama-swap's path): rows newest first, filtered and
  paged. Each row's ``metadata`` holds the spec's keys ("Observability") with their exact
  names and JSON types.
* ``GET /api/requests/{request_id}``: one request with its decision in full, and the
  requests dispatched while it waited, each with the score it won with.

Async views on Django's stock handler, reading with the async ORM. With API keys
configured the router lets only a valid key through (``llamaswap_site.asgi``); without
keys, ``DASHBOARD_REQUIRE_LOGIN`` puts them behind the Django login
(``dashboard.access.api_refusal``).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from activity.models import RequestRecord
from dashboard.access import api_refusal
from scheduler.core.priority import BANDS
from web.errors import echo, error_response

DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
MAX_AHEAD = 1000
"""Most requests listed as dispatched while one waited (the total is given beside)."""


class BadParameter(ValueError):
    """A query parameter that cannot be used: a JSON 400 naming it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat() if value is not None else None


def _when(name: str, value: str, end: bool = False) -> datetime | None:
    """A time filter: unix seconds, an ISO 8601 time (UTC unless it says), or a date."""
    value = value.strip()
    if not value:
        return None
    try:
        return datetime.fromtimestamp(float(value), tz=UTC)
    except (ValueError, OverflowError, OSError):
        pass
    try:
        when = parse_datetime(value)
        if when is None:
            day = parse_date(value)
            if day is not None:
                when = datetime.combine(day, datetime.max.time() if end else datetime.min.time())
    except ValueError:  # well-formed but no such day or time: 2026-02-30
        when = None
    if when is None:
        raise BadParameter(name, f"{name} must be unix seconds or an ISO 8601 time, got {echo(value)}")
    when = timezone.make_aware(when, UTC) if timezone.is_naive(when) else when
    try:
        when.astimezone(UTC)  # what the database adapter does: 0001-01-01T00:00+01:00 overflows
    except OverflowError:
        raise BadParameter(name, f"{name} is out of range, got {echo(value)}") from None
    return when


def _int_param(request: HttpRequest, name: str, default: int, low: int, high: int) -> int:
    raw = request.GET.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise BadParameter(name, f"{name} must be an integer {low}..{high}, got {echo(raw)}")
    return value


def activity_row(r: RequestRecord) -> dict[str, Any]:
    """One row of ``/api/metrics/activity``; token fields use llama-swap's names."""
    return {
        "id": r.id,
        "request_id": r.request_id,
        "timestamp": _iso(r.arrived_at),
        "model": r.model,
        "requested_model": r.requested_model,
        "peer": r.peer,
        "path": r.path,
        "priority": r.priority,
        "requested_priority": r.requested_priority,
        "api_key": r.api_key,
        "band": r.band,
        "policy": r.policy,
        "lane": r.lane,
        "outcome": r.outcome,
        "status": r.status,
        "arrived_at": _iso(r.arrived_at),
        "dispatched_at": _iso(r.dispatched_at),
        "finished_at": _iso(r.finished_at),
        "duration_ms": r.duration_ms,
        "queue_wait_ms": r.queue_wait_ms,
        "load_ms": r.load_ms,
        "swapped": bool(r.needs_swap),
        "cache_tokens": r.cached_tokens,
        "input_tokens": r.prompt_tokens,
        "output_tokens": r.completion_tokens,
        "prompt_per_second": r.prompt_per_second,
        "tokens_per_second": r.tokens_per_second,
        "metadata": r.metadata(),
    }


def decision(r: RequestRecord) -> dict[str, Any] | None:
    """Why it was picked when it was (None: never dispatched)."""
    if r.dispatched_at is None:
        return None
    return {
        "policy": r.policy,
        "priority": r.priority,
        "band": r.band,
        "score": r.score,
        "affinity": r.affinity,
        "aging": r.aging,
        "reordered_by": list(r.reordered_by or []),
        "runner_up": (
            {"request_id": r.runner_up_id, "score": r.runner_up_score} if r.runner_up_id else None
        ),
        "queue_wait_ms": r.queue_wait_ms,
        "needs_swap": r.needs_swap,
        "load_ms": r.load_ms,
        "fifo_priority": r.fifo_priority,
        "waiting_after": r.waiting_after,
        "settings": (
            {"agingDivisor": r.aging_divisor, "swapAffinityBonus": r.swap_affinity_bonus}
            if r.aging_divisor is not None
            else None
        ),
    }


def _competitor(r: RequestRecord) -> dict[str, Any]:
    """A request that went while another waited, with the score it won with."""
    return {
        "request_id": r.request_id,
        "model": r.model,
        "priority": r.priority,
        "band": r.band,
        "score": r.score,
        "affinity": r.affinity,
        "aging": r.aging,
        "reordered_by": list(r.reordered_by or []),
        "needs_swap": r.needs_swap,
        "fifo_priority": r.fifo_priority,
        "dispatched_at": _iso(r.dispatched_at),
        "finished_at": _iso(r.finished_at),
        "queue_wait_ms": r.queue_wait_ms,
        "load_ms": r.load_ms,
        "run_ms": r.run_ms,
        "outcome": r.outcome,
    }


def _text_params(request: HttpRequest, *names: str) -> None:
    """Text filters go to the database as they are: no NUL (PostgreSQL refuses it)."""
    for name in names:
        if "\x00" in request.GET.get(name, ""):
            raise BadParameter(name, f"{name} must not contain NUL characters")


async def activity(request: HttpRequest) -> HttpResponse:
    """GET /api/metrics/activity?model=&band=&start=&end=&request_id=&api_key=&limit=&page="""
    if (refusal := await api_refusal(request)) is not None:
        return refusal
    params = request.GET
    try:
        limit = _int_param(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        page = _int_param(request, "page", 1, 1, 10**9)
        start = _when("start", params.get("start", ""))
        end = _when("end", params.get("end", ""), end=True)
        band = params.get("band", "").strip()
        if band and band not in {b.value for b in BANDS}:
            raise BadParameter("band", f"band must be interactive, normal or batch, got {echo(band)}")
        _text_params(request, "model", "request_id", "api_key")
    except BadParameter as exc:
        return error_response(400, str(exc), code="invalid_parameter", param=exc.param)
    rows = RequestRecord.objects.all()
    if model := params.get("model", "").strip():
        rows = rows.filter(model=model)
    if band:
        rows = rows.filter(band=band)
    if request_id := params.get("request_id", "").strip():
        rows = rows.filter(request_id=request_id)
    if api_key := params.get("api_key", "").strip():
        rows = rows.filter(api_key=api_key)
    if start is not None:
        rows = rows.filter(arrived_at__gte=start)
    if end is not None:
        rows = rows.filter(arrived_at__lte=end)
    total = await rows.acount()
    offset = (page - 1) * limit
    data = [
        activity_row(r) async for r in rows.order_by("-arrived_at", "-id")[offset : offset + limit]
    ]
    return JsonResponse(
        {
            "data": data,
            "page": page,
            "limit": limit,
            "total": total,
            "pages": math.ceil(total / limit),
            "has_more": offset + len(data) < total,
        }
    )


async def request_detail(request: HttpRequest, request_id: str) -> HttpResponse:
    """GET /api/requests/{request_id}: the request, its decision, and why it waited."""
    if (refusal := await api_refusal(request)) is not None:
        return refusal
    if "\x00" in request_id:
        mine = None  # no id has one (and PostgreSQL refuses to compare with it)
    else:
        mine = await RequestRecord.objects.filter(request_id=request_id).afirst()
    if mine is None:
        return error_response(
            404, f"no request {echo(request_id)} in the activity log", code="request_not_found"
        )
    # It waited from arrival until its pick (or until its client gave up).
    until = mine.dispatched_at or mine.finished_at
    others = RequestRecord.objects.exclude(pk=mine.pk).filter(dispatched_at__isnull=False)
    went = others.filter(dispatched_at__gte=mine.arrived_at, dispatched_at__lt=until)
    running = others.filter(dispatched_at__lt=mine.arrived_at, finished_at__gt=mine.arrived_at)
    went_total = await went.acount()
    body = {
        **activity_row(mine),
        "ready_at": _iso(mine.ready_at),
        "run_ms": mine.run_ms,
        "error": mine.error,
        "decision": decision(mine),
        "usage": mine.usage,
        "timings": mine.timings,
        "running_at_arrival": [
            _competitor(r) async for r in running.order_by("dispatched_at", "id")[:MAX_AHEAD]
        ],
        "dispatched_while_waiting": [
            _competitor(r) async for r in went.order_by("dispatched_at", "id")[:MAX_AHEAD]
        ],
        "dispatched_while_waiting_total": went_total,
    }
    return JsonResponse(body)
