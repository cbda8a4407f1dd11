"""In flight and waiting: the queue page's table, its JSON, and a waiting request's live
status (the request page polls it).

Everything here reads the dispatcher's state on the event loop (async views: the queue
belongs to the dispatcher task's thread) and never changes it. What a page request may
cost is bounded, and no dispatch pays for it:

* positions and estimated waits are computed for the first :data:`RANK_LIMIT` requests of
  each lane (a request further back is "beyond 1,000th"), at most once per
  :data:`RANKING_TTL` second however many pages ask (:func:`ranking`): ~3 ms at 10,000
  waiting;
* a search walks the waiting requests' tickets once (:data:`MAX_QUERY` characters, at
  most :data:`MAX_TERMS` words) and sends one page of :data:`PAGE_SIZE` rows.

Cancel is ``POST /api/inflight/{id}/cancel`` (``web.cancel.cancel_request``, the one
place that cancels): the page posts there from the browser.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from asgiref.sync import sync_to_async
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string

from dashboard.access import api_refusal, login_needed
from scheduler.core.estimate import WaitEstimator, spreads, wait_range
from scheduler.core.priority import BANDS, band_of
from web.cancel import cancel_answer
from web.errors import error_response
from web.runtime import maybe_runtime_of

if TYPE_CHECKING:
    from scheduler.dispatcher import Dispatcher, Ticket
    from scheduler.runtime import Runtime

log = logging.getLogger("llamaswap.dashboard")

RANK_LIMIT = 1000
"""Positions and estimates are computed for this many requests of each lane."""
RANKING_TTL = 1.0
"""Seconds a ranking is reused for every page that asks."""
PAGE_SIZE = 50
MAX_PAGE = 10_000
MAX_QUERY = 200
MAX_TERMS = 8
STATES = ("all", "running", "waiting")


@dataclass(frozen=True, slots=True)
class Place:
    """A waiting request's place in its lane."""

    position: int
    eta: float
    spread: float


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A lane's running job, as a waiting request's estimate depends on it."""

    request_id: str
    model: str
    elapsed: float
    usual: float


@dataclass(frozen=True)
class Ranking:
    at: float
    """Dispatcher clock (monotonic seconds)."""
    places: Mapping[str, Place]
    running: Mapping[str, RunningJob]
    """Per lane, the job a waiting request waits for (the one expected to end first)."""
    measured: Mapping[str, bool]
    """Per lane: have jobs finished there (else the estimates are defaults)?"""
    depth: Mapping[str, int]
    beyond: Mapping[str, float]
    """Per lane with more than :data:`RANK_LIMIT` waiting: the estimate of its last ranked
    request, a floor for every request further back."""
    order: list[str]
    """Every waiting request (preloads aside) as the table lists them: the ranked ones by
    place (lanes interleaved), then the rest in arrival order."""
    text: list[str]
    """Each of them's :func:`searched_text` (same order)."""
    text_of: Mapping[str, str]
    """The same by request id (the next ranking reuses them)."""


_ranking: Ranking | None = None


def _started(ticket: Ticket, now: float) -> float:
    if ticket.ready_at is not None:
        return ticket.ready_at
    return ticket.dispatched_at if ticket.dispatched_at is not None else now


def _running_job(
    tickets: Iterable[Ticket], estimator: WaitEstimator, now: float
) -> RunningJob | None:
    """The lane's running job that is expected to end first (the least overrun)."""
    best: RunningJob | None = None
    for ticket in tickets:
        if ticket.decision is None:
            continue
        loading = ticket.ready_at is None
        job = RunningJob(
            request_id=ticket.request_id,
            model=ticket.model.id,
            elapsed=max(0.0, now - _started(ticket, now)),
            usual=estimator.usual(ticket.model.id, ticket.decision.band, loading),
        )
        if best is None or job.elapsed - job.usual < best.elapsed - best.usual:
            best = job
    return best


