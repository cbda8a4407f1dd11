"""llama-swap's ``profiles`` switched at run time: its API, the dashboard's control, and the
audit trail.

* ``GET /api/profiles``: ``{"active": name | null, "profiles": [{id, description, pins}]}``.
* ``PUT /api/profiles/active`` with ``{"name": "<id>"}`` or ``{"name": null}`` (none):
  ``{"active": ...}``; 404 for an unknown profile. llama-swap's paths and bodies. Like the
  other state-changing endpoints: with API keys required it needs a key granted the
  ``profiles`` scope or a staff member's session (``web.access``), and a browser
  page of another site is refused (keys or not).
* The dashboard's control (``POST /dashboard/profile/``, a form with the CSRF token): staff
  members only (a staff login has every scope).

Every change is a :class:`control.models.SettingsChange` row (field ``profile``, old and
new, who: the staff member or the API key's name), as admin settings edits are. As in
llama-swap no profile is active after a start; the choice lives in the running server,
and a config reload keeps it while the new config still has it
(``llamaswap_site/reload.py``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from scheduler.keys import Scope, missing_scope_message
from scheduler.runtime import Runtime
from web.errors import cross_origin_refused, echo, error_page, error_response
from web.runtime import runtime_of

log = logging.getLogger("llamaswap.settings")

FIELD = "profile"
"""The ``SettingsChange.field`` of a profile switch."""


class UnknownProfile(LookupError):
    pass


async def switch(rt: Runtime, name: str, who: str) -> tuple[str, str]:
    """Make ``name`` ("" none) the active profile of ``rt``; record the change. Returns
    (old, new). Raises :class:`UnknownProfile`. A database that is away costs the audit
    row (logged), never the switch."""
    if name and name not in rt.config.profiles:
        raise UnknownProfile(name)
    old = rt.profile
    if old == name:
        return old, name
    rt.profile = name
    log.info(
        "active profile changed to %r",
        name,
        extra={"action": "profile", "old": old, "new": name, "who": who},
    )
    try:
        await sync_to_async(_audit, thread_sensitive=True)(who, old, name)
    except Exception:
        log.warning("profile change not recorded in the change log", exc_info=True)
    return old, name


def _audit(who: str, old: str, new: str) -> None:
    from control.models import SettingsChange

    SettingsChange.objects.create(
        who=who[:150],
        field=FIELD,
        old=old or None,
        new=new or None,
        source=SettingsChange.SOURCE_ADMIN,
    )


def profiles_state(rt: Runtime) -> dict[str, Any]:
    return {
        "active": rt.profile or None,
        "profiles": [
            {"id": p.id, "description": p.description, "pins": dict(p.pins)}
            for p in sorted(rt.config.profiles.values(), key=lambda p: p.id)
        ],
    }


async def profiles_api(request: HttpRequest) -> HttpResponse:
    """GET /api/profiles (behind a login with ``DASHBOARD_REQUIRE_LOGIN``, as the rest of
    the dashboard's JSON API)."""
    from dashboard.access import api_refusal

    if (refusal := await api_refusal(request)) is not None:
        return refusal
    return JsonResponse(profiles_state(runtime_of(request)))


@csrf_exempt  # no session is needed or trusted here: a key, or no keys; cross-site refused
async def active_profile_api(request: HttpRequest) -> HttpResponse:
    """PUT /api/profiles/active."""
    from web.access import cross_origin

    reason = cross_origin(request)
    if reason is not None:
        return cross_origin_refused(reason)
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return error_response(
            400, "invalid profile request: expected a JSON object", code="invalid_json"
        )
    if not isinstance(body, dict):
        return error_response(
            400, "invalid profile request: expected a JSON object", code="invalid_json"
        )
    if "name" not in body:
        return error_response(400, "profile name is required", code="missing_name", param="name")
    name = body["name"]
    if name is not None and not isinstance(name, str):
        return error_response(
            400, "profile name must be a string or null", code="invalid_name", param="name"
        )
    scope = getattr(request, "scope", None) or {}
    key = scope.get("llamaswap.api_key")
    if key is not None:
        if not key.allows(Scope.PROFILES):  # the router refuses it first; kept beside the act
            return error_response(
                403,
                missing_scope_message(Scope.PROFILES, request.path, key.name),
                code="insufficient_scope",
            )
        who = f"API key {key.name}"
    else:
        user = await request.auser()
        if user.is_active and user.is_staff:
            who = f"{user.get_username()} (API)"
        elif runtime_of(request).keys.enabled:  # not reached: the router asks for a key first
            return error_response(
                401, "an API key or a staff login is needed", code="invalid_api_key"
            )
        else:
            who = "API (no API keys configured)"
    rt = runtime_of(request)
    try:
        await switch(rt, name or "", who)
    except UnknownProfile:
        return error_response(404, f"profile {echo(name)} not found", code="profile_not_found")
    return JsonResponse({"active": rt.profile or None})


async def profile_control(request: HttpRequest) -> HttpResponse:
    """POST /dashboard/profile/ (the dashboard's form): staff only (others are sent to the
    login), CSRF-checked by the pages' middleware."""
    user = await request.auser()
    if not (user.is_active and user.is_staff):
        return redirect_to_login("/dashboard/")
    page = sync_to_async(error_page)  # renders with the request's user: not on the loop
    if request.method != "POST":
        return await page(request, 405, "switch the profile with the form on the dashboard")
    name = request.POST.get("profile", "")
    try:
        await switch(runtime_of(request), name, f"{user.get_username()} (dashboard)")
    except UnknownProfile:
        return await page(request, 404, f"there is no profile {echo(name)}")
    return HttpResponseRedirect("/dashboard/")
