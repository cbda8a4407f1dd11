"""Who may see the dashboard: open by default, behind the admin login when
``DASHBOARD_REQUIRE_LOGIN`` is set or API keys are configured (the pages, the websocket,
the JSON API without a key)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse

from scheduler.runtime import Runtime
from web.errors import login_required as login_required_response
from web.runtime import maybe_runtime_of


def login_required(rt: Runtime | None) -> bool:
    """Do the read-only pages (and the websocket, and the JSON API without a key) of the
    server ``rt`` (None: none runs) need a Django login? When ``DASHBOARD_REQUIRE_LOGIN``
    is set, and whenever API keys are configured: a box that asks its API clients for a
    key does not show its queue to anyone."""
    if settings.DASHBOARD_REQUIRE_LOGIN:
        return True
    return rt is not None and rt.keys.enabled


async def api_refusal(request: HttpRequest) -> HttpResponse | None:
    """The dashboard's JSON API: 403 JSON when a login is needed and there is neither one
    nor an API key."""
    if getattr(request, "scope", {}).get("llamaswap.api_key") is not None:
        return None
    if not login_required(maybe_runtime_of(request)):
        return None
    user = await request.auser()
    return None if user.is_authenticated else login_required_response()


def is_staff(user: Any) -> bool:
    """An active staff member (every scope: the control pages' buttons, the logs)."""
    return bool(getattr(user, "is_active", False) and getattr(user, "is_staff", False))


def login_needed(request: HttpRequest, user: Any) -> bool:
    return not user.is_authenticated and login_required(maybe_runtime_of(request))


def read_only_page(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Open by default; behind the admin login when :func:`login_required`."""

    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if login_needed(request, request.user):
            return redirect_to_login(request.get_full_path())
        return view(request, *args, **kwargs)

    return wrapper
