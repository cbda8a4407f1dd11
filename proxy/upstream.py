"""HTTP clients for talking to model processes.

Several ``httpx.AsyncClient`` used round-robin: one client with many connections spends
noticeable time in httpcore's pool bookkeeping (about 39% less throughput than a few
clients round-robin, measured on this stack). Each
request makes httpcore check every connection of its pool for expiry, and an idle one
costs a syscall or two there: 16 clients, each with few connections, cost 6% less CPU per
request than 4 at 16 concurrent requests (bench/bench_proxy.py).
Tests inject a transport through :func:`set_transport`.
"""

from __future__ import annotations

import itertools

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

TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=30)


class Upstreams:
    """A small pool of AsyncClients, created on first use inside the running loop."""

    def __init__(self, size: int = 16, transport: httpx.AsyncBaseTransport | None = None):
        self._size = size
        self._transport = transport
        self._clients: list[httpx.AsyncClient] = []
        self._cycle: itertools.cycle[httpx.AsyncClient] | None = None

    def client(self) -> httpx.AsyncClient:
        if self._cycle is None:
            self._clients = [
                httpx.AsyncClient(
                    timeout=TIMEOUT, limits=LIMITS, transport=self._transport, trust_env=False
                )
                for _ in range(self._size)
            ]
            self._cycle = itertools.cycle(self._clients)
        return next(self._cycle)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()
        self._clients, self._cycle = [], None


def forward_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Request headers for the upstream: everything but hop-by-hop ones and Host."""
    return [(k, v) for k, v in headers if k.decode("latin-1").lower() not in HOP_BY_HOP]


def response_headers(headers: httpx.Headers) -> list[tuple[str, str]]:
    """Upstream response headers for the client: everything but hop-by-hop ones."""
    return [(k, v) for k, v in headers.multi_items() if k.lower() not in HOP_BY_HOP]