def ranking(dispatcher: Dispatcher, wanted: str | None = None) -> Ranking:
    """Every lane's first :data:`RANK_LIMIT` waiting requests with their positions,
    estimates and spreads; reused for :data:`RANKING_TTL` seconds, unless ``wanted`` (a
    request's page asking) arrived since and would be ranked."""
    global _ranking
    now = dispatcher.now()
    cached = _ranking
    if cached is not None and 0 <= now - cached.at < RANKING_TTL:
        if wanted is None or wanted in cached.places:
            return cached
        ticket = dispatcher.queue_views()[0].get(wanted)
        if ticket is None or ticket.lane in cached.beyond:
            return cached
    tickets, estimators = dispatcher.queue_views()
    waiting = dispatcher.waiting(RANK_LIMIT)
    by_lane: dict[str, list[tuple[int, str, float]]] = {}
    for request_id, (lane, position, eta) in waiting.items():
        by_lane.setdefault(lane, []).append((position, request_id, eta))
    in_flight: dict[str, list[Ticket]] = {}
    for ticket in dispatcher.in_flight():
        in_flight.setdefault(ticket.lane, []).append(ticket)
    places: dict[str, Place] = {}
    running: dict[str, RunningJob] = {}
    beyond: dict[str, float] = {}
    for lane, estimator in estimators.items():
        job = _running_job(in_flight.get(lane, ()), estimator, now)
        if job is not None:
            running[lane] = job
        rows = sorted(by_lane.get(lane, ()))
        models = [tickets[rid].model.id if rid in tickets else "" for _, rid, _ in rows]
        busy = [t.model.id for t in in_flight.get(lane, ())]
        for (position, request_id, eta), spread in zip(
            rows, spreads(models, busy, estimator.means), strict=True
        ):
            places[request_id] = Place(position, eta, spread)
    depth = {lane.name: lane.waiting for lane in dispatcher.lanes()}
    for lane, rows in by_lane.items():
        if rows and depth.get(lane, 0) > len(rows):
            beyond[lane] = max(eta for _, _, eta in rows)
    ranked = sorted(places, key=lambda rid: places[rid].position)
    shown = [tickets[rid] for rid in ranked if rid in tickets]
    shown += [t for rid, t in tickets.items() if rid not in places]  # in arrival order
    shown = [t for t in shown if not t.extra.get("preload")]
    order = [t.request_id for t in shown]
    # A waiting request's text never changes: made once, kept while it waits.
    known = cached.text_of if cached is not None else {}
    text_of = {t.request_id: known.get(t.request_id) or searched_text(t) for t in shown}
    text = list(text_of.values())
    measured = {
        lane: estimator.means.times().service != {} for lane, estimator in estimators.items()
    }
    _ranking = Ranking(now, places, running, measured, depth, beyond, order, text, text_of)
    return _ranking


def estimate(rank: Ranking, lane: str, place: Place) -> dict[str, Any]:
    """A waiting request's estimate as the pages show it (see ``wait_range``)."""
    job = rank.running.get(lane)
    r = wait_range(
        place.eta,
        spread=place.spread,
        running_usual=job.usual if job is not None else None,
        running_elapsed=job.elapsed if job is not None else 0.0,
        measured=rank.measured.get(lane, False),
    )
    return {
        "seconds": round(r.seconds, 1),
        "low": round(r.low, 1),
        "high": None if r.high is None else round(r.high, 1),
        "at_least": r.at_least,
        "overrun": round(r.overrun, 1),
        "measured": r.measured,
    }


def _job(job: RunningJob | None) -> dict[str, Any] | None:
    if job is None:
        return None
    return {
        "request_id": job.request_id,
        "model": job.model,
        "elapsed": round(job.elapsed, 1),
        "usual": round(job.usual, 1),
    }


def _row(ticket: Ticket, rank: Ranking, now: float, running: bool) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": ticket.request_id,
        "state": ticket.state.value if running else "waiting",
        "model": ticket.model.id,
        "lane": ticket.lane,
        "band": band_of(ticket.priority).value,
        "priority": ticket.priority,
        "key": ticket.api_key,
        "waited": round(max(0.0, (ticket.dispatched_at or now) - ticket.arrival), 1),
    }
    if running:
        row["elapsed"] = round(max(0.0, now - _started(ticket, now)), 1)
        return row
    place = rank.places.get(ticket.request_id)
    row["position"] = place.position if place is not None else None
    row["estimate"] = estimate(rank, ticket.lane, place) if place is not None else None
    if place is None and ticket.lane in rank.beyond:
        row["beyond"] = {"after": RANK_LIMIT, "seconds": round(rank.beyond[ticket.lane], 1)}
    return row


class BadQuery(ValueError):
    pass


def parse_query(params: Mapping[str, str]) -> tuple[list[str], str, int]:
    """(search words, state, page) from the query string; :class:`BadQuery` says what is
    wrong."""
    q = params.get("q", "")
    if len(q) > MAX_QUERY or "\x00" in q:
        raise BadQuery(f"q: at most {MAX_QUERY} characters, no NUL")
    words = q.lower().split()
    if len(words) > MAX_TERMS:
        raise BadQuery(f"q: at most {MAX_TERMS} words")
    state = params.get("state", "all") or "all"
    if state not in STATES:
        raise BadQuery(f"state: use one of {', '.join(STATES)}")
    try:
        page = int(params.get("page", "1") or "1")
    except ValueError:
        raise BadQuery("page: a whole number from 1") from None
    if not 1 <= page <= MAX_PAGE:
        raise BadQuery(f"page: a whole number from 1 to {MAX_PAGE}")
    return words, state, page


