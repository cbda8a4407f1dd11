"""The models page (``/models/``): every configured model and every peer model, with its
state (stopped, starting, ready, stopping, failed), why its last start failed, its lane
and group, slots in use, requests waiting, when it was loaded and how long that took, how
long it has been idle and what is left of its ttl. Live: the page polls
``/models/feed/`` (the same rows as JSON) every second. Staff see Load, Unload and Unload
all (:mod:`dashboard.model_control`).

Read on the event loop (the dispatcher's state belongs to its task's thread): the rows
are O(models), never the queue.
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import get_token
from django.template.loader import render_to_string

from dashboard.access import is_staff, login_needed
from dashboard.model_watch import ModelFacts, watch_of
from fleet.node import section as fleet_section
from scheduler.runtime import Runtime
from web.errors import login_required as login_required_response
from web.runtime import runtime_of

FAILED = "failed"


def _group(router: Any, model: str) -> str:
    group_of = getattr(router, "group_of", None)
    return group_of(model).name if group_of is not None else getattr(router, "kind", "")


def model_rows(rt: Runtime) -> dict[str, Any]:
    """The page's data: ``{"models": [...], "peers": [...], "loaded": n, "fleet": ...}``
    (``fleet``: every node, up or down, and its models' states, from the fleet's view in
    memory; None on one box)."""
    config, dispatcher = rt.config, rt.dispatcher
    states = dispatcher.model_states()
    timers = dispatcher.model_timers()
    watch = watch_of(dispatcher.observers)
    slots: dict[str, int] = {}
    for lane in dispatcher.lanes():
        for ticket in lane.running:
            slots[ticket.model.id] = slots.get(ticket.model.id, 0) + 1
    rows = []
    for model_id, model in config.models.items():
        state = states.get(model_id)
        idle, ttl_left, cooling = timers.get(model_id, (None, None, None))
        facts = watch.facts.get(model_id, ModelFacts()) if watch is not None else ModelFacts()
        name = state.value if state is not None else ("failed" if cooling else "stopped")
        running = slots.get(model_id, 0)
        rows.append(
            {
                "id": model_id,
                "name": model.name,
                "description": model.description,
                "state": name,
                "failure": cooling or facts.failure,
                "failed_at": facts.failed_at,
                "lane": config.lane_of.get(model_id, "default"),
                "group": _group(config.router, model_id),
                "slots": model.slots,
                "running": running,
                "waiting": max(0, dispatcher.load(model_id) - running),
                "ready_at": facts.ready_at if state is not None else None,
                "load_seconds": facts.load_seconds,
                "idle_seconds": None if idle is None else round(idle, 1),
                "ttl": model.ttl,
                "ttl_left": None if ttl_left is None else round(ttl_left, 1),
            }
        )
    peers = [
        {"id": name, "peer": route.peer.id, "upstream_model": route.model, "state": "peer"}
        for name, route in sorted(config.peer_routes.items())
    ]
    return {"models": rows, "peers": peers, "loaded": len(states), "fleet": fleet_section()}


async def _refusal(request: HttpRequest) -> tuple[Any, HttpResponse | None]:
    user = await request.auser()
    if login_needed(request, user):
        return user, redirect_to_login(request.get_full_path())
    return user, None


async def models_page(request: HttpRequest) -> HttpResponse:
    """GET /models/: first paint from the server, then polling."""
    user, refusal = await _refusal(request)
    if refusal is not None:
        return refusal
    data = model_rows(runtime_of(request))  # on the loop: the dispatcher's thread
    staff = is_staff(user)
    context = {"nav": "models", "data": data, "staff": staff, "csrf": get_token(request)}
    html = await sync_to_async(render_to_string)("dashboard/models.html", context, request=request)
    return HttpResponse(html)


async def models_feed(request: HttpRequest) -> HttpResponse:
    """GET /models/feed/: the rows as JSON (a 403 JSON error where a login is needed)."""
    user = await request.auser()
    if login_needed(request, user):
        return login_required_response()
    return JsonResponse(model_rows(runtime_of(request)))
