"""Protocol-level errors as JSON: the one seam into Twisted and daphne.

Some requests are answered before Django sees them:

* Twisted's ``HTTPChannel`` refuses what it cannot parse (a bad request line, a header line
  without a colon or with a bad name or value, a Content-Length that is no number, two
  framings, more than ``maxHeaders`` headers or ``totalHeadersSize`` bytes of them, a broken
  chunked body) with a bare ``HTTP/1.1 400 Bad Request`` and no body, from
  ``HTTPChannel._respondToBadRequestAndDisconnect``. A single line over ``MAX_LENGTH``
  bytes is not answered at all: ``LineReceiver.lineLengthExceeded`` drops the connection.
* daphne's ``WebRequest.basic_error`` answers a header value with a control character, a
  non-ASCII path or query, and an application that raised, with an HTML page.

:func:`install` replaces those three methods so that each answer is an OpenAI-shaped JSON
error that names the problem (daphne's HTML page stays for dashboard pages), and
daphne's ``WebRequest.handle_reply`` so that a HEAD response has no body (see
:func:`_handle_reply`).
``manage.py serve`` calls it before the server starts. These are private Twisted names:
``tests/test_http_errors.py`` checks through a real server that every hook is installed
and reached, so a Twisted or daphne upgrade that moves one fails that test instead of
quietly bringing back the empty 400. A hook that is missing at start is logged and
skipped: the server still runs, with the stock answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from http import HTTPStatus
from typing import Any

log = logging.getLogger("llamaswap.serve")

_ORIGINALS: dict[str, Any] = {}
"""The replaced methods by name (daphne's HTML page is still used for pages)."""


def install() -> list[str]:
    """Install the JSON answers (and :func:`skip_twisted_form_parsing`); returns the names
    of the hooks in place. Idempotent."""
    import daphne.server  # noqa: F401  (installs the asyncio reactor first, as serve does)
    from daphne.http_protocol import WebRequest
    from twisted.web.http import HTTPChannel

    installed = []
    if skip_twisted_form_parsing():
        installed.append("_parsePOSTFormSubmission")
    for cls, name, replacement in (
        (HTTPChannel, "_respondToBadRequestAndDisconnect", _bad_request),
        (HTTPChannel, "lineLengthExceeded", _line_too_long),
        (WebRequest, "basic_error", _basic_error),
        (WebRequest, "handle_reply", _handle_reply),
    ):
        current = getattr(cls, name, None)
        if current is replacement:
            installed.append(name)
            continue
        if current is None:
            log.warning("cannot answer protocol errors in JSON: %s.%s is gone", cls.__name__, name)
            continue
        _ORIGINALS[name] = current
        setattr(cls, name, replacement)
        installed.append(name)
    return installed


# -- Twisted: the request could not be parsed ---------------------------------------------


def _bad_request(channel: Any) -> None:
    """``HTTPChannel._respondToBadRequestAndDisconnect``: a JSON 400 that says what was wrong.

    Twisted calls it from the method that found the problem, without saying which problem:
    the caller's name tells (``_why``); an unknown caller gets the generic message.
    """
    status, code, message = _why(channel, sys._getframe(1).f_code.co_name)
    _write_error(channel.transport, status, code, message)
    channel.loseConnection()


def _why(channel: Any, caller: str) -> tuple[int, str, str]:
    if caller == "lineReceived":
        limit = getattr(channel, "totalHeadersSize", 0)
        if limit and getattr(channel, "_receivedHeaderSize", 0) > limit:
            return 431, "headers_too_large", f"request line and headers are over {limit} bytes"
        return (
            400,
            "malformed_request_line",
            "malformed request line: expected METHOD TARGET HTTP/1.0 or HTTP/1.1, "
            "with a target of printable ASCII",
        )
    if caller == "headerReceived":
        limit = getattr(channel, "maxHeaders", 0)
        if limit and getattr(channel, "_receivedHeaderCount", 0) > limit:
            return 431, "headers_too_large", f"more than {limit} request headers"
        return (
            400,
            "malformed_header",
            "malformed header line: expected 'Name: value', a name of token characters "
            "and a value without NUL, CR or LF",
        )
    if caller == "_failChooseTransferDecoder":
        return (
            400,
            "invalid_content_length",
            "invalid framing: Content-Length must be a number and Transfer-Encoding chunked "
            "or identity, and a request has at most one of them",
        )
    if caller in ("rawDataReceived", "dataReceived"):
        return 400, "malformed_body", "malformed chunked request body"
    return 400, "malformed_request", "malformed HTTP request"


def _line_too_long(channel: Any, line: bytes) -> None:
    """``LineReceiver.lineLengthExceeded``: answer (414 or 431) instead of just hanging up."""
    limit = getattr(channel, "MAX_LENGTH", 0)
    if getattr(channel, "_HTTPChannel__first_line", 0):
        status, code, message = 414, "uri_too_long", f"request line is over {limit} bytes"
    else:
        status, code, message = 431, "headers_too_large", f"a header line is over {limit} bytes"
    _write_error(channel.transport, status, code, message)
    channel.transport.loseConnection()


def _write_error(transport: Any, status: int, code: str, message: str) -> None:
    from web.errors import REQUEST_ID_HEADER, error_body, new_request_id

    body = error_body(status, message, code)
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        f"{REQUEST_ID_HEADER}: {new_request_id()}\r\n"
        "\r\n"
    )
    transport.write(head.encode("ascii") + body)


