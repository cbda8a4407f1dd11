"""ASGI entry point served by daphne: the wiring, nothing else.

Two Django handlers share one URLconf. The proxy endpoints (inference, /health, /logs,
/metrics, ...: ``web.paths.PROXY_EXACT`` and ``PROXY_PREFIXES``) go to
``proxy.handler.ProxyHandler``, which owns a proxied request's whole life (the body, the
view, the stream, closing its turn) with no middleware and no per-request signals. Pages
(admin, dashboard) go to :class:`PagesHandler`, Django's stock handler with the full
middleware stack.

Before either handler, the proxy handler answers a browser's preflight and applies the
access rules of ``web.access`` (:meth:`ProxyHandler.admit`): the cross-site rule, the Host
header against ``ALLOWED_HOSTS`` on every path, and the API key on API paths when keys are
configured. Pages need a Django login then (``dashboard.access.login_required``).

:func:`build_application` is the composition: it hands the running
:class:`scheduler.runtime.Runtime` to the proxy handler and, in every connection's ASGI
scope (HTTP and websocket), to the views and consumers (``web.runtime.runtime_of``).
``application`` is built on first use for the runtime installed then (``serve`` installs
it before importing this).
"""

import gc
import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")

import django  # noqa: E402
from django.apps import apps  # noqa: E402

if not apps.ready:  # a second setup would redo the logging `serve` has configured
    django.setup()

from proxy.handler import ProxyHandler, RefuseSuspicious  # noqa: E402
from scheduler import runtime  # noqa: E402
from scheduler.runtime import Runtime  # noqa: E402
from web.access import host_allowed  # noqa: E402
from web.paths import PROXY_EXACT, PROXY_PREFIXES  # noqa: E402
from web.runtime import carrying  # noqa: E402


class PagesHandler(RefuseSuspicious):
    """Django's stock ASGI handler (middleware, signals) for the dashboard and admin."""


def _refuse_websocket(app, proxy: ProxyHandler, serving: dict[str, Any]):
    """The websocket routes behind the same Host check (closed before the handshake: 403).
    ``/upstream/{model}/...`` goes to the model (``proxy.wsproxy``) behind the same
    cross-site and API-key checks as its HTTP requests; anything else to ``app``. Each
    connection's scope carries ``serving`` (the runtime, ``web.runtime``)."""
    from proxy import wsproxy

    async def guarded(scope, receive, send):
        scope.update(serving)
        ok, _host = host_allowed(scope)
        refused = not ok
        if ok and wsproxy.wanted(scope):
            refused = (await proxy.refusal(scope)) is not None
            if not refused:
                await wsproxy.app(scope, receive, send)
                return
        if refused:
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        await app(scope, receive, send)

    return guarded


def build_application(rt: Runtime | None) -> Any:
    """The ASGI application serving ``rt`` (None: no server runs; the defaults)."""
    from channels.routing import ProtocolTypeRouter

    pages = PagesHandler()
    proxy = ProxyHandler(rt)
    serving = carrying(rt)  # what every connection's scope carries: the views' runtime

    async def http(scope, receive, send):
        scope.update(serving)
        if scope["method"] == "OPTIONS":  # a browser's preflight, as llama-swap answers it
            await proxy.preflight(scope, send)
            return
        send = await proxy.admit(scope, send)
        if send is None:
            return  # refused (cross-site, Host, key): answered
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
        routes["websocket"] = _refuse_websocket(websocket_application, proxy, serving)
    return ProtocolTypeRouter(routes)


_built: tuple[Runtime | None, Any] | None = None


def __getattr__(name: str) -> Any:
    """``application``: built for the runtime installed now, once per runtime."""
    global _built
    if name != "application":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    rt = runtime.current() if runtime.is_running() else None
    if _built is None or _built[0] is not rt:
        _built = (rt, build_application(rt))
        gc.freeze()  # the handlers' middleware and URLconf live as long as the process
    return _built[1]


# Everything loaded so far (Django, the URLconf, the apps) lives as long as the process:
# move it out of the cyclic GC's reach. Without this, every full collection walks the
# whole heap: 55-75 ms with the event loop stopped, every second or two under load.
gc.freeze()
