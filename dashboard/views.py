"""Dashboard pages: the live dashboard, the decision history, one request's story.

Read-only; open unless ``DASHBOARD_REQUIRE_LOGIN`` is set or API keys are configured. The live page reads the
dispatcher's state on the event loop (an async view: the queue belongs to the dispatcher
task's thread) and renders it in a worker thread.
"""

from __future__ import annotations

from datetime import UTC, tzinfo
from pathlib import Path
from typing import Any

from asgiref.sync import async_to_sync, sync_to_async
from django.contrib.auth.views import redirect_to_login
from django.core.paginator import Paginator
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.template.loader import render_to_string

from activity.models import OUTCOME_WORDS
from dashboard import live, queue
from dashboard.access import login_needed, read_only_page
from dashboard.explain import explain
from dashboard.filters import BadFilter, parse_when, parse_zone
from dashboard.snapshot import access_block
from scheduler.core.priority import BANDS
from scheduler.runtime import Runtime
from web.errors import echo
from web.runtime import maybe_runtime_of

PAGE_SIZE = 50


async def dashboard(request: HttpRequest) -> HttpResponse:
    """The live dashboard: first paint from the server, then the websocket."""
    user = await request.auser()
    if login_needed(request, user):
        return redirect_to_login(request.get_full_path())
    snapshot = live.current_snapshot()  # on the loop: the dispatcher's thread
    access = await sync_to_async(access_state)(maybe_runtime_of(request))
    html = await sync_to_async(render_to_string)(
        "dashboard/index.html",
        {"snap": snapshot, "nav": "dashboard", "access": access},
        request=request,
    )
    return HttpResponse(html)


def access_state(rt: Runtime | None) -> dict[str, Any]:
    """Open or keyed, from the key ring of the server ``rt`` (else the stored state), and
    the admin's access control row: since when, by whom (one indexed row; a worker
    thread)."""
    from django.db import DatabaseError

    from control.models import AccessControl

    try:
        row = AccessControl.objects.filter(pk=AccessControl.SINGLETON_PK).first()
    except DatabaseError:  # not migrated yet, or locked: the live dashboard still shows
        row = None
    ring = live.access_now(rt)
    keyed = ring["keyed"] if ring is not None else bool(row and row.keys_required)
    since = row.changed_at.timestamp() if row is not None and row.changed_by else None
    return access_block(
        keyed=keyed,
        keys=ring["keys"] if ring is not None else None,
        since=since,
        by=row.changed_by if row else "",
    )


def _records() -> Any:
    from activity.models import RequestRecord

    return RequestRecord.objects


FILTERS = ("model", "outcome", "lane", "band", "node", "since", "until", "request_id", "api_key")
"""The history page's filters, in the form's order."""
OTHER_PARAMETERS = ("page", "tz")
"""Also accepted: the page number and the time zone of since/until (set by the page)."""
SIMILAR = {"start": "since", "from": "since", "end": "until", "to": "until", "id": "request_id"}
"""Names people try (the activity API's start/end): the page names its own instead."""


def _unknown_parameter(name: str) -> str:
    hint = SIMILAR.get(name.strip().lower())
    known = ", ".join(FILTERS)
    if hint:
        return f"{echo(name)} is not a filter here: use {hint} (the filters are {known})"
    return f"{echo(name)} is not a filter (the filters are {known})"


def _filter_problems(params: Any, filters: dict[str, str], bands: list[str]) -> list[str]:
    """Everything wrong with the query, each naming the filter, its value and what works."""
    problems = [
        _unknown_parameter(name)
        for name in params
        if name not in FILTERS and name not in OTHER_PARAMETERS
    ]
    for name, value in filters.items():
        if "\x00" in value:  # PostgreSQL refuses NUL in a query
            problems.append(f"{name}: NUL characters are not allowed")
    band = filters["band"]
    if band and "\x00" not in band and band not in bands:
        problems.append(f"band: there is no band {echo(band)}; use {', '.join(bands)}")
    outcome = filters.get("outcome", "")
    if outcome and "\x00" not in outcome and outcome not in OUTCOME_WORDS:
        problems.append(
            f"outcome: there is no outcome {echo(outcome)}; use {', '.join(OUTCOME_WORDS)}"
        )
    return problems