# -- daphne: parsed, but refused before the application ------------------------------------

_DAPHNE = {
    "Invalid header name": (
        "invalid_header_name",
        "a header name has characters other than token characters",
    ),
    "Invalid header value": (
        "invalid_header_value",
        "a header value has a forbidden control character (VT, FF, FS, GS, RS or NEL)",
    ),
    "Invalid characters in path": (
        "invalid_path",
        "the path has non-ASCII bytes: percent-encode them",
    ),
    "Invalid query string": (
        "invalid_query",
        "the query string has non-ASCII bytes: percent-encode them",
    ),
    "Exception inside application.": ("internal_error", "internal error: see the server log"),
    "Daphne HTTP processing error": ("internal_error", "internal error: see the server log"),
}


def _basic_error(request: Any, status: int, status_text: bytes, body: str) -> None:
    """``WebRequest.basic_error``: JSON on API and proxy paths, daphne's page elsewhere."""
    from web.errors import REQUEST_ID_HEADER, error_body, new_request_id
    from web.paths import wants_json

    # The URI as sent: daphne resets ``path`` to "/" when it has non-ASCII bytes.
    path = request.uri.split(b"?", 1)[0].decode("latin-1")
    if not wants_json(path):
        _ORIGINALS["basic_error"](request, status, status_text, body)
        return
    code, message = _DAPHNE.get(body, (None, body))
    request.handle_reply(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"Content-Type", b"application/json"),
                (REQUEST_ID_HEADER.encode(), new_request_id().encode()),
            ],
        }
    )
    request.handle_reply({"type": "http.response.body", "body": error_body(status, message, code)})


def _handle_reply(request: Any, message: dict[str, Any]) -> None:
    """``WebRequest.handle_reply``, without a body for HEAD, for every handler.

    Twisted drops a HEAD response's body by replacing the request's ``write`` once the
    headers are out, but daphne writes through ``http.Request.write(self, ...)``, the
    class's method: every body message after the first (Django sends 64 KB each) went out
    after the headers, and a keep-alive client or a pooling proxy read those bytes as the
    next response (response splitting). The headers stay those of the GET, as HTTP wants
    (Content-Length included)."""
    if (
        request.method == b"HEAD"
        and message.get("body")
        and message.get("type") == "http.response.body"
    ):
        message = {**message, "body": b""}
    _ORIGINALS["handle_reply"](request, message)


# -- Twisted: clients that are too slow, or send too much ----------------------------------
#
# Twisted reads a whole request (headers and body, the body into a file) before daphne
# hands it to the application, so a client that stalls or trickles is invisible to the
# app: its limits must be kept here, per connection. ``limits`` is the config's
# ``limits:`` section (scheduler.config.RequestLimits).

_LIMITS: list[Any] = []
"""The limits in force (one element once :func:`install_limits` has run)."""


