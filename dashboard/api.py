"""The activity log's JSON API: read-only views over ``activity.models.RequestRecord``.

* ``GET /api/metrics/activity`` (llama-swap's path): rows newest first, filtered and
  paged. Each row's ``metadata`` holds the spec's keys ("Observability") with their exact
  names and JSON types.
* ``GET /api/requests/{request_id}``: one request with its decision in full, and the
  requests dispatched while it waited, each with the score it won with.

Async views on Django's stock handler, reading with the async ORM. With API keys
configured the router lets only a valid key through (``web.access``); without
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

from activity.models import RequestRecord, outcome_words
from dashboard.access import api_refusal
from scheduler.core.priority import BANDS
from web import captures
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


def _tokens(r: RequestRecord) -> dict[str, Any]:
    """llama-swap's nested ``tokens`` of an activity row: -1 where the model said nothing."""
    timings = r.timings if isinstance(r.timings, dict) else {}

    def known(value: Any) -> Any:
        return -1 if value is None else value

    draft = timings.get("draft_n")
    accepted = timings.get("draft_n_accepted")
    has_draft = isinstance(draft, int) and isinstance(accepted, int)
    return {
        "cache_tokens": known(r.cached_tokens),
        "draft_tokens": draft if has_draft else -1,
        "draft_acc_tokens": accepted if has_draft else -1,
        "input_tokens": r.prompt_tokens or 0,
        "output_tokens": r.completion_tokens or 0,
        "prompt_per_second": known(r.prompt_per_second),
        "tokens_per_second": known(r.tokens_per_second),
    }


