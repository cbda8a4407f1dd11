"""``{% profile_control %}``: the dashboard's profile switch (dashboard/profiles.py), shown
when the config has ``profiles``; the form is for staff members, others see the state."""

from __future__ import annotations

from typing import Any

from django import template

register = template.Library()


@register.inclusion_tag("dashboard/_profile_control.html", takes_context=True)
def profile_control(context: template.Context) -> dict[str, Any]:
    from dashboard.profiles import profiles_state
    from web.runtime import maybe_runtime_of

    request = context.get("request")
    rt = maybe_runtime_of(request) if request is not None else None
    if rt is None:
        return {"profiles": []}
    user = getattr(request, "user", None)
    state = profiles_state(rt)
    return {
        **state,
        "staff": bool(user is not None and user.is_active and user.is_staff),
        "csrf_token": context.get("csrf_token"),
    }
