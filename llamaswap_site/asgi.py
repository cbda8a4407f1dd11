"""ASGI entry point served by daphne.

Two Django handlers share one URLconf. The proxy endpoints (inference, /health, /logs,
...) go to :class:`ProxyHandler`: no middleware and none of the per-request
``request_started``/``request_finished`` receivers, which under ASGI each cost a thread
hop and an OS thread per waiting request (../shared/notes/asgi-performance.md). Pages
(admin, dashboard, /metrics) go to Django's stock handler with the full middleware stack.
"""

import asyncio
import gc
import os
import sys

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")

import django  # noqa: E402

django.setup()

from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.core.handlers.exception import convert_exception_to_response  # noqa: E402
from django.urls import set_script_prefix  # noqa: E402

from proxy.urls import PROXY_EXACT, PROXY_PREFIXES  # noqa: E402


class ProxyHandler(ASGIHandler):
    """Django's ASGI handler minus middleware, signals and thread hops: async views only."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)

    async def __call__(self, scope, receive, send):
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(self.get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            _close(error_response)
            return
        request.scope = scope

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
        await asyncio.wait((listener, worker), return_when=asyncio.FIRST_COMPLETED)
        pending = [task for task in (listener, worker) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        # Read the outcomes without raising them here: a raised exception's traceback holds
        # this frame, which holds the tasks, which hold the exception: a reference cycle
        # per request (the listener ends in RequestAborted or CancelledError every time),
        # left to the cyclic GC, whose collections showed as latency spikes.
        body_file.close()
        for task in (listener, worker):
            if task.cancelled():
                continue
            error = task.exception()
            if error is not None and not isinstance(error, RequestAborted):
                raise error
        if not worker.cancelled() and worker.exception() is None:
            _close(worker.result())

    @staticmethod
    def get_script_prefix(scope):
        return scope.get("root_path", "") or "/"


def _close(response) -> None:
    """HttpResponse.close() without the request_finished signal."""
    for closer in response._resource_closers:
        try:
            closer()
        except Exception:
            pass
    response._resource_closers.clear()
    response.closed = True


def _skip_twisted_form_parsing() -> None:
    """Under daphne, stop Twisted from parsing POST bodies as forms.

    Daphne hands the raw body to the application and never reads Twisted's ``args``, yet
    Twisted parses the Content-Type of every POST with :mod:`email` (which creates a new
    class per call: CPU and cyclic garbage per request) and a whole multipart body into
    ``args`` (an upload parsed twice). ``_parsePOSTFormSubmission`` is set per request in
    ``Request.__init__``; a read-only property on daphne's request class pins it to False.
    Only when daphne is already loaded: importing it here would install a reactor.
    """
    http_protocol = sys.modules.get("daphne.http_protocol")
    if http_protocol is not None:
        http_protocol.WebRequest._parsePOSTFormSubmission = property(
            lambda self: False, lambda self, value: None
        )


_skip_twisted_form_parsing()


def _build():
    from channels.routing import ProtocolTypeRouter
    from django.core.asgi import get_asgi_application

    pages = get_asgi_application()
    proxy = ProxyHandler()

    async def http(scope, receive, send):
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
        routes["websocket"] = websocket_application
    return ProtocolTypeRouter(routes)


application = _build()

# Everything loaded so far (Django, the URLconf, the apps) lives as long as the process:
# move it out of the cyclic GC's reach. Without this, every full collection walks the
# whole heap: 55-75 ms with the event loop stopped, every second or two under load.
gc.freeze()
