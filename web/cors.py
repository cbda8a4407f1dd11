"""CORS as llama-swap answers it, within ``security.cors.allowedOrigins``.

llama-swap answers every ``OPTIONS`` (a browser's preflight) with ``204`` and permissive
headers, and echoes the ``Origin`` on ``/v1/models``. Here:

* **Preflight** (:func:`preflight_headers`): every ``OPTIONS`` gets llama-swap's ``204``
  with its ``Access-Control-Allow-Methods``, ``-Allow-Headers`` (the requested ones that
  are HTTP tokens, else its default list) and ``-Max-Age``, before any key is asked for
  (a browser never sends credentials on a preflight). ``Access-Control-Allow-Origin`` is
  given only where the request that follows would be accepted: ``*`` with
  ``allowedOrigins: ["*"]`` or without an ``Origin`` (not a browser), the origin itself
  when listed; an origin the config does not allow gets none, so the browser stops
  before sending anything (the request itself would get ``403 cross_origin_refused``:
  ``web.access.cross_site``).
  Better than llama-swap, for an allowed origin only: Chrome's Private Network Access
  preflight (a public page reaching a loopback or LAN address asks
  ``Access-Control-Request-Private-Network``) is answered
  ``Access-Control-Allow-Private-Network: true``.
* **``security.cors``'s other keys** (:class:`scheduler.config.Security`):
  ``allowedMethods``, ``allowedHeaders`` and ``maxAge`` replace the preflight's methods,
  headers (``["*"]`` says ``*``) and max age; ``exposedHeaders`` are added to the
  responses' ``Access-Control-Expose-Headers``; ``allowCredentials`` adds
  ``Access-Control-Allow-Credentials: true`` for an allowed origin (preflight and
  responses), whose preflight then names the origin (never ``*``, which browsers refuse
  with credentials).
* **Responses** (:func:`response_origin`): a request from an allowed origin (listed, or
  any with ``"*"``) gets ``Access-Control-Allow-Origin: <origin>``, ``Vary: Origin`` and
  ``Access-Control-Expose-Headers`` (the request id, ``Retry-After``) on every API path,
  in place of whatever the model server sent, so a browser client can read the answer
  whether or not the model server speaks CORS.

Pure: strings in, header lists out (:func:`with_allowed_origin` reads the running
server's ``security`` when not given it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from scheduler.config import Security
from web.access import current_security, origin_key

ALLOW_METHODS = b"GET, POST, PUT, PATCH, DELETE, OPTIONS"
DEFAULT_ALLOW_HEADERS = b"Content-Type, Authorization, Accept, X-Requested-With"
MAX_AGE = b"86400"
EXPOSE_HEADERS = b"X-LlamaSwap-Request-Id, Retry-After"
"""What a browser client may read beyond the safelisted headers: the request id (to look
a request up) and ``Retry-After`` (a 429's or 503's)."""
_REPLACED = (
    b"access-control-allow-origin",
    b"access-control-expose-headers",
    b"access-control-allow-credentials",
)
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _allowed(origin: bytes, security: Security) -> bool:
    if security.any_origin:
        return True
    if not security.allowed_origins:
        return False
    return origin_key(origin.decode("latin-1")) in security.allowed_origins


def _sanitized(requested: bytes) -> bytes:
    """The requested header names that are HTTP tokens (llama-swap drops the others)."""
    names = (part.strip() for part in requested.split(b","))
    return b", ".join(n for n in names if n and all(c in _TOKEN for c in n))


def preflight_headers(
    origin: bytes | None,
    requested_headers: bytes | None,
    security: Security,
    private_network: bool = False,
) -> list[tuple[bytes, bytes]]:
    """The headers of the ``204`` answering an ``OPTIONS`` (``private_network``: it asked
    ``Access-Control-Request-Private-Network``)."""
    headers: list[tuple[bytes, bytes]] = []
    allowed = origin is not None and _allowed(origin, security)
    if origin is None or security.any_origin and not security.allow_credentials:
        headers.append((b"access-control-allow-origin", b"*"))
    elif allowed:
        assert origin is not None
        headers += [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        if security.allow_credentials:
            headers.append((b"access-control-allow-credentials", b"true"))
    if private_network and allowed:
        headers.append((b"access-control-allow-private-network", b"true"))
    if security.allowed_headers:
        allow = ", ".join(security.allowed_headers).encode("latin-1")
    else:
        allow = _sanitized(requested_headers) if requested_headers else b""
    methods = ", ".join(security.allowed_methods).encode("latin-1") or ALLOW_METHODS
    max_age = MAX_AGE if security.max_age is None else str(security.max_age).encode()
    headers += [
        (b"access-control-allow-methods", methods),
        (b"access-control-allow-headers", allow or DEFAULT_ALLOW_HEADERS),
        (b"access-control-max-age", max_age),
    ]
    return headers


def response_origin(scope: Mapping[str, Any], security: Security) -> bytes | None:
    """The ``Origin`` to allow on this request's response, or None (no Origin, or one the
    config does not list). Costs nothing unless the config allows some origin."""
    if not (security.any_origin or security.allowed_origins):
        return None
    for name, value in scope.get("headers", ()):
        if name == b"origin":
            return value if _allowed(value, security) else None
    return None


def with_allowed_origin(
    headers: Iterable[tuple[bytes, bytes]], origin: bytes, security: Security | None = None
) -> list[tuple[bytes, bytes]]:
    """A response's headers with ``Access-Control-Allow-Origin: origin`` (replacing the
    model server's own: two would make the browser refuse the answer), ``Vary``, the
    exposed headers (ours and ``security.cors.exposedHeaders``) and, with
    ``allowCredentials``, ``Access-Control-Allow-Credentials``. ``security``: the running
    server's when not given."""
    if security is None:
        security = current_security()
    kept = [(n, v) for n, v in headers if n.lower() not in _REPLACED]
    expose = EXPOSE_HEADERS
    if security.exposed_headers:
        expose += b", " + ", ".join(security.exposed_headers).encode("latin-1")
    added = [
        (b"access-control-allow-origin", origin),
        (b"access-control-expose-headers", expose),
        (b"vary", b"Origin"),
    ]
    if security.allow_credentials:
        added.append((b"access-control-allow-credentials", b"true"))
    return [*kept, *added]
