"""Dashboard pages: the live dashboard, the decision history, one request's story.

Read-only; open unless ``DASHBOARD_REQUIRE_LOGIN`` is set. The live page reads the
dispatcher's state on the event loop (an async view: the queue belongs to the dispatcher
task's thread) and renders it in a worker thread.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, time
from typing import Any

from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.core.paginator import Paginator
from django.db.models import Q
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from dashboard import live
from dashboard.explain import explain
from proxy.errors import echo, error_page
from scheduler.core.priority import BANDS

PAGE_SIZE = 50


def _login_needed(request: HttpRequest, user: Any) -> bool:
    return settings.DASHBOARD_REQUIRE_LOGIN and not user.is_authenticated


def read_only_page(view):
    """Open by default; behind the admin login when DASHBOARD_REQUIRE_LOGIN is set."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if _login_needed(request, request.user):
            return redirect_to_login(request.get_full_path())
        return view(request, *args, **kwargs)

    return wrapper


async def dashboard(request: HttpRequest) -> HttpResponse:
    """The live dashboard: first paint from the server, then the websocket."""
    user = await request.auser()
    if _login_needed(request, user):
        return redirect_to_login(request.get_full_path())
    snapshot = live.current_snapshot()  # on the loop: the dispatcher's thread
    html = await sync_to_async(render_to_string)(
        "dashboard/index.html", {"snap": snapshot, "nav": "dashboard"}, request=request
    )
    return HttpResponse(html)


def _records():
    from activity.models import RequestRecord

    return RequestRecord.objects


class BadFilter(Exception):
    """A history filter that cannot be used: the page says which and why (400)."""


def _parse_when(name: str, value: str, end: bool = False) -> datetime | None:
    """A filter bound from ``2026-11-29``, ``2026-11-29T21:40`` or a full ISO time (UTC)."""
    value = value.strip()
    if not value:
        return None
    try:
        when = parse_datetime(value)
        if when is None:
            day = parse_date(value)
            if day is None:
                raise BadFilter(
                    f"{name}: expected a date like 2026-11-29 or a time like 2026-11-29T21:40, "
                    f"got {echo(value)}"
                )
            when = datetime.combine(day, time.max if end else time.min)
    except ValueError:  # well-formed, but no such day or time: 2026-02-30
        raise BadFilter(f"{name}: there is no such date or time as {echo(value)}") from None
    if timezone.is_naive(when):
        when = when.replace(tzinfo=UTC)
    try:
        when.astimezone(UTC)  # what the database adapter does: 0001-01-01T00:00+01:00 overflows
    except OverflowError:
        raise BadFilter(f"{name}: {echo(value)} is out of range") from None
    return when


@read_only_page
def history(request: HttpRequest) -> HttpResponse:
    """Every recorded request with its decision, newest first, filtered and paginated."""
    params = request.GET
    rows = _records().all()
    filters = {
        "model": params.get("model", "").strip(),
        "band": params.get("band", "").strip(),
        "request_id": params.get("request_id", "").strip(),
        "since": params.get("since", "").strip(),
        "until": params.get("until", "").strip(),
    }
    for name, value in filters.items():
        if "\x00" in value:  # PostgreSQL refuses NUL in a query
            return error_page(request, 400, f"{name}: NUL characters are not allowed")
    try:
        since = _parse_when("since", filters["since"])
        until = _parse_when("until", filters["until"], end=True)
    except BadFilter as exc:
        return error_page(request, 400, str(exc))
    if filters["model"]:
        rows = rows.filter(model=filters["model"])
    if filters["band"]:
        rows = rows.filter(band=filters["band"])
    if filters["request_id"]:
        rows = rows.filter(Q(request_id__startswith=filters["request_id"]))
    if since is not None:
        rows = rows.filter(arrived_at__gte=since)
    if until is not None:
        rows = rows.filter(arrived_at__lte=until)
    page = Paginator(rows.order_by("-arrived_at", "-id"), PAGE_SIZE).get_page(params.get("page"))
    query = params.copy()
    query.pop("page", None)
    models = _records().order_by("model").values_list("model", flat=True).distinct()
    return render(
        request,
        "dashboard/history.html",
        {
            "nav": "history",
            "page": page,
            "filters": filters,
            "bands": [b.value for b in BANDS],
            "models": list(models),
            "query": query.urlencode(),
        },
    )


@read_only_page
def request_detail(request: HttpRequest, request_id: str) -> HttpResponse:
    """One request: its wait, and the jobs that ran before it and why each one won."""
    mine = None if "\x00" in request_id else _records().filter(request_id=request_id).first()
    if mine is None:
        waiting = _waiting_now(request_id)
        if waiting is None:
            raise Http404(f"no request {echo(request_id)} in the activity log")
        return render(
            request,
            "dashboard/request.html",
            {"nav": "history", "waiting": waiting, "request_id": request_id},
        )
    end = mine.dispatched_at or mine.finished_at
    ahead_rows = list(
        _records()
        .filter(dispatched_at__isnull=False, dispatched_at__lt=end, finished_at__gt=mine.arrived_at)
        .exclude(pk=mine.pk)
        .order_by("dispatched_at", "id")
    )
    ahead = explain(mine, ahead_rows)
    busy = sum(
        max(0.0, (min(r.finished_at, end) - max(r.dispatched_at, mine.arrived_at)).total_seconds())
        for r in ahead_rows
    )
    return render(
        request,
        "dashboard/request.html",
        {
            "nav": "history",
            "r": mine,
            "ahead": ahead,
            "busy_seconds": busy,
            "request_id": request_id,
            "wait_seconds": (mine.queue_wait_ms or 0) / 1000 if mine.dispatched_at else None,
            "total_seconds": mine.duration_ms / 1000,
        },
    )


def _waiting_now(request_id: str) -> dict[str, Any] | None:
    """A request still in the queue has no record yet: show its place in line."""
    snapshot = async_to_sync(_snapshot_on_loop)()
    for row in snapshot["waiting"]:
        if row["request_id"] == request_id:
            return {**row, "depth": snapshot["depth"]}
    return None


async def _snapshot_on_loop() -> dict[str, Any]:
    # From a sync view, async_to_sync runs this on the server's event loop, where the
    # dispatcher owns the queue: never read the queue from a worker thread.
    return live.current_snapshot()