def install_limits(limits: Any) -> bool:
    """Apply ``limits`` to every connection daphne accepts from now on: the request line
    and headers within ``header_timeout``, the body within ``body_timeout``, no pause over
    ``body_idle_timeout`` (also the idle time of a kept-alive connection), and no body over
    ``max_body_bytes`` (answered 413 before it is read). A response waits while its client
    takes none of it (:func:`_install_backpressure`), at most ``send_idle_timeout``.
    Returns False, logged, when the daphne hook is gone (the server runs with Twisted's
    defaults)."""
    from daphne.http_protocol import HTTPFactory

    _LIMITS[:] = [limits]
    _install_backpressure()
    current = HTTPFactory.__dict__.get("buildProtocol")
    if current is None:
        log.warning("cannot apply request limits: daphne's HTTPFactory.buildProtocol is gone")
        return False
    if getattr(current, "_llamaswap", False):
        return True
    _ORIGINALS["buildProtocol"] = current

    def buildProtocol(self: Any, addr: Any) -> Any:
        if not _SERVER:
            server = getattr(self, "server", None)
            if server is not None and hasattr(server, "request_buffer_size"):
                _SERVER.append(server)
        protocol = current(self, addr)
        if protocol is not None and _LIMITS:
            channel = getattr(protocol, "_channel", protocol)
            channel.__class__ = _guarded(type(channel))
            protocol.timeOut = _LIMITS[0].body_idle_timeout or None
        return protocol

    buildProtocol._llamaswap = True  # type: ignore[attr-defined]
    HTTPFactory.buildProtocol = buildProtocol
    return True


_GUARDED: dict[type, type] = {}
_SERVER: list[Any] = []
"""The daphne server (one element once a connection was accepted): see :func:`_one_piece`."""


def _one_piece(length: int) -> None:
    """Make daphne hand a body of ``length`` bytes to the application in one piece.

    daphne reads the body Twisted buffered (a temporary file beyond 100 KB) in pieces of
    its ``request_buffer_size`` and the app joins them: two copies of the body at once (a
    50 MB upload peaked at 100 MB). One piece is the body itself. The size only grows, to
    the largest body announced so far (at most ``limits.maxBodyBytes``), so it is never
    below the length of a body still waiting to be read; reading a smaller body asks for
    that much address space, not memory (untouched pages are never resident, and the
    unused tail is given back at once)."""
    if _SERVER and _SERVER[0].request_buffer_size <= length:
        _SERVER[0].request_buffer_size = length + 1


def _guarded(channel_class: type) -> type:
    """``channel_class`` with the deadlines of :class:`_GuardMixin` (built once per class).
    A connection's channel is switched to it, so the guard costs a connection three
    attributes, not a set of bound methods."""
    guarded = _GUARDED.get(channel_class)
    if guarded is None:
        guarded = type(f"Guarded{channel_class.__name__}", (_GuardMixin, channel_class), {})
        _GUARDED[channel_class] = guarded
    return guarded


_ACTIVE: set[Any] = set()
"""Guarded connections inside a request's headers or body, each with a deadline."""
_STALLED: set[Any] = set()
"""Guarded connections whose client takes no response data (Twisted's send buffer full)."""
_SWEEPER: list[Any] = []
"""The armed sweep (a Twisted DelayedCall), while there is something to watch."""


def _install_backpressure() -> bool:
    """Make the application's ``send`` of a response body wait while its client takes no
    data: daphne registers no producer for a request, so Twisted buffered whatever the
    application wrote, without limit (a client that opened ``/logs/stream`` or a stream
    of tokens and never read made the server hold all of it). Twisted tells the channel
    (:class:`_GuardMixin`) when its send buffer is over 64 KB and when it drained; while
    it is full, the next body message waits here, so what one connection holds is that
    buffer and one message. A client that takes nothing for ``limits.sendIdleTimeout``
    is cut off (:func:`_sweep`): the application's ``receive`` then says disconnect, as
    when the client hangs up. Returns False, logged, when daphne's hook is gone."""
    from daphne.server import Server

    current = Server.__dict__.get("handle_reply")
    if current is None:
        log.warning("cannot hold responses for slow readers: daphne's Server.handle_reply is gone")
        return False
    if getattr(current, "_llamaswap", False):
        return True
    _ORIGINALS["Server.handle_reply"] = current

    async def handle_reply(self: Any, protocol: Any, message: dict[str, Any]) -> None:
        if message.get("type") == "http.response.body":
            channel = getattr(protocol, "channel", None)
            if getattr(channel, "_ls_stalled_at", 0.0):
                await channel._ls_writable()  # type: ignore[union-attr]
        await current(self, protocol, message)

    handle_reply._llamaswap = True  # type: ignore[attr-defined]
    Server.handle_reply = handle_reply
    return True


