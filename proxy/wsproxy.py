"""Websockets on ``/upstream/{model}/...``: the model loaded as for an HTTP request, then
every frame relayed both ways (llama-swap's websocket passthrough; ComfyUI-style servers
keep one open for a UI session).

The ASGI side is this module (mounted by ``llamaswap_site/asgi.py``'s websocket route,
after the Host, cross-site and API-key checks); the model side is the ``websockets``
library's client.

1. The model is found in the path as ``/upstream/`` finds it over HTTP
   (:func:`proxy.passthrough.find`: ids with ``/``, aliases, the active profile's pins;
   ``upstream.allowPaths`` and ``upstream.ignorePaths`` apply). ``/comfyui/...`` reaches
   the model ``comfyui_auto`` only while it is ready (:func:`proxy.passthrough.comfyui_socket`).
2. Without ``compat.ignoreWebsockets`` the socket takes a turn, as an HTTP request does:
   it waits in line, loads the model (swapping others out) and is recorded. The turn ends
   once the model has accepted the websocket (outcome completed, status 101): a session
   socket holding the model's turn would block the HTTP requests the same UI sends
   through ``/upstream/`` (a serial lane runs one at a time). With
   ``compat.ignoreWebsockets`` it takes no turn and loads nothing: it is relayed only
   when the model is ready.
3. Text and binary messages go both ways as they come (daphne passes no empty message);
   a close on one side closes the other with its code (daphne passes no reason; the codes
   it cannot send go as 4xxx, :func:`client_code`). When the model goes away (swapped out,
   stopped, crashed) the client gets ``4012`` (1012, service restart) unless the model
   closed with a code of its own.

Refusals happen before the handshake is accepted, where daphne can only answer ``403``;
the reason is logged. Bounds: :data:`MAX_RELAYS` sockets at once, :data:`MAX_MESSAGE_BYTES`
per message from the model (the client's side is daphne's, ``llamaswap_site/ws_limits.py``),
the model's ``timeouts.connect`` for its handshake, ``timeouts.idle`` without a frame
either way (then ``4001``, going away), :data:`SEND_TIMEOUT` for the model to take one of
the client's messages (then ``4011``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from proxy import passthrough, routing
from proxy.turn import Turn
from proxy.upstream import forward_headers
from proxy.views import new_request_id
from scheduler.config import ModelConfig
from scheduler.core.priority import HEADER
from scheduler.dispatcher import Outcome, Refused
from scheduler.keys import ApiKey, priority_of
from scheduler.process import ModelStartError, ModelState
from scheduler.runtime import Runtime
from web.runtime import scope_runtime

log = logging.getLogger("llamaswap.proxy")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

PREFIX = "/upstream/"
MAX_RELAYS = 64
"""Websockets relayed at once; one more is refused (logged)."""
MAX_MESSAGE_BYTES = 64 * 1024
"""The largest message relayed from a model; a larger one closes both sides (``4009``,
1009 too big). It is daphne's limit on every websocket it serves, both ways
(``llamaswap_site/ws_limits.py``, ``DASHBOARD_WS_MAX_MESSAGE_BYTES``): a larger message
could not be sent to the client anyway."""
MODEL_QUEUE = 4
"""Messages the model may have sent that the client's side has not taken yet; past it the
model's socket is not read (TCP pushes back on the model)."""
SEND_TIMEOUT = 60.0
"""Seconds the model may take to accept one of the client's messages (the HTTP relay's
write timeout); then both sides are closed (``4011``)."""
GOING_AWAY = 1001
SERVICE_RESTART = 1012
TOO_BIG = 1009
INTERNAL_ERROR = 1011
_SENDABLE = frozenset(range(1000, 1015)) - {1004, 1005, 1006} | frozenset(range(3000, 5000))
"""Close codes an endpoint may put on the wire (RFC 6455 7.4)."""


def client_code(code: int) -> int:
    """``code`` as the client's side can send it: daphne (autobahn) sends only 1000 and
    3000-4999, so RFC 6455's other codes go as 4000 plus their last three digits (1001
    going away -> 4001, 1009 too big -> 4009, 1011 -> 4011, 1012 service restart ->
    4012); a code no endpoint may send as 4000 + it, else 1000."""
    if code == 1000 or 3000 <= code <= 4999:
        return code
    if 1000 < code < 2000:
        return 4000 + code - 1000
    return 1000


_HANDSHAKE_HEADERS = frozenset(
    {
        "sec-websocket-key",
        "sec-websocket-version",
        "sec-websocket-extensions",
        "sec-websocket-protocol",
        "sec-websocket-accept",
        "user-agent",
    }
)
"""Set by the websocket client itself (the client's ``User-Agent`` is passed on as its)."""

