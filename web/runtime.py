"""The runtime a request is served by, handed to the views with the request.

The composition root (``llamaswap_site.asgi.build_application``) builds its handlers for
one :class:`scheduler.runtime.Runtime` and puts it in every connection's ASGI scope
(HTTP and websocket) under :data:`SCOPE_KEY`; views read it with :func:`runtime_of`,
consumers with :func:`scope_runtime`. A request built by Django's test client carries
one when the test passes it: ``AsyncClient(**carrying(rt))`` (the scope) or
``Client(**carrying(rt))`` (the WSGI environ, ``request.META``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.http import HttpRequest

from scheduler.runtime import Runtime

SCOPE_KEY = "llamaswap.runtime"
"""Where the runtime serving a connection is kept in its ASGI scope."""


class NoRuntime(RuntimeError):
    """A request no llamaswap server serves (a view called outside ``build_application``)."""


def carrying(rt: Runtime | None) -> dict[str, Any]:
    """The scope (or WSGI environ) entries that hand ``rt`` to the views."""
    return {} if rt is None else {SCOPE_KEY: rt}


def scope_runtime(scope: Mapping[str, Any]) -> Runtime | None:
    """The runtime serving this ASGI connection; None when no server runs."""
    rt = scope.get(SCOPE_KEY)
    return rt if isinstance(rt, Runtime) else None


def maybe_runtime_of(request: HttpRequest) -> Runtime | None:
    """The runtime serving ``request``; None when no server runs (the pages then show
    what they can without one)."""
    scope: Mapping[str, Any] | None = getattr(request, "scope", None)
    return scope_runtime(scope if scope is not None else request.META)


def runtime_of(request: HttpRequest) -> Runtime:
    """The runtime serving ``request``. Raises :class:`NoRuntime` for a request built
    without one (see the module's doc)."""
    rt = maybe_runtime_of(request)
    if rt is None:
        raise NoRuntime(
            f"no llamaswap server serves {request.path}: start it with `llamaswap serve` "
            f"(a test hands its runtime with web.runtime.carrying)"
        )
    return rt
