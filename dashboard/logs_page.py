"""The logs page (``/dashboard/logs/``): llamaswap's own lines (dispatch, swaps, failed
starts, refusals: :mod:`scheduler.proxylog`) and every model's output, stamped, in the
order they were written, filtered in the browser by model, level and text. Live: the
page polls ``/dashboard/logs/feed?after=N`` every second for the lines numbered above the
last it has (each buffer numbers its lines from one counter, :mod:`scheduler.logbuffer`),
at most :data:`FEED_LIMIT` a time; the page keeps the last 2,000.

Staff only where a login is needed (logs can hold prompts); open when the box is.
"""

from __future__ import annotations

import re
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.loader import render_to_string

from dashboard.access import is_staff, login_required
from scheduler import proxylog
from scheduler.logbuffer import LogBuffer
from web.errors import echo, error_response
from web.runtime import maybe_runtime_of, runtime_of

FEED_LIMIT = 500
"""Lines one poll returns at most (the newest, when more came)."""
KEPT_IN_PAGE = 2000
"""Lines the page keeps (older ones leave the page as new ones come)."""
_PROXY_LINE = re.compile(r"^\S+ \[(\w+)\] ")


async def _allowed(request: HttpRequest) -> bool:
    """Staff, or anyone on a box that needs no login."""
    if not login_required(maybe_runtime_of(request)):
        return True
    user = await request.auser()
    return is_staff(user)


def _text(line: bytes) -> str:
    return line.decode("utf-8", "replace").rstrip("\n")


def feed(upstream: LogBuffer, after: int, limit: int = FEED_LIMIT) -> dict[str, Any]:
    """The lines numbered above ``after`` (the newest ``limit``) of the models' log
    ``upstream`` and llamaswap's own, oldest first."""
    lines: list[dict[str, Any]] = []
    for seq, at, model, line in upstream.since(after, limit):
        lines.append(
            {
                "seq": seq,
                "t": at,
                "source": "upstream",
                "model": model,
                "level": "output",
                "text": _text(line),
            }
        )
    for seq, at, model, line in proxylog.proxy_log.since(after, limit):
        text = _text(line)
        match = _PROXY_LINE.match(text)
        level = match.group(1) if match else "info"
        text = text[match.end() :] if match else text
        lines.append(
            {"seq": seq, "t": at, "source": "proxy", "model": model, "level": level, "text": text}
        )
    lines.sort(key=lambda entry: entry["seq"])
    lines = lines[-limit:]
    last = lines[-1]["seq"] if lines else after
    return {"last": last, "lines": lines}


async def logs_page(request: HttpRequest) -> HttpResponse:
    """GET /dashboard/logs/."""
    if not await _allowed(request):
        return redirect_to_login(request.get_full_path())
    models = list(runtime_of(request).config.models)
    context = {"nav": "logs", "models": models, "kept": KEPT_IN_PAGE}
    html = await sync_to_async(render_to_string)("dashboard/logs.html", context, request=request)
    return HttpResponse(html)


async def logs_feed(request: HttpRequest) -> HttpResponse:
    """GET /dashboard/logs/feed?after=N: JSON ``{"last": N, "lines": [...]}``."""
    if not await _allowed(request):
        return error_response(
            403, "the logs need a staff login: sign in at /admin/login/", code="login_required"
        )
    raw = request.GET.get("after", "0")
    try:
        after = int(raw)
        if after < 0:
            raise ValueError
    except ValueError:
        return error_response(
            400,
            f"after must be a line number (0 or more), got {echo(raw)}",
            code="invalid_after",
            param="after",
        )
    return JsonResponse(feed(runtime_of(request).dispatcher.logs, after))
