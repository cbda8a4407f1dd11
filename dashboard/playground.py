"""The playground (``/playground/``): send a prompt to a chosen model at a chosen priority
(a band or an integer) and watch it wait, load and stream. The page itself sends a
streamed ``POST /v1/chat/completions`` with ``X-LlamaSwap-Priority`` from the browser,
through the proxy like any client (same origin: the cross-site rule passes; a staff
session passes the key check). While it waits, a model with ``sendLoadingState`` streams
its place in the queue and its load (:mod:`proxy.progress`); the page shows those apart
from the answer.

Staff only where a login is needed; open when the box is.
"""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string

from dashboard.access import is_staff, login_required
from scheduler.core.priority import BANDS
from web.runtime import runtime_of


async def playground(request: HttpRequest) -> HttpResponse:
    """GET /playground/."""
    rt = runtime_of(request)
    if login_required(rt):
        user = await request.auser()
        if not is_staff(user):
            return redirect_to_login(request.get_full_path())
    config = rt.config
    models = [
        {"id": m.id, "progress": m.send_loading_state}
        for m in config.models.values()
        if not m.unlisted
    ]
    models += [{"id": name, "progress": False} for name in sorted(config.peer_routes)]
    context = {"nav": "playground", "models": models, "bands": [b.value for b in BANDS]}
    html = await sync_to_async(render_to_string)(
        "dashboard/playground.html", context, request=request
    )
    return HttpResponse(html)
