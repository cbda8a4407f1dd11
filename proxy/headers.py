"""The headers a request and its answer keep on their way through the proxy.

What goes to a model (or a peer) and what comes back to the client: no hop-by-hop header,
never this server's own credentials (its API key when it checks keys, the dashboard's
cookies). Used by ``proxy.upstream``, ``proxy.relay``, ``proxy.peers`` and
``proxy.wsproxy`` (``proxy.upstream`` re-exports them).
"""

from __future__ import annotations

import functools

import httpx

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)

CREDENTIALS = frozenset({"authorization", "x-api-key"})
"""The headers a client presents its API key in (``scheduler.keys.presented_key``)."""
_DROPPED = frozenset(name.encode("latin-1") for name in HOP_BY_HOP)
_DROPPED_WITH_CREDENTIALS = _DROPPED | frozenset(name.encode("latin-1") for name in CREDENTIALS)
"""The same names as bytes: a request's header names are compared without decoding them."""


@functools.cache
def proxy_cookies() -> frozenset[bytes]:
    """The dashboard's cookies (Django's session and CSRF cookies): this server's
    credentials, which a browser sends with every request to its origin, ``/upstream``
    included. No model or peer ever gets them."""
    from django.conf import settings

    return frozenset(
        name.encode("latin-1") for name in (settings.SESSION_COOKIE_NAME, settings.CSRF_COOKIE_NAME)
    )


def forward_headers(
    headers: list[tuple[bytes, bytes]], *, credentials: bool = True
) -> list[tuple[bytes, bytes]]:
    """Request headers for the upstream: everything but hop-by-hop ones, Host and this
    server's cookies (:func:`proxy_cookies`; other cookies pass). Without ``credentials``,
    also without ``Authorization`` and ``x-api-key``: the key this server checked is its
    own, not the model's."""
    drop = _DROPPED if credentials else _DROPPED_WITH_CREDENTIALS
    forwarded = []
    for name, value in headers:
        lowered = name.lower()
        if lowered in drop:
            continue
        if lowered == b"cookie":
            value = _without_proxy_cookies(value)
            if not value:
                continue
        forwarded.append((name, value))
    return forwarded


def _without_proxy_cookies(value: bytes) -> bytes:
    """A ``Cookie`` header's value without :func:`proxy_cookies` (``a=1; sessionid=x; b=2``
    -> ``a=1; b=2``)."""
    names = proxy_cookies()
    pieces = value.split(b";")
    kept = [piece for piece in pieces if piece.split(b"=", 1)[0].strip() not in names]
    if len(kept) == len(pieces):
        return value
    return b";".join(kept).strip()


def response_headers(headers: httpx.Headers) -> list[tuple[str, str]]:
    """Upstream response headers for the client: everything but hop-by-hop ones."""
    return [(k, v) for k, v in headers.multi_items() if k.lower() not in HOP_BY_HOP]