_relays = 0


def wanted(scope: Scope) -> bool:
    """Is this websocket one for a model (``/upstream/...``, ``/comfyui/...``)?"""
    return str(scope.get("path", "")).startswith((PREFIX, passthrough.COMFYUI + "/"))


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI websocket application for ``/upstream/{model}/...``."""
    global _relays
    message = await receive()
    if message.get("type") != "websocket.connect":
        return
    if _relays >= MAX_RELAYS:
        await _deny(send, scope, f"{MAX_RELAYS} websockets are already relayed")
        return
    _relays += 1
    try:
        await _serve(scope, receive, send)
    finally:
        _relays -= 1


async def _deny(send: Send, scope: Scope, why: str) -> None:
    await send({"type": "websocket.close", "code": 1008})
    log.info("websocket refused: %s", why, extra={"path": str(scope.get("path", ""))[:200]})


def _target(rt: Runtime, scope: Scope) -> tuple[ModelConfig, str, str] | str:
    """``(model, path for the model as sent, requested name)``, or why there is none."""
    if not str(scope["path"]).startswith(PREFIX):  # /comfyui/...: only while it is ready
        return passthrough.comfyui_socket(rt, scope)
    rest = str(scope["path"])[len(PREFIX) :]
    found = passthrough.find(rt, rest)
    if found is None:
        return f"model {rest.split('/', 1)[0]!r} not found"
    name, path, model = found
    if path is None:
        return "no path after the model (/upstream/{model}/...)"
    if model is None:
        return f"model {name!r} not found"
    if not passthrough.path_allowed("/" + path, rt.config.upstream_allow_paths):
        return f"/{path} is not in upstream.allowPaths"
    ready = routing.model_states(rt.dispatcher).get(model.id) is ModelState.READY
    if not ready and passthrough.ignored("/" + path, rt.config.upstream_ignore_paths):
        return f"model {model.id} is not loaded; path matches upstream.ignorePaths"
    if not ready and model.ignore_websockets:
        return f"model {model.id} is not loaded (compat.ignoreWebsockets)"
    return model, passthrough.raw_rest(scope, name, path), name


async def _serve(scope: Scope, receive: Receive, send: Send) -> None:
    rt = scope_runtime(scope)
    if rt is None:
        await _deny(send, scope, "no llamaswap server serves this connection")
        return
    found = _target(rt, scope)
    if isinstance(found, str):
        await _deny(send, scope, found)
        return
    model, path, name = found
    request_id = new_request_id()
    turn = None if model.ignore_websockets else _take_turn(rt, scope, model, request_id, path, name)
    upstream: ClientConnection | None = None
    try:
        if turn is not None:
            base = await _wait_turn(turn, receive)
            if base is None:  # the client left while waiting
                await turn.close(disconnected=True)
                return
        upstream = await _open(scope, model, path, credentials=not rt.keys.enabled)
    except (ModelStartError, Refused) as exc:
        if turn is not None:
            await turn.close(error=None if isinstance(exc, Refused) else exc)
        await _deny(send, scope, f"model {model.id}: {exc}")
        return
    except (OSError, TimeoutError, InvalidHandshake) as exc:
        cause = _handshake_failure(exc)
        if turn is not None:
            turn.note(Outcome.FAILED, 502, cause)
            await turn.close()
        await _deny(send, scope, f"model {model.id} refused the websocket: {cause}")
        return
    except BaseException:
        if turn is not None:
            await turn.close(error=asyncio.CancelledError())
        raise
    try:
        if turn is not None:
            turn.note(Outcome.COMPLETED, 101)
            await turn.close()  # the GPU's turn ends; the socket stays (module docstring)
        accept: dict[str, Any] = {"type": "websocket.accept"}
        if upstream.subprotocol:
            accept["subprotocol"] = upstream.subprotocol
        await send(accept)
        log.info(
            "websocket relayed",
            extra={"model": model.id, "request_id": request_id, "path": path[:200]},
        )
        await _relay(receive, send, upstream, model.timeouts.idle)
    finally:
        await upstream.close()


def _take_turn(
    rt: Runtime, scope: Scope, model: ModelConfig, request_id: str, path: str, name: str
) -> Turn:
    """A turn for the socket, at the priority an HTTP request of its key would get."""
    key: ApiKey | None = scope.get("llamaswap.api_key")
    priority, requested, key_name = priority_of(key, _header(scope, HEADER.lower().encode()))
    turn = Turn(
        rt.dispatcher,
        model,
        priority,
        request_id,
        path,
        api_key=key_name,
        requested_priority=requested,
    )
    turn.ticket.extra["method"] = "GET"
    turn.ticket.extra["websocket"] = True
    if name != model.id:
        turn.ticket.extra["requested_model"] = name
    return turn


async def _wait_turn(turn: Turn, receive: Receive) -> str | None:
    """The model's base URL once the turn comes; None when the client left first."""
    waiting = asyncio.ensure_future(turn.wait())
    leaving = asyncio.ensure_future(receive())
    try:
        await asyncio.wait((waiting, leaving), return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        if not waiting.done():
            waiting.cancel()
        with contextlib.suppress(BaseException):
            await leaving
    if not waiting.done() or waiting.cancelled():
        return None
    return waiting.result()  # raises ModelStartError, Refused


async def _open(
    scope: Scope, model: ModelConfig, path: str, *, credentials: bool
) -> ClientConnection:
    """The websocket to the model: the client's headers (as the HTTP relay forwards them;
    its credentials only when ``credentials``: no API keys here), its offered
    subprotocols, and the query string."""
    base = model.proxy.rstrip("/")
    url = "ws" + base[len("http") :] + path
    query = scope.get("query_string", b"")
    if query:
        url += "?" + query.decode("latin-1")
    headers = [
        (k.decode("latin-1"), v.decode("latin-1"))
        for k, v in forward_headers(list(scope.get("headers", ())), credentials=credentials)
        if k.decode("latin-1").lower() not in _HANDSHAKE_HEADERS
    ]
    user_agent = _header(scope, b"user-agent")
    return await connect(
        url,
        additional_headers=headers,
        subprotocols=list(scope.get("subprotocols") or ()) or None,
        user_agent_header=user_agent.decode("latin-1") if user_agent else None,
        compression=None,
        open_timeout=model.timeouts.connect or None,
        max_size=MAX_MESSAGE_BYTES,
        max_queue=MODEL_QUEUE,
        ping_interval=None,  # a local model; idleness is judged on frames (timeouts.idle)
        close_timeout=5,
        proxy=None,
    )


def _handshake_failure(exc: BaseException) -> str:
    if isinstance(exc, InvalidStatus):
        return f"HTTP {exc.response.status_code}"
    if isinstance(exc, TimeoutError):
        return "no handshake in time (timeouts.connect)"
    return f"{type(exc).__name__}: {exc}"


async def _relay(receive: Receive, send: Send, upstream: ClientConnection, idle: float) -> None:
    """Frames both ways until one side closes (or ``idle`` seconds pass without one)."""
    last = [time.monotonic()]

    async def from_client() -> None:
        while True:
            message = await receive()
            kind = message["type"]
            if kind == "websocket.receive":
                last[0] = time.monotonic()
                data = message.get("bytes")
                # A model that takes nothing: the client's messages would pile up in
                # daphne's queue behind this send (its rate is bounded, not its total).
                async with asyncio.timeout(SEND_TIMEOUT):
                    await upstream.send(data if data is not None else message.get("text") or "")
            elif kind == "websocket.disconnect":
                code = message.get("code") or 1000
                reason = message.get("reason") or ""
                await upstream.close(code if code in _SENDABLE else 1000, reason)
                return

    async def from_model() -> None:
        try:
            async for data in upstream:
                last[0] = time.monotonic()
                if isinstance(data, bytes):
                    await send({"type": "websocket.send", "bytes": data})
                else:
                    await send({"type": "websocket.send", "text": data})
        except ConnectionClosed:
            pass
        received, sent = upstream.protocol.close_rcvd, upstream.protocol.close_sent
        if received is not None and received.code in _SENDABLE:
            code = received.code
        elif sent is not None and sent.code == TOO_BIG:
            code = TOO_BIG
        else:
            code = SERVICE_RESTART  # the model went away
        await send({"type": "websocket.close", "code": client_code(code)})

    async def watchdog() -> None:
        while True:
            remaining = last[0] + idle - time.monotonic()
            if remaining <= 0:
                await send({"type": "websocket.close", "code": client_code(GOING_AWAY)})
                await upstream.close(GOING_AWAY, "idle")
                return
            await asyncio.sleep(remaining)

    tasks = [asyncio.ensure_future(from_client()), asyncio.ensure_future(from_model())]
    if idle:
        tasks.append(asyncio.ensure_future(watchdog()))
    try:
        done, _pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            error = task.exception()
            if error is not None and not isinstance(error, ConnectionClosed):
                what = "the model took no message" if isinstance(error, TimeoutError) else error
                log.warning("websocket relay failed: %s: %s", type(error).__name__, what)
                with contextlib.suppress(Exception):
                    await send({"type": "websocket.close", "code": client_code(INTERNAL_ERROR)})
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value)
    return None
