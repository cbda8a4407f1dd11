"""The running server's shared objects: the config, the dispatcher, the upstream clients.

The composition (``llamaswap_site``: the ``serve`` command) builds them; its router
(``build_application``) hands the runtime to every connection in its ASGI scope, where views
and consumers read it (``web.runtime.runtime_of``). :func:`install` / :func:`current` remain
for what has no request at hand: the metrics collector, admin hooks, the live observer's
start and the composition root itself. It lives in this lower layer so that nothing below
``llamaswap_site`` has to import it. Tests hand their own (``web.runtime.carrying``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from scheduler.keys import KeyRing
from scheduler.tickets import Unqueued

if TYPE_CHECKING:
    import httpx

    from scheduler.config import Config
    from scheduler.dispatcher import Dispatcher


class UpstreamPool(Protocol):
    """What the proxy's HTTP clients (``proxy.upstream.Upstreams``, a layer above) offer:
    the connection pool to the models and an httpx client for anything else."""

    def client(self) -> httpx.AsyncClient: ...

    def request(
        self,
        method: str,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        content: bytes,
        timeout: dict[str, float | None],
    ) -> httpx.Request: ...

    async def send(self, request: httpx.Request) -> httpx.Response: ...

    async def aclose(self) -> None: ...


class ReloadStatus(Protocol):
    def as_dict(self) -> dict[str, object]: ...


class ConfigReloader(Protocol):
    """What is read of the config reloader (``llamaswap_site.reload.Reloader``, a layer
    above): the last reload's outcome."""

    @property
    def status(self) -> ReloadStatus: ...


@dataclass
class Runtime:
    config: Config
    dispatcher: Dispatcher
    upstreams: UpstreamPool
    """The proxy's HTTP clients (``proxy.upstream.Upstreams``)."""
    keys: KeyRing = field(default_factory=KeyRing)
    """The API keys in force (the config's and the admin-issued ones); none: no auth."""
    reloader: ConfigReloader | None = None
    """The config reloader (``llamaswap_site.reload.Reloader``) when serving; its
    ``status`` says whether the last reload was refused, for the dashboard."""
    profile: str = ""
    """The active ``profiles`` entry ("" none; as in llama-swap, none after a start), set
    through ``PUT /api/profiles/active`` or the dashboard (dashboard/profiles.py)."""
    unqueued: Unqueued = field(init=False)
    """The tickets of requests that take no turn here (a peer's model: proxy/peers.py),
    told to the dispatcher's observers when they end."""

    def __post_init__(self) -> None:
        self.unqueued = Unqueued(self.dispatcher)


_current: Runtime | None = None


def install(runtime: Runtime | None) -> None:
    global _current
    _current = runtime


def current() -> Runtime:
    if _current is None:
        raise RuntimeError("llamaswap is not running: start it with `llamaswap serve`")
    return _current


def is_running() -> bool:
    return _current is not None
