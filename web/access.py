"""Who may reach the API from a browser: the cross-site rule (``security.cors``), applied
by the router to every API path (``llamaswap_site.asgi.cross_site_refusal``) and by the
views that change state (``proxy.views.unload``, ``dashboard.profiles``)."""

from __future__ import annotations

from django.http import HttpRequest

from scheduler import runtime
from scheduler.config import Security
from web.errors import echo


def _netloc_with_port(netloc: str, scheme: str) -> str:
    netloc = netloc.strip().lower()
    if ":" not in netloc or netloc.endswith("]"):  # no port: the scheme's default
        netloc += ":443" if scheme == "https" else ":80"
    return netloc


def cross_origin(request: HttpRequest) -> str | None:
    """Why a browser request comes from a site the config does not allow, or None
    (:func:`cross_site` on the request's headers; the router applies the same rule to every
    API path before any handler: ``llamaswap_site.asgi.cross_site_refusal``)."""
    return cross_site(
        request.headers.get("Origin"),
        request.headers.get("Sec-Fetch-Site"),
        request.headers.get("Host", ""),
        current_security(),
    )


def current_security() -> Security:
    """The running server's ``security`` settings (defaults when none runs)."""
    return runtime.current().config.security if runtime.is_running() else Security()


def cross_site(
    origin: str | None, fetch_site: str | None, host: str, security: Security
) -> str | None:
    """Why a browser request comes from a site ``security`` does not allow, or None.

    The browser's own word first: ``Sec-Fetch-Site`` (every current browser sends it, also
    on an ``<img src>`` GET or a form, which may send no Origin) ``same-origin`` or
    ``none`` (typed, a bookmark) passes, also behind a proxy that rewrites Host. An
    ``Origin`` in ``security.cors.allowedOrigins`` passes (``"*"`` there: everything).
    Otherwise ``cross-site`` / ``same-site`` is refused; without Sec-Fetch-Site (an older
    browser), an Origin whose host:port is not the request's Host is (``null`` included: a
    sandboxed or file page). Requests with neither header (curl, SDKs, scripts) are not a
    browser's and pass. Pure: no I/O, only the strings given.
    """
    if security.any_origin:
        return None
    site = (fetch_site or "").strip().lower()
    if site in ("same-origin", "none"):
        return None
    if origin is not None and origin_key(origin) in security.allowed_origins:
        return None
    if site in ("cross-site", "same-site"):
        if origin is None:
            return f"Sec-Fetch-Site is {site}"
        return f"Sec-Fetch-Site is {site} and Origin {echo(origin)} is not allowed"
    if origin is None:
        return None
    scheme, sep, netloc = origin.strip().partition("://")
    if not sep or not netloc or scheme.lower() not in ("http", "https"):
        return f"Origin {echo(origin)} is not this server"
    scheme = scheme.lower()
    if _netloc_with_port(netloc.rstrip("/"), scheme) != _netloc_with_port(host, scheme):
        return f"Origin {echo(origin)} is not this server ({echo(host)})"
    return None


def origin_key(origin: str) -> str | None:
    """An Origin header as ``security.cors.allowedOrigins`` holds origins: lowercased,
    without the scheme's default port."""
    scheme, sep, netloc = origin.strip().lower().partition("://")
    if not sep or not netloc or scheme not in ("http", "https"):
        return None
    default = ":443" if scheme == "https" else ":80"
    if netloc.endswith(default):
        netloc = netloc[: -len(default)]
    return f"{scheme}://{netloc}"
