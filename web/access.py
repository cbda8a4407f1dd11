"""Who may reach what, checked before any handler (``proxy.handler``) and by the views that
change state:

* the Host header against ``ALLOWED_HOSTS`` (:func:`host_allowed`, DNS rebinding);
* the cross-site rule (``security.cors``): :func:`cross_site`, applied to every API path by
  :func:`cross_site_refusal` and by ``proxy.views.unload`` and ``dashboard.profiles``;
* the API keys: which paths need one (:func:`needs_key`) and which scope
  (:data:`PATH_SCOPES`, :func:`required_scope`), checked by :func:`access_refusal`, where a
  staff member's session (:func:`staff_session`) stands in for a key.

The proxy and the dashboard both read these; neither owns them."""

from __future__ import annotations

import logging
import types
from collections.abc import MutableMapping
from typing import Any, cast

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.http.request import split_domain_port, validate_host

from scheduler import runtime
from scheduler.config import Security
from scheduler.keys import KeyRing, Scope, missing_scope_message, presented_key
from web.errors import (
    bare,
    cross_origin_refused,
    echo,
    error_response,
    invalid_api_key,
    invalid_host,
)
from web.paths import PROXY_EXACT, PROXY_PREFIXES

log = logging.getLogger("llamaswap.proxy")

AsgiScope = MutableMapping[str, Any]
DEFAULT_SECURITY = Security()
"""``security`` when no server runs (tests of the bare rules): no origin allowed."""


def _netloc_with_port(netloc: str, scheme: str) -> str:
    netloc = netloc.strip().lower()
    if ":" not in netloc or netloc.endswith("]"):  # no port: the scheme's default
        netloc += ":443" if scheme == "https" else ":80"
    return netloc


def cross_origin(request: HttpRequest) -> str | None:
    """Why a browser request comes from a site the config does not allow, or None
    (:func:`cross_site` on the request's headers; the router applies the same rule to every
    API path before any handler: :func:`cross_site_refusal`)."""
    return cross_site(
        request.headers.get("Origin"),
        request.headers.get("Sec-Fetch-Site"),
        request.headers.get("Host", ""),
        current_security(),
    )


def current_security() -> Security:
    """The running server's ``security`` settings (defaults when none runs)."""
    return runtime.current().config.security if runtime.is_running() else DEFAULT_SECURITY


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


# -- before any handler: the Host header, the cross-site rule, API keys -------------------

EXEMPT = frozenset({"/health", "/wol-health", "/favicon.ico", "/upstream"})
"""Paths open even when API keys are required (health checks, browsers' icon requests,
``GET /upstream``: only a redirect to the models page, open in llama-swap too)."""
KEY_EXACT = (PROXY_EXACT - EXEMPT) | {"/v1", "/api"}
KEY_PREFIXES = (*PROXY_PREFIXES, "/v1/", "/api/", "/upstream/", "/logs/")
"""With keys configured, these need one: the proxy's endpoints and the JSON API
(``/api/metrics/activity``, ``/api/requests/...``), and anything else under the API
prefixes (an unknown path's 404 included). Pages (dashboard, admin) need a Django login
instead; ``/static/`` is open."""
API_KEY_SCOPE = "llamaswap.api_key"
"""Where a request's :class:`scheduler.keys.ApiKey` is put in the ASGI scope."""

PATH_SCOPES: dict[str, Scope] = {
    **{path: Scope.INFERENCE for path in PROXY_EXACT},
    "/v1": Scope.INFERENCE,
    "/api": Scope.INFERENCE,
    "/api/profiles": Scope.INFERENCE,  # reading which pins apply, as /v1/models shows them
    "/unload": Scope.MODELS,
    "/api/models/unload": Scope.MODELS,
    "/api/profiles/active": Scope.PROFILES,  # PUT: switches it for everyone
    "/api/queue": Scope.OPERATOR,
    "/logs": Scope.OPERATOR,
    "/logs/stream": Scope.OPERATOR,
    "/api/metrics/activity": Scope.OPERATOR,
    "/api/metrics/stats": Scope.OPERATOR,
    "/api/events": Scope.OPERATOR,  # every request's model, path and the models' logs
    "/api/version": Scope.INFERENCE,
    "/metrics": Scope.METRICS,
}
"""The one table of what each key-needing path needs (every method of a path does one
thing: ``GET /api/profiles`` reads, ``PUT /api/profiles/active`` switches). Paths are
matched exactly, then without trailing slashes, then by :data:`PREFIX_SCOPES`; anything
else under the key prefixes (a 404) needs ``inference``, what every default key has.
``/health``, ``/favicon.ico`` and static files need nothing (:data:`EXEMPT`)."""
PREFIX_SCOPES: tuple[tuple[str, Scope], ...] = (
    ("/api/models/unload", Scope.MODELS),
    ("/api/models/load/", Scope.MODELS),  # dashboard/model_control.py
    ("/api/requests/", Scope.OPERATOR),  # a request's prompt, key name and decision
    ("/api/inflight/", Scope.OPERATOR),  # cancels anyone's request (web/cancel.py)
    ("/api/captures/", Scope.OPERATOR),  # a request's prompt and answer
    ("/logs/", Scope.OPERATOR),
    ("/upstream/", Scope.INFERENCE),
    ("/comfyui/", Scope.INFERENCE),  # llama-swap's passthrough to comfyui_auto
)


