"""The running server's shared objects: the config, the dispatcher, the upstream clients.

The composition (``llamaswap_site``: the ``serve`` command) builds them and installs them
here before daphne starts; views, consumers and the metrics collector read them. It is a
holder, not a wiring: it lives in this lower layer so that nothing below
``llamaswap_site`` has to import it. Tests that run the app in-process install their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.keys import KeyRing

if TYPE_CHECKING:
    from scheduler.config import Config
    from scheduler.dispatcher import Dispatcher


@dataclass
class Runtime:
    config: Config
    dispatcher: Dispatcher
    upstreams: Any
    """The proxy's HTTP clients (``proxy.upstream.Upstreams``)."""
    keys: KeyRing = field(default_factory=KeyRing)
    """The API keys in force (the config's and the admin-issued ones); none: no auth."""
    reloader: Any = None
    """The config reloader (``llamaswap_site.reload.Reloader``) when serving; its
    ``status`` says whether the last reload was refused, for the dashboard."""
    profile: str = ""
    """The active ``profiles`` entry ("" none; as in llama-swap, none after a start), set
    through ``PUT /api/profiles/active`` or the dashboard (dashboard/profiles.py)."""


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