def searched_text(ticket: Ticket) -> str:
    """What a search looks in: the request id, model, key name, band and state."""
    band = band_of(ticket.priority).value
    return f"{ticket.request_id} {ticket.model.id} {ticket.api_key} {band} {ticket.state.value}".lower()


def matches(text: str, words: list[str]) -> bool:
    """Every word is part of ``text`` (:func:`searched_text`)."""
    return all(word in text for word in words)


def table(dispatcher: Dispatcher, words: list[str], state: str, page: int) -> dict[str, Any]:
    """One page of the in-flight-and-waiting table: running first (longest running
    first), then waiting in dispatch order per lane (ranked ones first, the rest in
    arrival order)."""
    now = dispatcher.now()
    rank = ranking(dispatcher)
    tickets, _ = dispatcher.queue_views()
    running = [] if state == "waiting" else dispatcher.in_flight()
    running = [
        t for t in running if not t.extra.get("preload") and matches(searched_text(t), words)
    ]
    running.sort(key=lambda t: _started(t, now))
    waiting: list[Ticket] = []
    if state != "running":
        # The ranking's order (no sort here); a request that arrived since it was made
        # shows up within RANKING_TTL.
        order = rank.order
        if words:
            pairs = list(zip(order, rank.text, strict=True))
            for word in words:  # one pass a word: no call per request
                pairs = [(rid, text) for rid, text in pairs if word in text]
            order = [rid for rid, _ in pairs]
        found = (tickets.get(rid) for rid in order)
        waiting = [t for t in found if t is not None]
    total = len(running) + len(waiting)
    start = (page - 1) * PAGE_SIZE
    shown = [(t, True) for t in running[start : start + PAGE_SIZE]]
    rest = PAGE_SIZE - len(shown)
    if rest > 0:
        offset = max(0, start - len(running))
        shown += [(t, False) for t in waiting[offset : offset + rest]]
    return {
        "at": round(time.time(), 3),
        "running": len(running),
        "waiting": len(waiting),
        "matched": total,
        "depth": len(tickets),
        "page": page,
        "pages": max(1, -(-total // PAGE_SIZE)),
        "page_size": PAGE_SIZE,
        "rank_limit": RANK_LIMIT,
        "rows": [_row(t, rank, now, is_running) for t, is_running in shown],
        "lanes": {lane: _job(job) for lane, job in rank.running.items()},
    }


def status(dispatcher: Dispatcher, request_id: str) -> dict[str, Any] | None:
    """A request still in flight: where it is and, waiting, its estimate. None: it is not
    (anymore) in flight."""
    now = dispatcher.now()
    tickets, _ = dispatcher.queue_views()
    ticket = tickets.get(request_id)
    if ticket is None:
        for t in dispatcher.in_flight():
            if t.request_id == request_id:
                return {**_row(t, ranking(dispatcher), now, True), "in_flight": True}
        return None
    rank = ranking(dispatcher, request_id)
    row = _row(ticket, rank, now, False)
    row["in_flight"] = True
    row["depth"] = len(dispatcher.queue.lane(ticket.lane))
    row["running_job"] = _job(rank.running.get(ticket.lane))
    return row


def may_cancel(user: Any, rt: Runtime | None) -> bool:
    """Does the page show Cancel? To staff members, and to everyone on a box without API
    keys (``POST /api/inflight/{id}/cancel`` is open there, as in llama-swap)."""
    if getattr(user, "is_active", False) and getattr(user, "is_staff", False):
        return True
    return not (rt is not None and rt.keys.enabled)


def dispatcher_of(request: HttpRequest) -> Dispatcher | None:
    """The dispatcher of the server serving ``request`` (None: none runs)."""
    rt = maybe_runtime_of(request)
    return rt.dispatcher if rt is not None else None


# -- views ---------------------------------------------------------------------------


async def queue_page(request: HttpRequest) -> HttpResponse:
    """/queue/: the table; the rows come from :func:`queue_data` (the page polls it)."""
    user = await request.auser()
    if login_needed(request, user):
        return redirect_to_login(request.get_full_path())
    context = {
        "nav": "queue",
        "bands": [b.value for b in BANDS],
        "page_size": PAGE_SIZE,
        "rank_limit": RANK_LIMIT,
        "can_cancel": may_cancel(user, maybe_runtime_of(request)),
    }
    html = await sync_to_async(render_to_string)("dashboard/queue.html", context, request=request)
    return HttpResponse(html)


async def queue_data(request: HttpRequest) -> HttpResponse:
    """/queue/data: one page of the table as JSON (``q``, ``state``, ``page``)."""
    if (refusal := await api_refusal(request)) is not None:
        return refusal
    try:
        words, state, page = parse_query(request.GET)
    except BadQuery as exc:
        return error_response(400, str(exc), code="invalid_query")
    dispatcher = dispatcher_of(request)
    if dispatcher is None:
        return JsonResponse({"offline": True, "rows": [], "matched": 0, "pages": 1, "page": 1})
    return JsonResponse(table(dispatcher, words, state, page))


async def request_status(request: HttpRequest, request_id: str) -> HttpResponse:
    """/requests/<id>/status: a request in flight (``in_flight``: true, its place and
    estimate), or ``{"in_flight": false, "recorded": ...}`` once it has ended."""
    if (refusal := await api_refusal(request)) is not None:
        return refusal
    dispatcher = dispatcher_of(request)
    found = None if dispatcher is None else status(dispatcher, request_id)
    if found is not None:
        return JsonResponse(found)
    recorded = await sync_to_async(_recorded)(request_id)
    return JsonResponse({"request_id": request_id, "in_flight": False, "recorded": recorded})


AUDIT_FIELD = "cancel"
"""The ``SettingsChange.field`` of a cancel from the dashboard (``old``: the request id
and what it was doing)."""


async def cancel_view(request: HttpRequest, request_id: str) -> HttpResponse:
    """POST /queue/<id>/cancel (the pages' Cancel buttons): CSRF-checked by the pages'
    middleware, for staff members (and anyone on a box without API keys, where the API's
    cancel is open too); cancels through ``web.cancel.cancel_request`` and records who in
    the change log. ``{"msg": "ok", "was": "waiting" | "running"}``, 404 when no such
    request is in flight."""
    user = await request.auser()
    if not may_cancel(user, maybe_runtime_of(request)):
        return error_response(
            403, "only a staff member may cancel requests from the dashboard", code="forbidden"
        )
    if user.is_authenticated:
        who = f"{user.get_username()} (dashboard)"
    else:
        who = "dashboard (no API keys configured)"
    response, was = cancel_answer(request_id, who)
    if was is not None:
        try:
            await sync_to_async(_audit, thread_sensitive=True)(who, request_id, was)
        except Exception:
            log.warning("cancel not recorded in the change log", exc_info=True)
    return response


def _audit(who: str, request_id: str, was: str) -> None:
    from control.models import SettingsChange

    SettingsChange.objects.create(
        who=who[:150],
        field=AUDIT_FIELD,
        old={"request_id": request_id, "was": was},
        new="cancelled",
        source=SettingsChange.SOURCE_ADMIN,
    )


def _recorded(request_id: str) -> bool:
    from activity.models import RequestRecord

    if "\x00" in request_id:
        return False
    return RequestRecord.objects.filter(request_id=request_id).exists()


LOG_BEFORE = 60.0
LOG_AFTER = 5.0
LOG_LINES = 40
LOG_LINE_CHARS = 500


def lines_around(
    entries: Iterable[tuple[int, float, str, bytes]], model: str, at: float
) -> list[dict[str, Any]]:
    """``model``'s log lines from :data:`LOG_BEFORE` seconds before ``at`` (wall) to
    :data:`LOG_AFTER` after: the last :data:`LOG_LINES`, each cut to
    :data:`LOG_LINE_CHARS` characters."""
    out = [
        {
            "at": round(when, 3),
            "time": datetime.fromtimestamp(when, UTC).strftime("%H:%M:%S.%f")[:-3],
            "line": line.decode("utf-8", "replace").rstrip("\n")[:LOG_LINE_CHARS],
        }
        for _, when, who, line in entries
        if who == model and at - LOG_BEFORE <= when <= at + LOG_AFTER
    ]
    return out[-LOG_LINES:]


async def log_lines_around(
    dispatcher: Dispatcher | None, model: str, at: float
) -> list[dict[str, Any]]:
    """The in-memory log's lines of ``model`` around ``at`` (read on the event loop, where
    the buffer is written): what the request page shows under a failure."""
    if dispatcher is None:
        return []
    return lines_around(dispatcher.logs.since(0), model, at)


async def status_on_loop(dispatcher: Dispatcher | None, request_id: str) -> dict[str, Any] | None:
    """:func:`status` for a sync view (through ``async_to_sync``: on the server's loop)."""
    return None if dispatcher is None else status(dispatcher, request_id)
