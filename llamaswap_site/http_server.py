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
error that names the problem (daphne's HTML page stays for dashboard pages).
``manage.py serve`` calls it before the server starts. These are private Twisted names:
``tests/test_http_errors.py`` checks through a real server that every hook is installed
and reached, so a Twisted or daphne upgrade that moves one fails that test instead of
quietly bringing back the empty 400. A hook that is missing at start is logged and
skipped: the server still runs, with the stock answer.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from http import HTTPStatus
from typing import Any

log = logging.getLogger("llamaswap.serve")

_ORIGINALS: dict[str, Any] = {}
"""The replaced methods by name (daphne's HTML page is still used for pages)."""


def install() -> list[str]:
    """Install the JSON answers; returns the names of the hooks in place. Idempotent."""
    import daphne.server  # noqa: F401  (installs the asyncio reactor first, as serve does)
    from daphne.http_protocol import WebRequest
    from twisted.web.http import HTTPChannel

    installed = []
    for cls, name, replacement in (
        (HTTPChannel, "_respondToBadRequestAndDisconnect", _bad_request),
        (HTTPChannel, "lineLengthExceeded", _line_too_long),
        (WebRequest, "basic_error", _basic_error),
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
    from proxy.errors import REQUEST_ID_HEADER, error_body, new_request_id

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
    from proxy.errors import REQUEST_ID_HEADER, error_body, new_request_id, wants_json

    # The URI as sent: daphne resets ``path`` to "/" when it has non-ASCII bytes.
    path = request.uri.split(b"?", 1)[0].decode("latin-1")
    if not wants_json(path):
        return _ORIGINALS["basic_error"](request, status, status_text, body)
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
    ``max_body_bytes`` (answered 413 before it is read). Returns False, logged, when the
    daphne hook is gone (the server runs with Twisted's defaults)."""
    from daphne.http_protocol import HTTPFactory

    _LIMITS[:] = [limits]
    current = HTTPFactory.__dict__.get("buildProtocol")
    if current is None:
        log.warning("cannot apply request limits: daphne's HTTPFactory.buildProtocol is gone")
        return False
    if getattr(current, "_llamaswap", False):
        return True
    _ORIGINALS["buildProtocol"] = current

    def buildProtocol(self: Any, addr: Any) -> Any:
        protocol = current(self, addr)
        if protocol is not None and _LIMITS:
            _Guard(getattr(protocol, "_channel", protocol), _LIMITS[0])
            protocol.timeOut = _LIMITS[0].body_idle_timeout or None
        return protocol

    buildProtocol._llamaswap = True  # type: ignore[attr-defined]
    HTTPFactory.buildProtocol = buildProtocol
    return True


class _Guard:
    """Deadlines on one HTTP/1.1 connection (a Twisted ``HTTPChannel``), hooked into the
    channel's own methods so that nothing runs per byte but a counter."""

    __slots__ = ("channel", "limits", "timer", "phase", "received", "_originals")

    def __init__(self, channel: Any, limits: Any) -> None:
        self.channel = channel
        self.limits = limits
        self.timer: Any = None
        self.phase = "idle"  # idle -> headers -> body -> handling -> idle ...
        self.received = 0
        self._originals = {}
        for name in (
            "dataReceived",
            "allHeadersReceived",
            "allContentReceived",
            "rawDataReceived",
            "connectionLost",
            "timeoutConnection",
        ):
            self._originals[name] = getattr(channel, name)
            setattr(channel, name, getattr(self, name))

    # The channel calls these (instance attributes shadow its methods).

    def dataReceived(self, data: bytes) -> None:
        if self.phase == "idle" and data:
            self.phase = "headers"
            self._arm(self.limits.header_timeout, "request line and headers")
        self._originals["dataReceived"](data)

    def allHeadersReceived(self) -> None:
        self._originals["allHeadersReceived"]()
        length = self.channel.length
        limit = self.limits.max_body_bytes
        if length is not None and length > limit:
            self._refuse(
                413,
                "request_too_large",
                f"request body of {length} bytes is over the limit of {limit} bytes "
                "(limits.maxBodyBytes)",
            )
            return
        self.phase, self.received = "body", 0
        if length != 0:  # else Twisted ends the request at once
            self._arm(self.limits.body_timeout, "request body")

    def rawDataReceived(self, data: bytes) -> None:
        if self.phase == "body":
            self.received += len(data)
            limit = self.limits.max_body_bytes
            if self.received > limit + 65536:  # chunked framing: a little slack
                self._refuse(
                    413,
                    "request_too_large",
                    f"request body is over the limit of {limit} bytes (limits.maxBodyBytes)",
                )
                return
        self._originals["rawDataReceived"](data)

    def allContentReceived(self) -> None:
        self.phase = "handling"
        self._cancel()
        self._originals["allContentReceived"]()
        # The next request on this connection starts its own header deadline.
        self.phase = "idle"

    def connectionLost(self, reason: Any) -> None:
        self._cancel()
        self._originals["connectionLost"](reason)

    def timeoutConnection(self) -> None:
        if self.phase in ("headers", "body"):
            self._log_cut(
                f"no byte for {self.limits.body_idle_timeout:g}s", "limits.bodyIdleTimeout"
            )
            self._cancel()
            _write_error(
                self.channel.transport,
                408,
                "request_timeout",
                "the request stopped arriving (limits.bodyIdleTimeout)",
            )
        self._originals["timeoutConnection"]()

    # Deadlines.

    def _arm(self, seconds: float, what: str) -> None:
        self._cancel()
        if seconds:
            from twisted.internet import reactor

            self.timer = reactor.callLater(seconds, self._expired, what, seconds)

    def _cancel(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None

    def _expired(self, what: str, seconds: float) -> None:
        self.timer = None
        key = "limits.headerTimeout" if self.phase == "headers" else "limits.bodyTimeout"
        self._log_cut(f"{what} not complete after {seconds:g}s", key)
        self._refuse(
            408, "request_timeout", f"the {what} did not arrive within {seconds:g}s ({key})"
        )

    def _refuse(self, status: int, code: str, message: str) -> None:
        self._cancel()
        self.phase = "refused"
        transport = self.channel.transport
        _write_error(transport, status, code, message)
        transport.loseConnection()
        # Stop reading what is left of the request.
        self.channel.setTimeout(None)
        with contextlib.suppress(Exception):
            transport.pauseProducing()

    def _log_cut(self, why: str, key: str) -> None:
        peer = self.channel.transport.getPeer()
        log.warning(
            "slow client cut off: %s (%s)",
            why,
            key,
            extra={
                "client": f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}",
                "phase": self.phase,
                "received": self.received,
            },
        )
