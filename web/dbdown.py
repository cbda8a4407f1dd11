"""Pages while the database is away: a ``503`` that says so, not a ``500``.

The proxy's own endpoints need no database (they bypass Django's stack: proxy/handler.py)
and keep serving; their records wait in the activity journal and arrive once the database
is back (activity/recorder.py). The pages and JSON views that read records cannot answer
meanwhile: this middleware turns the database's connection errors into a ``503`` naming the
cause, JSON on API paths (:func:`web.paths.wants_json`), a plain page elsewhere, with
``Retry-After``. Any other error is left to Django (a ``500`` and the traceback in the log).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.template.loader import render_to_string

from web.errors import clip, error_response
from web.paths import wants_json

log = logging.getLogger("llamaswap.pages")

RETRY_AFTER = "5"
MESSAGE = (
    "the database is unavailable ({cause}): pages that read records answer again once it "
    "is back; requests are still served, and their records are kept and written then"
)

GetResponse = Callable[[HttpRequest], HttpResponseBase | Awaitable[HttpResponseBase]]


def database_unavailable(request: HttpRequest, exception: Exception) -> HttpResponse:
    """The answer to a request whose view lost the database."""
    message = MESSAGE.format(cause=clip(f"{type(exception).__name__}: {exception}".strip()))
    headers = {"Retry-After": RETRY_AFTER}
    if wants_json(request.path):
        return error_response(503, message, code="database_unavailable", headers=headers)
    # No request context and no base template: they may need the database themselves.
    page = HttpResponse(render_to_string("errors/503.html", {"message": message}), status=503)
    page["Retry-After"] = RETRY_AFTER
    return page


class DatabaseUnavailableMiddleware:
    """``process_exception`` for the database's connection errors (sync and async)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: GetResponse) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, OperationalError | InterfaceError):
            return None
        log.warning(
            "database unavailable: %s %s answered 503 (%s)",
            request.method,
            request.path,
            clip(str(exception)),
        )
        return database_unavailable(request, exception)