def required_scope(path: str) -> Scope:
    """The scope ``path`` needs (:data:`PATH_SCOPES`): dict lookups, no scan but the
    prefixes."""
    scope = PATH_SCOPES.get(path) or PATH_SCOPES.get(path.rstrip("/") or "/")
    if scope is not None:
        return scope
    for prefix, scope in PREFIX_SCOPES:
        if path.startswith(prefix):
            return scope
    return Scope.INFERENCE


def needs_key(path: str) -> bool:
    return path in KEY_EXACT or path.startswith(KEY_PREFIXES) or path.rstrip("/") in KEY_EXACT


def header(scope: AsgiScope, name: bytes) -> bytes | None:
    """The first value of the header ``name`` (lowercase) in an ASGI scope."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return cast(bytes, value)
    return None


HOST_VERDICTS_SIZE = 256
_host_verdicts: dict[tuple[str, tuple[str, ...]], bool] = {}
"""(Host header, ``ALLOWED_HOSTS``) -> allowed: Django's matching (a regex, a scan of the
patterns: ~6 µs) once per name; emptied when full, so clients cannot grow it."""


def host_allowed(scope: AsgiScope) -> tuple[bool, str]:
    """Is the Host header one of ``settings.ALLOWED_HOSTS`` (Django's own matching)?
    A request without one (HTTP/1.0) passes: no browser sends that. Returns the header."""
    allowed = settings.ALLOWED_HOSTS
    if "*" in allowed:
        return True, ""
    hosts = [value for key, value in scope.get("headers", ()) if key == b"host"]
    if not hosts:
        return True, ""
    host = b", ".join(hosts).decode("latin-1")  # more than one: never valid (as in Django)
    key = (host, tuple(allowed))
    ok = _host_verdicts.get(key)
    if ok is None:
        domain, _port = split_domain_port(host)
        ok = bool(domain) and validate_host(domain, allowed)
        if len(_host_verdicts) >= HOST_VERDICTS_SIZE:
            _host_verdicts.clear()
        _host_verdicts[key] = ok
    return ok, host


async def staff_session(scope: AsgiScope) -> bool:
    """Does the request carry the session cookie of an active staff member? Read here
    because the lean proxy handler has no session or auth middleware; the async session
    and auth APIs, so the event loop never waits on the database."""
    from importlib import import_module

    from django.contrib.auth import aget_user
    from django.http.cookie import parse_cookie

    raw = header(scope, b"cookie")
    if not raw:
        return False
    session_key = parse_cookie(raw.decode("latin-1")).get(settings.SESSION_COOKIE_NAME)
    if not session_key:
        return False
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    holder = types.SimpleNamespace(session=store)
    try:
        user = await aget_user(holder)  # type: ignore[arg-type]  # only .session is read
    except Exception:  # a broken session row or an unreachable database: no session
        log.warning("session check failed", exc_info=True)
        return False
    return bool(user.is_active and getattr(user, "is_staff", False))


async def access_refusal(scope: AsgiScope, keys: KeyRing | None) -> HttpResponse | None:
    """The response that refuses this request before any handler, or None.

    1. The Host header must be allowed (DNS rebinding): 400 ``invalid_host``.
    2. With API keys required (``keys`` given and :attr:`scheduler.keys.KeyRing.enabled`:
       a key in force, or the box stays keyed), the API paths (:func:`needs_key`) need a
       valid key (one hash, one dict lookup) granted the path's scope
       (:func:`required_scope`), or a staff member's session, which has every scope: else
       401 ``invalid_api_key`` (no or an unknown key) or 403 ``insufficient_scope`` naming
       the scope the key lacks. The key found is put in ``scope["llamaswap.api_key"]``
       (the relay applies its priority rule).
    """
    path = scope["path"]
    ok, host = host_allowed(scope)
    if not ok:
        return invalid_host(host, path)
    if keys is None or not keys.enabled or not needs_key(path):
        return None
    presented = presented_key(scope.get("headers", ()))
    api_key = keys.lookup(presented)
    needed = required_scope(path)
    if api_key is not None and api_key.allows(needed):
        scope[API_KEY_SCOPE] = api_key
        return None
    # Asked only once a key fails: a key holder's request never costs a session query.
    if await staff_session(scope):
        return None
    if api_key is not None:
        log.info(
            "API key refused: scope missing",
            extra={"api_key": api_key.name, "scope": needed.value, "path": bare(path)},
        )
        return error_response(
            403, missing_scope_message(needed, bare(path), api_key.name), code="insufficient_scope"
        )
    return invalid_api_key(presented is not None)


def cross_site_refusal(
    scope: AsgiScope, security: Security = DEFAULT_SECURITY
) -> HttpResponse | None:
    """403 ``cross_origin_refused`` for a browser request from another site to an API path
    (:func:`needs_key`: inference, ``/upstream``, ``/api/...``, ``/logs...``, ``/metrics``,
    ...), keys or not, or None. Checked first (before the key: the same 403 whatever the
    credential, and no key hashed nor session read for it), so such a request never
    takes a turn; the rule is :func:`cross_site` with ``security`` (the config's
    ``security.cors.allowedOrigins``). A request with neither ``Origin`` nor
    ``Sec-Fetch-Site`` (curl, SDKs) costs one pass over its headers."""
    origin = fetch_site = None
    host = ""
    for name, value in scope.get("headers", ()):
        if name == b"origin":
            origin = value.decode("latin-1")
        elif name == b"sec-fetch-site":
            fetch_site = value.decode("latin-1")
        elif name == b"host":
            host = value.decode("latin-1")
    if origin is None and fetch_site is None or not needs_key(scope["path"]):
        return None
    reason = cross_site(origin, fetch_site, host, security)
    return None if reason is None else cross_origin_refused(reason)
