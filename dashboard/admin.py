"""The admin login, throttled (dashboard/login_throttle.py). The admin pages of the
control records (issued API keys, access control, the scheduler settings and their
change log) are registered by the ``control`` app (``control/admin.py``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from django.contrib import admin
from django.contrib.admin.forms import AdminAuthenticationForm
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse

from dashboard import login_throttle
from web.errors import echo

log = logging.getLogger("llamaswap.admin")


class ThrottledLoginForm(AdminAuthenticationForm):
    """The admin's login form, refusing a locked username and address before checking
    the password, and counting each failure."""

    def clean(self) -> dict[str, Any]:
        username = self.cleaned_data.get("username") or ""
        address = login_throttle.client_address(self.request)
        wait = login_throttle.throttle.locked_for(username, address)
        if wait:
            self.request.login_throttled = True  # type: ignore[union-attr]  # the view's 429
            log.info(
                "admin login refused: locked",
                extra={"username": echo(username, 50), "client": address, "seconds": round(wait)},
            )
            raise ValidationError(login_throttle.lock_message(wait), code="throttled")
        try:
            data = super().clean()
        except ValidationError:
            if login_throttle.throttle.failed(username, address):
                self.request.login_throttled = True  # type: ignore[union-attr]
                limits = login_throttle.throttle.limits
                log.warning(
                    "admin login locked after repeated failures",
                    extra={
                        "username": echo(username, 50),
                        "client": address,
                        "failures": limits.failures,
                        "lockout_seconds": limits.lockout,
                    },
                )
                raise ValidationError(
                    login_throttle.lock_message(limits.lockout), code="throttled"
                ) from None
            raise
        login_throttle.throttle.succeeded(username, address)
        return data


def _throttled_status(login_view):
    """The admin's login view answering 429 (not 200) while the form says "locked"."""

    @functools.wraps(login_view)
    def view(request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        response = login_view(request, extra_context)
        if getattr(request, "login_throttled", False):
            response.status_code = 429
        return response

    return view


admin.site.login_form = ThrottledLoginForm
admin.site.login = _throttled_status(admin.site.login)  # type: ignore[method-assign]