def _sweep_interval() -> float:
    limits = _LIMITS[0]
    timeouts = (limits.header_timeout, limits.body_timeout, limits.send_idle_timeout)
    shortest = min((t for t in timeouts if t), default=30.0)
    return max(0.05, min(1.0, shortest / 5))


def _ensure_sweeper() -> None:
    if not _SWEEPER:
        from twisted.internet import reactor

        clock: Any = reactor  # its zope interfaces read as unbound methods to plain mypy
        _SWEEPER.append(clock.callLater(_sweep_interval(), _sweep))


def _sweep() -> None:
    """Cut every connection past its deadline; re-arm while any is being watched. One
    timer for all connections, not one per request: a request costs a set insert."""
    _SWEEPER.clear()
    now = time.monotonic()
    for channel in [c for c in _ACTIVE if c._ls_deadline <= now]:
        channel._ls_expired()
    cutoff = now - _LIMITS[0].send_idle_timeout
    for channel in [c for c in _STALLED if c._ls_stalled_at <= cutoff]:
        channel._ls_cut_stalled()
    if _ACTIVE or _STALLED:
        _ensure_sweeper()


class _GuardMixin:
    """Deadlines on one HTTP/1.1 connection (a Twisted ``HTTPChannel``): nothing per byte
    but a counter while a body arrives, and no timer per request (see :func:`_sweep`).
    Phases: idle -> headers -> body -> handling -> idle ..."""

    _ls_phase = "idle"
    _ls_deadline = 0.0
    _ls_received = 0
    _ls_stalled_at = 0.0
    """When the client stopped taking response data (Twisted's send buffer over 64 KB);
    0 while it reads."""
    _ls_waiter: asyncio.Future[None] | None = None
    """What the application's next body message awaits while the client is stalled."""

    def dataReceived(self, data: bytes) -> None:
        if self._ls_phase == "idle" and data:
            self._ls_watch("headers", _LIMITS[0].header_timeout)
        super().dataReceived(data)  # type: ignore[misc]

    def allHeadersReceived(self) -> None:
        super().allHeadersReceived()  # type: ignore[misc]
        limits = _LIMITS[0]
        length = self.length  # type: ignore[attr-defined]
        if length is not None and length > limits.max_body_bytes:
            self._ls_refuse(
                413,
                "request_too_large",
                f"request body of {length} bytes is over the limit of "
                f"{limits.max_body_bytes} bytes (limits.maxBodyBytes)",
            )
            return
        self._ls_received = 0
        if length is not None and length > 0:
            _one_piece(length)
        # No body (length 0): Twisted ends the request at once.
        self._ls_watch("body", limits.body_timeout if length != 0 else 0)

    def rawDataReceived(self, data: bytes) -> None:
        if self._ls_phase == "body":
            self._ls_received += len(data)
            limit = _LIMITS[0].max_body_bytes
            if self._ls_received > limit + 65536:  # chunked framing: a little slack
                self._ls_refuse(
                    413,
                    "request_too_large",
                    f"request body is over the limit of {limit} bytes (limits.maxBodyBytes)",
                )
                return
        super().rawDataReceived(data)  # type: ignore[misc]

    def allContentReceived(self) -> None:
        self._ls_watch("handling", 0)
        super().allContentReceived()  # type: ignore[misc]
        # The next request on this connection starts its own header deadline.
        self._ls_phase = "idle"

    def connectionLost(self, reason: Any) -> None:
        _ACTIVE.discard(self)
        self._ls_drained()
        super().connectionLost(reason)  # type: ignore[misc]

    def pauseProducing(self) -> None:
        # The transport calls this on every write while its buffer is over bufferSize:
        # the first call starts the clock.
        if not self._ls_stalled_at:
            self._ls_stalled_at = time.monotonic()
            if _LIMITS[0].send_idle_timeout:
                _STALLED.add(self)
                _ensure_sweeper()
        super().pauseProducing()  # type: ignore[misc]

    def resumeProducing(self) -> None:
        self._ls_drained()
        super().resumeProducing()  # type: ignore[misc]

    def _ls_drained(self) -> None:
        """The client took the buffered data (or is gone): a waiting send goes on."""
        self._ls_stalled_at = 0.0
        _STALLED.discard(self)
        waiter = self._ls_waiter
        if waiter is not None:
            self._ls_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _ls_writable(self) -> None:
        """Until the client took what is buffered, or the connection is gone."""
        waiter = self._ls_waiter
        if waiter is None or waiter.done():
            waiter = self._ls_waiter = asyncio.get_running_loop().create_future()
        await waiter

    def _ls_cut_stalled(self) -> None:
        seconds = _LIMITS[0].send_idle_timeout
        self._ls_log(f"took no response data for {seconds:g}s", "limits.sendIdleTimeout")
        _STALLED.discard(self)
        # abortConnection, not loseConnection: that would wait to send the buffer first.
        self.transport.abortConnection()  # type: ignore[attr-defined]

    def timeoutConnection(self) -> None:
        if self._ls_phase in ("headers", "body"):
            seconds = _LIMITS[0].body_idle_timeout
            self._ls_log(f"no byte for {seconds:g}s", "limits.bodyIdleTimeout")
            _ACTIVE.discard(self)
            _write_error(
                self.transport,  # type: ignore[attr-defined]
                408,
                "request_timeout",
                "the request stopped arriving (limits.bodyIdleTimeout)",
            )
        super().timeoutConnection()  # type: ignore[misc]

    def _ls_watch(self, phase: str, seconds: float) -> None:
        self._ls_phase = phase
        if seconds:
            self._ls_deadline = time.monotonic() + seconds
            _ACTIVE.add(self)
            _ensure_sweeper()
        else:
            _ACTIVE.discard(self)

    def _ls_expired(self) -> None:
        limits = _LIMITS[0]
        if self._ls_phase == "headers":
            what, seconds, key = (
                "request line and headers",
                limits.header_timeout,
                "limits.headerTimeout",
            )
        else:
            what, seconds, key = "request body", limits.body_timeout, "limits.bodyTimeout"
        self._ls_log(f"{what} not complete after {seconds:g}s", key)
        self._ls_refuse(
            408, "request_timeout", f"the {what} did not arrive within {seconds:g}s ({key})"
        )

    def _ls_refuse(self, status: int, code: str, message: str) -> None:
        _ACTIVE.discard(self)
        self._ls_phase = "refused"
        transport = self.transport  # type: ignore[attr-defined]
        _write_error(transport, status, code, message)
        transport.loseConnection()
        self.setTimeout(None)  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            transport.pauseProducing()  # read no more of the request

    def _ls_log(self, why: str, key: str) -> None:
        peer = self.transport.getPeer()  # type: ignore[attr-defined]
        log.warning(
            "slow client cut off: %s (%s)",
            why,
            key,
            extra={
                "client": f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}",
                "phase": self._ls_phase,
                "received": self._ls_received,
            },
        )


# -- Twisted: a POST body is parsed twice ---------------------------------------------------


def skip_twisted_form_parsing() -> bool:
    """Stop Twisted from parsing POST bodies as forms; True once in place.

    Daphne hands the raw body to the application and never reads Twisted's ``args``, yet
    Twisted parses the Content-Type of every POST with :mod:`email` (a new class per
    call: CPU and cyclic garbage per request) and a whole multipart body into ``args`` (an
    upload parsed twice). ``Request.requestReceived`` reads ``_parsePOSTFormSubmission``,
    which ``Request.__init__`` sets per request; a read-only property on daphne's request
    class pins it to False. ``tests/test_seams.py`` fails if Twisted stops reading it.
    """
    from daphne.http_protocol import WebRequest

    if "_parsePOSTFormSubmission" not in _twisted_request_source():
        log.warning("cannot skip Twisted's form parsing: _parsePOSTFormSubmission is gone")
        return False
    WebRequest._parsePOSTFormSubmission = property(lambda self: False, lambda self, value: None)
    return True


def _twisted_request_source() -> str:
    import inspect

    from twisted.web.http import Request

    return inspect.getsource(Request)
