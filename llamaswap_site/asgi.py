"""ASGI entry point served by daphne.

Two Django handlers share one URLconf. The proxy endpoints (inference, /health, /logs,
/metrics, ...: ``web.paths.PROXY_EXACT`` and ``PROXY_PREFIXES``) go to
:class:`ProxyHandler`: no middleware and none of the per-request
``request_started``/``request_finished`` receivers, which under ASGI each cost a thread
hop and an OS thread per waiting request (halving memory per waiting request, see
BENCHMARKS.md). Pages (admin, dashboard) go to :class:`PagesHandler`, Django's stock
handler with the full middleware stack.

Before either handler, the router checks access (:func:`access_refusal`): the Host header
against ``ALLOWED_HOSTS`` on every path, and the API key on API paths when keys are
configured. Pages need a Django login then (``dashboard.access.login_required``). An
``OPTIONS`` (a browser's preflight) is answered before any of it but the Host check, as
llama-swap answers it (``web.cors``).
"""

import asyncio
import contextlib
import gc
import io
import logging
import os
import types

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")

import django  # noqa: E402
from django.apps import apps  # noqa: E402

if not apps.ready:  # a second setup would redo the logging `serve` has configured
    django.setup()

from django.conf import settings  # noqa: E402
from django.core.exceptions import (  # noqa: E402
    RequestAborted,
    SuspiciousOperation,
    TooManyFieldsSent,
)
from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.core.handlers.exception import convert_exception_to_response  # noqa: E402
from django.http.request import split_domain_port, validate_host  # noqa: E402
from django.urls import set_script_prefix  # noqa: E402

from scheduler import runtime  # noqa: E402
from scheduler.keys import Scope, missing_scope_message, presented_key  # noqa: E402
from web.access import current_security  # noqa: E402
from web.cors import preflight_headers, response_origin, with_allowed_origin  # noqa: E402
from web.paths import PROXY_EXACT, PROXY_PREFIXES  # noqa: E402

log = logging.getLogger("llamaswap.proxy")


class _RefuseSuspicious:
    """``create_request`` that answers a 400 instead of raising: Django parses the query
    string while building an ASGIRequest (the ``encoding`` setter looks at ``GET`` when
    the Content-Type has a charset), so TooManyFieldsSent and friends escape the handler
    and daphne answers 500."""

    def create_request(self, scope, body_file):
        try:
            return super().create_request(scope, body_file)
        except SuspiciousOperation as exc:
            from web.errors import error_response

            code = "too_many_fields" if isinstance(exc, TooManyFieldsSent) else "invalid_request"
            return None, error_response(400, str(exc), code=code)


class PagesHandler(_RefuseSuspicious, ASGIHandler):
    """Django's stock ASGI handler (middleware, signals) for the dashboard and admin."""


