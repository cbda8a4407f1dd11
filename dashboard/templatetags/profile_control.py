"""``{% profile_control %}``: the dashboard's profile switch (dashboard/profiles.py), shown
when the config has ``profiles``; the form is for staff members, others see the state."""

from __future__ import annotations

from typing import Any

from django import template

register = template.Library()


@register.inclusion_tag("dashboard/_profile_control.html", takes_context=True)
def profile_control(context: template.Context) -> dict[str, Any]:
    from dashboard.profiles import profiles_state
    from scheduler import runtime

    if not runtime.is_running():
        return {"profiles": []}
    request = context.get("request")
    user = getattr(request, "user", None)
    state = profiles_state()
    return {
        **state,
        "staff": bool(user is not None and user.is_active and user.is_staff),
        "csrf_token": context.get("csrf_token"),
    }