@read_only_page
def history(request: HttpRequest) -> HttpResponse:
    """Every recorded request with its decision, newest first, filtered and paginated.

    A filter that cannot be used is a 400 page that keeps the form and says, for each
    one, which filter, which value and what it accepts (never an empty table).
    """
    params = request.GET
    filters = {name: params.get(name, "").strip() for name in FILTERS}
    tz_name = params.get("tz", "").strip()
    bands = [b.value for b in BANDS]
    problems = _filter_problems(params, {**filters, "tz": tz_name}, bands)
    since = until = None
    zone: tzinfo = UTC
    if "\x00" not in tz_name:
        try:
            zone = parse_zone(tz_name)
        except BadFilter as exc:
            problems.append(str(exc))
    for name, end in (("since", False), ("until", True)):
        if "\x00" in filters[name]:
            continue
        try:
            when = parse_when(name, filters[name], end=end, zone=zone)
        except BadFilter as exc:
            problems.append(str(exc))
            continue
        if name == "since":
            since = when
        else:
            until = when
    models = _records().order_by("model").values_list("model", flat=True).distinct()
    lanes = _records().order_by("lane").values_list("lane", flat=True).distinct()
    nodes = [n for n in _records().order_by("node").values_list("node", flat=True).distinct() if n]
    context: dict[str, Any] = {
        "nodes": nodes,  # fleet mode: the node each request's client talked to (a column)
        "nav": "history",
        "filters": filters,
        "outcomes": OUTCOME_WORDS,
        "lanes": list(lanes),
        "tz": tz_name,
        "bands": bands,
        "models": list(models),
        "problems": problems,
    }
    if problems:
        return render(request, "dashboard/history.html", context, status=400)
    rows = _records().all()
    if filters["model"]:
        rows = rows.filter(model=filters["model"])
    if filters["outcome"]:
        rows = rows.filter(outcome=filters["outcome"])
    if filters["lane"]:
        rows = rows.filter(lane=filters["lane"])
    if filters["band"]:
        rows = rows.filter(band=filters["band"])
    if filters["node"]:
        rows = rows.filter(node=filters["node"])
    if filters["request_id"]:
        rows = rows.filter(Q(request_id__startswith=filters["request_id"]))
    if filters["api_key"]:
        rows = rows.filter(api_key=filters["api_key"])
    if since is not None:
        rows = rows.filter(arrived_at__gte=since)
    if until is not None:
        rows = rows.filter(arrived_at__lte=until)
    page = Paginator(rows.order_by("-arrived_at", "-id"), PAGE_SIZE).get_page(params.get("page"))
    query = params.copy()
    query.pop("page", None)
    context.update(page=page, query=query.urlencode())
    return render(request, "dashboard/history.html", context)


@read_only_page
def request_detail(request: HttpRequest, request_id: str) -> HttpResponse:
    """One request: its wait, and the jobs that ran before it and why each one won."""
    mine = None if "\x00" in request_id else _records().filter(request_id=request_id).first()
    if mine is None:
        waiting = _waiting_now(request, request_id)
        if waiting is None:
            return render(
                request,
                "dashboard/request_missing.html",
                {
                    "nav": "history",
                    "request_id": request_id,
                    "searchable": 0 < len(request_id) <= 64 and "\x00" not in request_id,
                },
                status=404,
            )
        return render(
            request,
            "dashboard/request.html",
            {
                "nav": "queue",
                "waiting": waiting,
                "request_id": request_id,
                "can_cancel": queue.may_cancel(request.user, maybe_runtime_of(request)),
            },
        )
    end = mine.dispatched_at or mine.finished_at
    ahead_rows = list(
        _records()
        .filter(dispatched_at__isnull=False, dispatched_at__lt=end, finished_at__gt=mine.arrived_at)
        .filter(lane=mine.lane)  # other lanes (GPUs) never held it up
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
            "log_lines": _log_lines(request, mine) if mine.outcome == "failed" else [],
        },
    )


def _log_lines(request: HttpRequest, record: Any) -> list[dict[str, Any]]:
    """The failed request's model's log lines around its end (from the in-memory log,
    while it still has them)."""
    at = record.finished_at.timestamp()
    dispatcher = queue.dispatcher_of(request)
    return async_to_sync(queue.log_lines_around)(dispatcher, record.model, at)


def _waiting_now(request: HttpRequest, request_id: str) -> dict[str, Any] | None:
    """A request still in the queue or running has no record yet: show where it is (the
    page then follows it live: ``dashboard.queue.request_status``)."""
    return async_to_sync(queue.status_on_loop)(queue.dispatcher_of(request), request_id)


FAVICON = Path(__file__).resolve().parent / "static" / "dashboard" / "favicon.ico"


def favicon(request: HttpRequest) -> HttpResponse:
    """/favicon.ico, which browsers and tools ask for whatever the page links: open even
    when the pages need a login, cached for a day."""
    response = HttpResponse(FAVICON.read_bytes(), content_type="image/x-icon")
    response["Cache-Control"] = "public, max-age=86400"
    return response
