"""One way to say what went wrong: OpenAI-shaped JSON errors.

* :func:`error_response`: ``{"error": {"message", "type", "code"}}`` with a named code per
  status (``method_not_allowed``, not ``"405"``) and an ``X-LlamaSwap-Request-Id``.
* :func:`echo`: a client's value quoted in a message, cut to :data:`ECHO_LIMIT` characters
  (a 1 MB model name is not sent back whole).
* :func:`allow_methods`: 405 with ``Allow`` for the methods a view does not serve.
* The URLconf's error handlers (``handler400/403/404/500`` in ``llamaswap_site/urls.py``,
  ``CSRF_FAILURE_VIEW`` in the settings): JSON on API and proxy paths
  (:func:`wants_json`), an HTML page that says what was wrong everywhere else. Both ASGI
  handlers reach them (the lean proxy handler through ``convert_exception_to_response``).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.http import HttpRequest, HttpResponse

from web.paths import wants_json

REQUEST_ID_HEADER = "X-LlamaSwap-Request-Id"
ECHO_LIMIT = 200
"""Characters of a client-sent value quoted in an error message."""

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}

CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "request_too_large",
    414: "uri_too_long",
    415: "unsupported_media_type",
    422: "unprocessable_entity",
    429: "too_many_requests",
    431: "headers_too_large",
    500: "internal_error",
    501: "not_implemented",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}
"""The code an error gets when its caller names none."""


def default_code(status: int) -> str:
    if status in CODES:
        return CODES[status]
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return "server_error" if status >= 500 else "client_error"


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    *,
    type_: str | None = None,
) -> bytes:
    """The JSON bytes of an error (also written by ``llamaswap_site.http_server``)."""
    error: dict[str, Any] = {
        "message": message,
        "type": type_ or error_type(status),
        "code": code or default_code(status),
    }
    if param is not None:
        error["param"] = param
    return json.dumps({"error": error}).encode()


def new_request_id() -> str:
    return uuid.uuid4().hex


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    request_id: str | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
    type_: str | None = None,
) -> HttpResponse:
    """``{"error": {"message", "type", "code"}}`` with the given status.

    ``code`` defaults to the status's name (:data:`CODES`); ``param`` names the request
    parameter at fault (OpenAI's field); ``type_`` overrides the status's type. Every
    error carries a request id: the caller's, or a new one.
    """
    response = HttpResponse(
        error_body(status, message, code, param, type_=type_),
        status=status,
        content_type="application/json",
    )
    response[REQUEST_ID_HEADER] = request_id or new_request_id()
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def echo(value: object, limit: int = ECHO_LIMIT) -> str:
    """``repr()`` of a client-sent value for an error message, cut to ``limit`` characters."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def bare(value: str, limit: int = ECHO_LIMIT) -> str:
    """A method or path as it is when it reads cleanly (printable, no spaces), else :func:`echo`."""
    if len(value) <= limit and value.isprintable() and " " not in value:
        return value
    return echo(value, limit)


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """Free text that may hold a client's value (an exception's message), cut to ``limit``."""
    return text if len(text) <= limit else text[:limit] + "…"


# -- access (web/access.py, proxy/handler.py) -----------------------------------------------------

AUTH_REALM = "llamaswap"


def invalid_api_key(presented: bool) -> HttpResponse:
    """401 for a request without a valid API key, as OpenAI answers it (``type``
    ``invalid_request_error``, ``code`` ``invalid_api_key``). The ``WWW-Authenticate: Basic``
    challenge llama-swap sends only with ``security.basicAuthChallenge``: a browser asks
    for a password then, caches it, and sends it with every later request to this server,
    another site's forms included. API clients never needed it; the dashboard logs in."""
    if presented:
        message = "invalid API key"
    else:
        message = (
            "an API key is required: send Authorization: Bearer KEY, x-api-key: KEY, "
            "or Basic auth with the key as password"
        )
    from scheduler import runtime

    challenge = runtime.is_running() and runtime.current().config.security.basic_auth_challenge
    return error_response(
        401,
        message,
        code="invalid_api_key",
        type_="invalid_request_error",
        headers={"WWW-Authenticate": f'Basic realm="{AUTH_REALM}"'} if challenge else None,
    )


def invalid_host(host: str, path: str) -> HttpResponse:
    """400 for a Host header outside ALLOWED_HOSTS (DNS rebinding): JSON on API paths, a
    bare HTML page elsewhere (no template: the request is refused before any handler)."""
    message = f"Host header {echo(host)} is not allowed here; add the name to ALLOWED_HOSTS"
    if wants_json(path):
        return error_response(400, message, code="invalid_host")
    from django.utils.html import escape

    html = (
        "<!doctype html><title>400 Bad Request</title><h1>400 Bad Request</h1>"
        f"<p>{escape(message)}</p>\n"
    )
    response = HttpResponse(html, status=400, content_type="text/html; charset=utf-8")
    response[REQUEST_ID_HEADER] = new_request_id()
    return response


def cross_origin_refused(reason: str) -> HttpResponse:
    """403 for a browser request from a site no policy allows (:func:`web.access.cross_site`)."""
    return error_response(
        403,
        f"cross-origin request refused: {reason}; a site of your own may be allowed in "
        "security.cors.allowedOrigins",
        code="cross_origin_refused",
    )


def login_required() -> HttpResponse:
    """403 for the dashboard's JSON API when it needs a Django login and has none."""
    return error_response(
        403, "this needs a login: sign in at /admin/login/", code="login_required"
    )


def error_page(request: HttpRequest, status: int, message: str) -> HttpResponse:
    """The HTML counterpart of :func:`error_response`, for pages."""
    from django.template.loader import render_to_string

    try:
        title = HTTPStatus(status).phrase
    except ValueError:
        title = "Error"
    html = render_to_string(
        "errors/error.html",
        {"status": status, "title": title, "message": message, "nav": ""},
        request=request,
    )
    return HttpResponse(html, status=status)


def error_for(
    request: HttpRequest,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> HttpResponse:
    """JSON on API and proxy paths, an HTML page elsewhere."""
    if wants_json(request.path):
        return error_response(status, message, code=code, headers=headers, param=param)
    response = error_page(request, status, message)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


# -- 405 -----------------------------------------------------------------------------------

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def method_not_allowed(
    request: HttpRequest, methods: tuple[str, ...], request_id: str | None = None
) -> HttpResponse:
    allow = ", ".join(methods)
    message = f"{bare(request.method or '', 40)} is not allowed on {bare(request.path)}; use {' or '.join(methods)}"
    if request_id is not None or wants_json(request.path):
        return error_response(
            405, message, code="method_not_allowed", request_id=request_id, headers={"Allow": allow}
        )
    response = error_page(request, 405, message)
    response["Allow"] = allow
    return response


def allow_methods(*methods: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Answer 405 (``Allow`` header, named code) to any other method; async views stay async.

    A view that allows only safe methods is CSRF-exempt: nothing it serves changes state,
    and a POST then gets this 405 rather than the CSRF middleware's 403 page.
    """
    allowed = frozenset(m.upper() for m in methods)
    names = tuple(m.upper() for m in methods)

    def decorate(view: Callable[..., Any]) -> Callable[..., Any]:
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
                if request.method not in allowed:
                    return method_not_allowed(request, names)
                response: HttpResponse = await view(request, *args, **kwargs)
                return response

        else:

            @functools.wraps(view)
            def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
                if request.method not in allowed:
                    return method_not_allowed(request, names)
                response: HttpResponse = view(request, *args, **kwargs)
                return response

        if allowed <= SAFE_METHODS:
            wrapper.csrf_exempt = True  # type: ignore[attr-defined]
        return wrapper

    return decorate


# -- the URLconf's error handlers ------------------------------------------------------------


def _client_error(exception: Exception | None) -> tuple[int, str, str]:
    """Status, code and message for what Django raised while reading a bad request."""
    from django.conf import settings
    from django.core.exceptions import (
        RequestDataTooBig,
        TooManyFieldsSent,
        TooManyFilesSent,
    )
    from django.http.multipartparser import MultiPartParserError

    if isinstance(exception, RequestDataTooBig):
        return (
            413,
            "request_too_large",
            f"request body is over {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes",
        )
    if isinstance(exception, TooManyFieldsSent):
        return (
            400,
            "too_many_fields",
            f"more than {settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} query or form fields",
        )
    if isinstance(exception, TooManyFilesSent):
        return 400, "too_many_files", f"more than {settings.DATA_UPLOAD_MAX_NUMBER_FILES} files"
    if isinstance(exception, MultiPartParserError):
        return 400, "invalid_multipart", f"multipart body could not be read: {clip(str(exception))}"
    detail = clip(str(exception)) if exception is not None and str(exception) else ""
    return 400, "invalid_request", f"bad request{': ' + detail if detail else ''}"


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    status, code, message = _client_error(exception)
    return error_for(request, status, message, code=code)


def permission_denied(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    detail = clip(str(exception)) if exception is not None and str(exception) else ""
    return error_for(request, 403, detail or "permission denied", code="forbidden")


def page_not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    from django.urls import Resolver404

    if isinstance(exception, Resolver404) or exception is None or not str(exception):
        message = f"no such endpoint: {bare(request.method or '', 40)} {bare(request.path)}"
    else:
        message = clip(str(exception))
    return error_for(request, 404, message, code="not_found")


def server_error(request: HttpRequest) -> HttpResponse:
    if wants_json(request.path):
        return error_response(500, "internal error: see the server log", code="internal_error")
    from django.template.loader import render_to_string

    # No request context and no base template: rendering must not fail on a bad day.
    return HttpResponse(render_to_string("errors/500.html"), status=500)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """``CSRF_FAILURE_VIEW``: JSON on API paths, Django's explanatory page on pages."""
    if wants_json(request.path):
        return error_response(403, f"CSRF verification failed: {reason}", code="csrf_failed")
    from django.views.csrf import csrf_failure as django_csrf_failure

    return django_csrf_failure(request, reason)
