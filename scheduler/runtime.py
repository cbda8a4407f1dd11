"""The running server's shared objects: the config, the dispatcher, the upstream clients.

``manage.py serve`` installs them before daphne starts; views read them. Tests that run
the app in-process install their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.upstream import Upstreams
    from scheduler.config import Config
    from scheduler.dispatcher import Dispatcher


@dataclass
class Runtime:
    config: Config
    dispatcher: Dispatcher
    upstreams: Upstreams


_current: Runtime | None = None


def install(runtime: Runtime | None) -> None:
    global _current
    _current = runtime


def current() -> Runtime:
    if _current is None:
        raise RuntimeError("llamaswap is not running: start it with `manage.py serve`")
    return _current


def is_running() -> bool:
    return _current is not None