class ProxyHandler(_RefuseSuspicious, ASGIHandler):
    """Django's ASGI handler minus middleware, signals and thread hops: async views only.

    It owns the whole life of a proxied request, so it is where a request's turn on the GPU
    (``proxy.turn.Turn``, set by the view as ``request.turn``) is closed: in a ``finally``
    after the response has been sent or abandoned, whatever happened (see proxy/turn.py).
    """

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)

    async def __call__(self, scope, receive, send):
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        try:
            body = await _read_body(scope, receive, _limits())
        except RequestAborted:
            return
        except _BodyRefused as refused:
            await self.send_response(refused.response, send)
            return
        set_script_prefix(self.get_script_prefix(scope))
        request, error_response = self.create_request(scope, io.BytesIO(body))
        if request is None:
            await self.send_response(error_response, send)
            _close(error_response)
            return
        # The body as one bytes object: Django's ``request.body`` would copy the stream
        # (and refuse more than DATA_UPLOAD_MAX_MEMORY_SIZE); the BytesIO above shares it.
        request._body = body
        del body
        request.scope = scope
        request.turn = None

        async def process_request():
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # client gone while sending
            return response

        # Cancel the view when the client disconnects (Django's own behaviour).
        listener = asyncio.create_task(self.listen_for_disconnect(receive))
        worker = asyncio.create_task(process_request())
        cancelled = False
        try:
            await asyncio.wait((listener, worker), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            cancelled = True  # the server gave up on the request: as good as a disconnect
            raise
        finally:
            # Also when this handler itself is cancelled (the server gave up on the
            # request): nothing below may be skipped.
            for task in (listener, worker):
                if not task.done():
                    task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait((listener, worker))
            disconnected = listener.done() and not listener.cancelled()
            if disconnected:
                listener.exception()  # retrieved (RequestAborted): no "never retrieved" log
            disconnected = disconnected or cancelled
            error = None
            if worker.cancelled():
                error = asyncio.CancelledError()
            elif worker.exception() is not None:
                error = worker.exception()
            # Read the outcomes without raising them here: a raised exception's traceback
            # holds this frame, which holds the tasks, which hold the exception: a
            # reference cycle per request (the listener ends in RequestAborted or
            # CancelledError every time), left to the cyclic GC, whose collections showed
            # as latency spikes.
            turn = request.turn
            if turn is not None:
                status = None
                if worker.done() and not worker.cancelled() and worker.exception() is None:
                    status = worker.result().status_code
                await turn.close(disconnected=disconnected, error=error, status=status)
            request.turn = None
        if error is not None and not isinstance(error, asyncio.CancelledError):
            raise error
        if not worker.cancelled() and worker.exception() is None:
            _close(worker.result())

    async def send_response(self, response, send):
        """Django's, except for a relayed stream (``response.relay_stream``, set by
        proxy/relay.py): its pieces go to the server as they come, without the three
        generator layers and the re-chunking Django puts around every piece."""
        stream = getattr(response, "relay_stream", None)
        if stream is None:
            await super().send_response(response, send)
            return
        headers = []
        for name, value in response.items():
            headers.append((name.encode("ascii"), value.encode("latin1")))
        for cookie in response.cookies.values():
            headers.append((b"Set-Cookie", cookie.output(header="").encode("ascii").strip()))
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        try:
            async for chunk in stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await stream.aclose()
        await send({"type": "http.response.body"})

    @staticmethod
    def get_script_prefix(scope):
        return scope.get("root_path", "") or "/"


class _BodyRefused(Exception):
    def __init__(self, response):
        self.response = response


def _limits():
    from scheduler import runtime
    from scheduler.config import RequestLimits

    return runtime.current().config.limits if runtime.is_running() else RequestLimits()


def _declared_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _read_body(scope, receive, limits) -> bytes:
    """The whole request body as one bytes object, within ``limits`` (see RequestLimits):
    at most ``max_body_bytes`` (else a 413 before reading it), ``body_timeout`` in all and
    ``body_idle_timeout`` between chunks (else a 408)."""
    from web.errors import error_response

    limit = limits.max_body_bytes
    declared = _declared_length(scope)
    if declared is not None and declared > limit:
        raise _BodyRefused(_too_large(error_response, declared, limit))
    chunks = []
    size = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.body_timeout if limits.body_timeout else None
    idle = limits.body_idle_timeout or None
    try:
        async with asyncio.timeout(None) as timer:
            while True:
                if idle is not None or deadline is not None:
                    at = loop.time() + idle if idle is not None else deadline
                    timer.reschedule(at if deadline is None else min(at, deadline))
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise RequestAborted()
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise _BodyRefused(_too_large(error_response, size, limit))
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        client = scope.get("client") or ("?", 0)
        log.warning(
            "request body too slow; connection cut",
            extra={"client": f"{client[0]}:{client[1]}", "path": scope.get("path", ""), "received": size},
        )
        raise _BodyRefused(
            error_response(408, "the request body did not arrive in time", code="request_timeout")
        ) from None
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


def _too_large(error_response, size, limit):
    return error_response(
        413,
        f"request body of {size} bytes is over the limit of {limit} bytes (limits.maxBodyBytes)",
        code="request_too_large",
    )


def _close(response) -> None:
    """HttpResponse.close() without the request_finished signal."""
    for closer in response._resource_closers:
        try:
            closer()
        except Exception:
            pass
    response._resource_closers.clear()
    response.closed = True




# -- access: Host header, API keys (before either handler) --------------------------------

EXEMPT = frozenset({"/health", "/wol-health", "/favicon.ico"})
"""Paths open even when API keys are required (health checks, browsers' icon requests)."""
KEY_EXACT = (PROXY_EXACT - EXEMPT) | {"/v1", "/api", "/upstream"}
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
    "/upstream": Scope.INFERENCE,
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
)


