"""One way to say what went wrong: OpenAI-shaped JSON errors."""

from __future__ import annotations

import json

from django.http import HttpResponse

REQUEST_ID_HEADER = "X-LlamaSwap-Request-Id"

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def error_response(
    status: int,
    message: str,
    *,
    code: str | None = None,
    request_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> HttpResponse:
    """``{"error": {"message", "type", "code"}}`` with the given status."""
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "code": code or str(status),
        }
    }
    response = HttpResponse(json.dumps(body), status=status, content_type="application/json")
    if request_id:
        response[REQUEST_ID_HEADER] = request_id
    for name, value in (headers or {}).items():
        response[name] = value
    return response
