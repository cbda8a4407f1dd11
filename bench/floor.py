"""The floor of this stack: the smallest Django relay, served by daphne.

``python -m bench.floor --port N --upstream http://127.0.0.1:M``: one plain async Django
view that relays every request to the upstream with one ``httpx.AsyncClient``
(``send(stream=True)``; JSON answers read whole, SSE relayed as ``aiter_raw()`` pieces
through a ``StreamingHttpResponse``), under Django's stock ASGI handler
(``get_asgi_application()``: request signals included, no middleware, no database),
served by daphne with its defaults. What any Django + httpx proxy pays before it does
anything of its own; ``bench/bench_proxy.py`` runs it beside the product in the same run
(../shared/notes/asgi-performance.md measured the same setup).
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx
from django.conf import settings
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.urls import re_path

UPSTREAM = os.environ.get("BENCH_FLOOR_UPSTREAM", "http://127.0.0.1:9")
SKIP = frozenset({"host", "content-length", "connection", "transfer-encoding", "keep-alive"})

_client: httpx.AsyncClient | None = None


def client() -> httpx.AsyncClient:
    global _client
    if _client is None:
        _client = httpx.AsyncClient(base_url=UPSTREAM, timeout=None, trust_env=False)
    return _client


async def relay(request: HttpRequest) -> HttpResponse:
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in SKIP]
    upstream = await client().send(
        client().build_request(
            request.method or "POST", request.get_full_path(), headers=headers, content=request.body
        ),
        stream=True,
    )
    content_type = upstream.headers.get("content-type", "application/json")
    if content_type.startswith("text/event-stream"):

        async def relayed():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingHttpResponse(
            relayed(), status=upstream.status_code, content_type=content_type
        )
    body = await upstream.aread()
    await upstream.aclose()
    return HttpResponse(body, status=upstream.status_code, content_type=content_type)


urlpatterns = [re_path(r"^.*$", relay)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    global UPSTREAM
    UPSTREAM = args.upstream
    settings.configure(
        DEBUG=False,
        SECRET_KEY="bench-floor",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=[],
        INSTALLED_APPS=[],
        DATABASES={},
        DATA_UPLOAD_MAX_MEMORY_SIZE=None,
        USE_TZ=True,
    )
    import django

    django.setup()
    import daphne.server
    from daphne.server import Server
    from django.core.asgi import get_asgi_application

    class FloorServer(Server):
        def listen_success(self, port: object) -> None:
            super().listen_success(port)
            print(f"floor: listening on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)

    assert daphne.server.twisted_loop is not None
    FloorServer(
        get_asgi_application(),
        endpoints=[f"tcp:port={args.port}:interface=127.0.0.1:backlog=1024"],
        verbosity=0,
    ).run()


if __name__ == "__main__":
    main()