def required_scope(path: str) -> Scope:
    """The scope ``path`` needs (:data:`PATH_SCOPES`): dict lookups, no scan but the four
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


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def host_allowed(scope) -> tuple[bool, str]:
    """Is the Host header one of ``settings.ALLOWED_HOSTS`` (Django's own matching)?
    A request without one (HTTP/1.0) passes: no browser sends that. Returns the header."""
    allowed = settings.ALLOWED_HOSTS
    if "*" in allowed:
        return True, ""
    hosts = [value for key, value in scope.get("headers", ()) if key == b"host"]
    if not hosts:
        return True, ""
    host = b", ".join(hosts).decode("latin-1")  # more than one: never valid (as in Django)
    domain, _port = split_domain_port(host)
    return bool(domain) and validate_host(domain, allowed), host


def _keys():
    return runtime.current().keys if runtime.is_running() else None


async def staff_session(scope) -> bool:
    """Does the request carry the session cookie of an active staff member? Read here
    because the lean proxy handler has no session or auth middleware; the async session
    and auth APIs, so the event loop never waits on the database."""
    from importlib import import_module

    from django.contrib.auth import aget_user
    from django.http.cookie import parse_cookie

    raw = _header(scope, b"cookie")
    if not raw:
        return False
    session_key = parse_cookie(raw.decode("latin-1")).get(settings.SESSION_COOKIE_NAME)
    if not session_key:
        return False
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    holder = types.SimpleNamespace(session=store)
    try:
        user = await aget_user(holder)
    except Exception:  # a broken session row or an unreachable database: no session
        log.warning("session check failed", exc_info=True)
        return False
    return bool(user.is_active and user.is_staff)


async def access_refusal(scope):
    """The response that refuses this request before any handler, or None.

    1. The Host header must be allowed (DNS rebinding): 400 ``invalid_host``.
    2. With API keys required (:attr:`scheduler.keys.KeyRing.enabled`: a key in force, or
       the box stays keyed), the API paths (:func:`needs_key`) need a valid key (one
       hash, one dict lookup) granted the path's scope (:func:`required_scope`), or a
       staff member's session, which has every scope: else 401 ``invalid_api_key`` (no
       or an unknown key) or 403 ``insufficient_scope`` naming the scope the key lacks.
       The key found is put in ``scope["llamaswap.api_key"]`` (the relay applies its
       priority rule).
    """
    from web.errors import bare, error_response, invalid_api_key, invalid_host

    path = scope["path"]
    ok, host = host_allowed(scope)
    if not ok:
        return invalid_host(host, path)
    keys = _keys()
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


def cross_site_refusal(scope):
    """403 ``cross_origin_refused`` for a browser request from another site to an API path
    (:func:`needs_key`: inference, ``/upstream``, ``/api/...``, ``/logs...``, ``/metrics``,
    ...), keys or not, or None. Checked first (before the key: the same 403 whatever the
    credential, and no key hashed nor session read for it), so such a request never
    takes a turn; the rule is ``web.access.cross_site`` with the config's
    ``security.cors.allowedOrigins``. A request with neither ``Origin`` nor
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
    from web.access import cross_site, current_security
    from web.errors import cross_origin_refused

    reason = cross_site(origin, fetch_site, host, current_security())
    return None if reason is None else cross_origin_refused(reason)


def _refuse_websocket(app):
    """The websocket route behind the same Host check (closed before the handshake: 403)."""

    async def guarded(scope, receive, send):
        ok, _host = host_allowed(scope)
        if not ok:
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        await app(scope, receive, send)

    return guarded


async def _preflight(scope, send, proxy) -> None:
    """``OPTIONS`` on any path: ``204`` with llama-swap's CORS headers
    (:func:`web.cors.preflight_headers`), before any key; a Host not allowed is refused."""
    ok, host = host_allowed(scope)
    if not ok:
        from web.errors import invalid_host

        refusal = invalid_host(host, scope["path"])
        await proxy.send_response(refusal, send)
        _close(refusal)
        return
    security = current_security()
    headers = preflight_headers(
        _header(scope, b"origin"),
        _header(scope, b"access-control-request-headers"),
        security,
        private_network=_header(scope, b"access-control-request-private-network") == b"true",
    )
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body"})


def _allowing(send, origin: bytes):
    """``send`` with ``Access-Control-Allow-Origin: origin`` on the response's headers."""

    async def sending(message):
        if message["type"] == "http.response.start":
            headers = with_allowed_origin(message.get("headers", []), origin)
            message = {**message, "headers": headers}
        await send(message)

    return sending


def _build():
    from channels.routing import ProtocolTypeRouter

    pages = PagesHandler()
    proxy = ProxyHandler()

    async def http(scope, receive, send):
        if scope["method"] == "OPTIONS":  # a browser's preflight, as llama-swap answers it
            await _preflight(scope, send, proxy)
            return
        # An allowed origin may read the answer (web.cors; no cost unless one is configured).
        origin = response_origin(scope, current_security())
        if origin is not None and needs_key(scope["path"]):
            send = _allowing(send, origin)
        refusal = cross_site_refusal(scope) or await access_refusal(scope)
        if refusal is not None:
            await proxy.send_response(refusal, send)
            _close(refusal)
            return
        path = scope["path"]
        if path in PROXY_EXACT or path.startswith(PROXY_PREFIXES):
            await proxy(scope, receive, send)
        else:
            await pages(scope, receive, send)

    routes = {"http": http}
    try:
        from dashboard.routing import websocket_application
    except ImportError:
        pass
    else:
        routes["websocket"] = _refuse_websocket(websocket_application)
    return ProtocolTypeRouter(routes)


application = _build()

# Everything loaded so far (Django, the URLconf, the apps) lives as long as the process:
# move it out of the cyclic GC's reach. Without this, every full collection walks the
# whole heap: 55-75 ms with the event loop stopped, every second or two under load.
gc.freeze()