def activity_row(r: RequestRecord) -> dict[str, Any]:
    """One row of ``/api/metrics/activity``: llama-swap's keys (``req_path``,
    ``resp_status_code``, ``resp_content_type``, nested ``tokens``, ``has_capture``,
    ``error_msg``), then ours (docs/llama-swap-compat.md: the flat token fields, ``path``,
    ``status`` and the scheduler's facts)."""
    row: dict[str, Any] = {
        "id": r.id,
        "timestamp": _iso(r.arrived_at),
        "model": r.model,
        "req_path": r.path,
        "resp_content_type": "",
        "resp_status_code": r.status or 0,
        "tokens": _tokens(r),
        "duration_ms": r.duration_ms,
        "has_capture": captures.has(r.request_id),
    }
    if r.error:
        row["error_msg"] = r.error
    return row | {
        "request_id": r.request_id,
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
        "outcome_text": outcome_words(r.outcome),
        "status": r.status,
        "arrived_at": _iso(r.arrived_at),
        "dispatched_at": _iso(r.dispatched_at),
        "finished_at": _iso(r.finished_at),
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


SORT_COLUMNS = {
    "id": "id",
    "time": "arrived_at",
    "model": "model",
    "req_path": "path",
    "resp_status_code": "status",
    "cached": "cached_tokens",
    "prompt": "prompt_tokens",
    "generated": "completion_tokens",
    "prompt_speed": "prompt_per_second",
    "gen_speed": "tokens_per_second",
    "duration": "duration_ms",
}
"""llama-swap's ``sort`` keys (its UI's column ids) -> our columns. Its
``resp_content_type`` and ``drafted`` are not stored here: 400, as an unknown key."""
MAX_MODELS = 100
"""Most ``model`` parameters one query may repeat."""


async def activity(request: HttpRequest) -> HttpResponse:
    """GET /api/metrics/activity: llama-swap's parameters (``model`` repeatable,
    ``start``/``end``, ``min_id``/``max_id``, ``limit``, ``page``, ``sort``, ``order``)
    and ours (``band``, ``request_id``, ``api_key``). Without ``sort``: newest first."""
    if (refusal := await api_refusal(request)) is not None:
        return refusal
    params = request.GET
    try:
        limit = _int_param(request, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)
        page = _int_param(request, "page", 1, 1, 10**9)
        start = _when("start", params.get("start", ""))
        end = _when("end", params.get("end", ""), end=True)
        if start is not None and end is not None and start > end:
            raise BadParameter("start", "start must be before end")
        min_id = _int_param(request, "min_id", 0, 1, 2**63 - 1)
        max_id = _int_param(request, "max_id", 0, 1, 2**63 - 1)
        if min_id and max_id and min_id > max_id:
            raise BadParameter("min_id", "min_id must be <= max_id")
        sort = params.get("sort", "").strip()
        if sort and sort not in SORT_COLUMNS:
            raise BadParameter("sort", f"sort must be one of {', '.join(SORT_COLUMNS)}, got {echo(sort)}")
        order = params.get("order", "").strip().lower()
        if order not in ("", "asc", "desc"):
            raise BadParameter("order", f"order must be asc or desc, got {echo(order)}")
        band = params.get("band", "").strip()
        if band and band not in {b.value for b in BANDS}:
            raise BadParameter("band", f"band must be interactive, normal or batch, got {echo(band)}")
        _text_params(request, "request_id", "api_key")
        models = [m.strip() for m in params.getlist("model") if m.strip()]
        if any("\x00" in m for m in models):
            raise BadParameter("model", "model must not contain NUL characters")
        if len(models) > MAX_MODELS:
            raise BadParameter("model", f"at most {MAX_MODELS} model parameters")
    except BadParameter as exc:
        return error_response(400, str(exc), code="invalid_parameter", param=exc.param)
    rows = RequestRecord.objects.all()
    if models:
        rows = rows.filter(model__in=models)
    if min_id:
        rows = rows.filter(id__gte=min_id)
    if max_id:
        rows = rows.filter(id__lte=max_id)
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
    if sort or order:
        sign = "" if order == "asc" else "-"
        ordering = [sign + SORT_COLUMNS[sort or "id"], sign + "id"]
    else:
        ordering = ["-arrived_at", "-id"]
    data = [activity_row(r) async for r in rows.order_by(*ordering)[offset : offset + limit]]
    pages = math.ceil(total / limit)
    return JsonResponse(
        {
            "data": data,
            "page": page,
            "limit": limit,
            "total": total,
            "total_pages": pages,
            "pages": pages,
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


async def capture(request: HttpRequest, capture_id: str) -> HttpResponse:
    """GET /api/captures/{id}: a request's capture (``captureBuffer``, web/captures.py),
    by its activity row's id (llama-swap's) or its request id. 404 when none is kept."""
    if (refusal := await api_refusal(request)) is not None:
        return refusal
    row_id: int | None = None
    request_id = capture_id
    if capture_id.isdigit() and len(capture_id) < 19:
        row_id = int(capture_id)
        found = await RequestRecord.objects.filter(pk=row_id).values_list("request_id").afirst()
        request_id = found[0] if found else ""
    kept = captures.store.get(request_id) if request_id else None
    if kept is None:
        return error_response(
            404, f"capture {echo(capture_id)} not found", code="capture_not_found"
        )
    if row_id is None and "\x00" not in request_id:  # PostgreSQL refuses NUL in a compare
        row = await RequestRecord.objects.filter(request_id=request_id).values_list("id").afirst()
        row_id = row[0] if row else None
    return JsonResponse(kept.as_json(row_id))


STATS_MAX_ROWS = 100_000
"""Most rows (the newest) whose speeds the histograms of ``/api/metrics/stats`` read."""


def histogram(values: list[float]) -> dict[str, Any] | None:
    """llama-swap's histogram of speeds: 5 to 20 bins (Sturges), min, max, bin size and
    the 50th, 95th and 99th percentiles (linear between ranks); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    low, high = ordered[0], ordered[-1]

    def percentile(p: float) -> float:
        rank = p / 100 * (len(ordered) - 1)
        lower, upper = math.floor(rank), math.ceil(rank)
        return ordered[lower] + (rank - lower) * (ordered[upper] - ordered[lower])

    out: dict[str, Any] = {
        "bins": [len(values)],
        "min": low,
        "max": high,
        "binSize": 0,
        "p50": percentile(50),
        "p95": percentile(95),
        "p99": percentile(99),
    }
    if low == high:
        return out
    count = min(20, max(5, math.ceil(math.log2(len(values))) + 1))
    size = (high - low) / count
    bins = [0] * count
    for value in values:
        bins[min(int((value - low) // size), count - 1)] += 1
    return out | {"bins": bins, "binSize": size}


async def stats(request: HttpRequest) -> HttpResponse:
    """GET /api/metrics/stats?model=: llama-swap's totals (requests, input, output and
    cached tokens) and its histograms of prompt and generation speeds (the newest
    :data:`STATS_MAX_ROWS` rows that report one)."""
    from django.db.models import Count, Q, Sum

    if (refusal := await api_refusal(request)) is not None:
        return refusal
    model = request.GET.get("model", "").strip()
    if "\x00" in model:
        return error_response(
            400, "model must not contain NUL characters", code="invalid_parameter", param="model"
        )
    rows = RequestRecord.objects.all()
    if model:
        rows = rows.filter(model=model)
    totals = await rows.aaggregate(
        requests=Count("id"),
        input=Sum("prompt_tokens"),
        output=Sum("completion_tokens"),
        cached=Sum("cached_tokens", filter=Q(cached_tokens__gt=0)),
    )
    speeds = rows.filter(Q(prompt_per_second__gt=0) | Q(tokens_per_second__gt=0))
    prompt: list[float] = []
    generation: list[float] = []
    async for p, g in speeds.order_by("-id").values_list(
        "prompt_per_second", "tokens_per_second"
    )[:STATS_MAX_ROWS]:
        if p is not None and p > 0:
            prompt.append(p)
        if g is not None and g > 0:
            generation.append(g)
    return JsonResponse(
        {
            "total_requests": totals["requests"],
            "total_input_tokens": totals["input"] or 0,
            "total_output_tokens": totals["output"] or 0,
            "total_cache_tokens": totals["cached"] or 0,
            "prompt_histogram": histogram(prompt),
            "gen_histogram": histogram(generation),
        }
    )
