"""Websockets: clients that flood, and clients that do not read (the websocket half of the
Twisted/daphne seams; :mod:`llamaswap_site.http_server` has the HTTP half).

daphne puts every incoming frame into the application's unbounded asyncio queue
(``WebSocketProtocol.onMessage``), and whatever the application sends is written into
Twisted's buffer, which grows without limit while the client does not read. Both are
bounded here, per connection, by switching daphne's websocket protocol class for a
subclass (:func:`install_websocket_limits`). Two kinds of socket:

* the dashboard's, whose every message is a whole state (a snapshot or an update): a newer
  one supersedes an older one, so a send may be replaced while the previous one has not
  drained, and a client sending more than a few messages a second is flooding;
* a model's, relayed on ``/upstream/{model}/...`` (``proxy.wsproxy``): every frame is the
  model's data, so none is ever replaced; a lagging reader's frames wait, in order, up to
  :attr:`WebsocketLimits.relay_backlog_bytes`, past which (or past the stall timeout) the
  connection is dropped; its inbound budget is :meth:`WebsocketLimits.for_relay`'s.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import termios
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

log = logging.getLogger("llamaswap.serve")

WS_POLICY_VIOLATION = 1008
"""The close code for a client over its message budget (RFC 6455: policy violation)."""


def _env_number(name: str, default: float) -> float:
    """A positive number from the environment; a bad value is logged and the default kept."""
    raw = os.getenv(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        log.warning("%s=%r is not a positive number: using %g", name, raw, default)
        return default
    return value


@dataclass(frozen=True)
class WebsocketLimits:
    """Per-connection websocket bounds (docs/dashboard.md, "Bounds"). The dashboard sends
    one ``refresh`` after a gap; a hundred in a second is a flood."""

    messages_per_second: float = 10.0
    """Incoming messages refilled per second into a bucket of ``burst_messages``."""
    burst_messages: int = 50
    bytes_per_second: float = 64 * 1024
    """Incoming payload bytes refilled per second into a bucket of ``burst_bytes``."""
    burst_bytes: int = 256 * 1024
    max_message_bytes: int = 64 * 1024
    """A larger message or frame is refused by autobahn (close 1009) before it is kept."""
    send_backlog_bytes: int = 256 * 1024
    """Bytes waiting in Twisted's buffer above which a send waits, replaced by newer ones."""
    stall_timeout: float = 30.0
    """Seconds the backlog may stay above ``send_backlog_bytes`` before the connection is
    dropped (the client reads nothing, or too little to be served)."""
    relay_backlog_bytes: int = 8 * 1024 * 1024
    """A relayed socket: bytes of the model's frames held for a lagging reader, past which
    the connection is dropped (a frame is never replaced there). With at most 64 relayed
    sockets (``proxy.wsproxy``), clients that read nothing hold 512 MiB at the most, for
    ``stall_timeout`` seconds."""

    def for_relay(self) -> WebsocketLimits:
        """The inbound budget of a relayed socket: a client streaming to a model (audio,
        a UI's events) sends far more than the dashboard's refreshes; still bounded."""
        return replace(
            self,
            messages_per_second=max(self.messages_per_second, 1000.0),
            burst_messages=max(self.burst_messages, 2000),
            bytes_per_second=max(self.bytes_per_second, 8 * 1024 * 1024.0),
            burst_bytes=max(self.burst_bytes, 16 * 1024 * 1024),
        )

    @classmethod
    def from_env(cls) -> WebsocketLimits:
        """The defaults, each overridable by a ``DASHBOARD_WS_*`` environment variable."""
        d = cls()
        return cls(
            messages_per_second=_env_number(
                "DASHBOARD_WS_MESSAGES_PER_SECOND", d.messages_per_second
            ),
            burst_messages=int(_env_number("DASHBOARD_WS_BURST_MESSAGES", d.burst_messages)),
            bytes_per_second=_env_number("DASHBOARD_WS_BYTES_PER_SECOND", d.bytes_per_second),
            burst_bytes=int(_env_number("DASHBOARD_WS_BURST_BYTES", d.burst_bytes)),
            max_message_bytes=int(
                _env_number("DASHBOARD_WS_MAX_MESSAGE_BYTES", d.max_message_bytes)
            ),
            send_backlog_bytes=int(
                _env_number("DASHBOARD_WS_SEND_BACKLOG_BYTES", d.send_backlog_bytes)
            ),
            stall_timeout=_env_number("DASHBOARD_WS_STALL_SECONDS", d.stall_timeout),
        )


_WS_LIMITS: list[WebsocketLimits] = []
"""The websocket limits in force (once :func:`install_websocket_limits` ran: the dashboard's,
then a relayed socket's)."""
RELAY_PATH = b"/upstream/"
"""Sockets under this path are a model's, relayed (``proxy.wsproxy``)."""
WS_FLUSH_INTERVAL = 0.05
"""How often a connection holding a replaced send looks whether its backlog drained."""


def install_websocket_limits(limits: WebsocketLimits | None = None) -> bool:
    """Bound every websocket daphne accepts from now on (``limits``, else
    :meth:`WebsocketLimits.from_env`). Returns False, logged, when daphne's hooks are gone
    (the server runs unbounded, as before). Idempotent."""
    from daphne.ws_protocol import WebSocketFactory

    chosen = limits or WebsocketLimits.from_env()
    _WS_LIMITS[:] = [chosen, chosen.for_relay()]
    current = WebSocketFactory.protocol
    if getattr(current, "_llamaswap", False):
        return True
    missing = [
        name
        for name in ("onMessage", "handle_reply", "check_timeouts", "sendCloseFrame")
        if not callable(getattr(current, name, None))
    ]
    if missing:
        log.warning("cannot bound websockets: daphne's %s is gone", ", ".join(missing))
        return False
    WebSocketFactory.protocol = type(
        f"Guarded{current.__name__}", (_WebsocketGuard, current), {"_llamaswap": True}
    )
    return True


def send_backlog(transport: Any) -> int:
    """Bytes written to a connection that its client has not taken yet: what Twisted holds
    (``FileDescriptor``'s buffers) plus what the kernel holds unacknowledged (``TIOCOUTQ``,
    Linux). The kernel's share matters: on loopback it autotunes a send buffer of ~4 MB,
    all of which a client that reads nothing leaves full. 0 for what cannot be read."""
    try:
        held = int(len(transport.dataBuffer) - transport.offset + transport._tempDataLen)
    except (AttributeError, TypeError):
        held = 0
    outq = getattr(termios, "TIOCOUTQ", None)
    if outq is not None:
        try:
            held += struct.unpack("i", fcntl.ioctl(transport.fileno(), outq, b"\0\0\0\0"))[0]
        except (AttributeError, OSError, ValueError):
            pass
    return held


def _reactor() -> Any:
    """Twisted's reactor (its zope interfaces read as unbound methods to plain mypy)."""
    from twisted.internet import reactor

    return reactor


class _WebsocketGuard:
    """Budgets on one websocket (a daphne ``WebSocketProtocol``): a token bucket for
    incoming messages and bytes, and at most one waiting send while the client lags."""

    _ws_messages = 0.0
    _ws_bytes = 0.0
    _ws_refilled = 0.0
    _ws_flooded = False
    _ws_pending: dict[str, Any] | None = None
    _ws_replaced = 0
    _ws_flush: Any = None
    _ws_stalled_since: float | None = None
    _ws_queue: deque[dict[str, Any]] | None = None
    """A relayed socket's frames waiting for a lagging reader, in order."""
    _ws_queued_bytes = 0
    _ws_sized = False

    def _ws_relayed(self) -> bool:
        """A model's socket (its path is known once the handshake arrived)."""
        return bytes(getattr(self, "path", b"") or b"").startswith(RELAY_PATH)

    def _ws_limits(self) -> WebsocketLimits:
        return _WS_LIMITS[1] if self._ws_relayed() else _WS_LIMITS[0]

    def connectionMade(self) -> None:
        super().connectionMade()  # type: ignore[misc]
        limits = _WS_LIMITS[0]
        # autobahn copied daphne's (1 MiB) options from the factory: ours win.
        self.maxMessagePayloadSize = limits.max_message_bytes
        self.maxFramePayloadSize = limits.max_message_bytes
        self._ws_messages = float(limits.burst_messages)
        self._ws_bytes = float(limits.burst_bytes)
        self._ws_refilled = time.monotonic()

    # -- inbound ----------------------------------------------------------------------

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        if self._ws_flooded:
            return  # closing: what was already on the wire is dropped
        limits = self._ws_limits()
        if not self._ws_sized and self._ws_relayed():
            # The path arrives after connectionMade filled the dashboard's buckets.
            self._ws_messages = float(limits.burst_messages)
            self._ws_bytes = float(limits.burst_bytes)
        self._ws_sized = True
        now = time.monotonic()
        elapsed = now - self._ws_refilled
        self._ws_refilled = now
        self._ws_messages = (
            min(limits.burst_messages, self._ws_messages + elapsed * limits.messages_per_second) - 1
        )
        self._ws_bytes = min(
            limits.burst_bytes, self._ws_bytes + elapsed * limits.bytes_per_second
        ) - len(payload)
        if self._ws_messages < 0 or self._ws_bytes < 0:
            self._ws_flooded = True
            what = "messages" if self._ws_messages < 0 else "bytes"
            self._ws_log(
                f"websocket flood: over {limits.messages_per_second:g} messages/s "
                f"(burst {limits.burst_messages}) or {limits.bytes_per_second:g} bytes/s "
                f"(burst {limits.burst_bytes}): closed {WS_POLICY_VIOLATION}",
                over=what,
            )
            self._ws_pending = None
            self.sendCloseFrame(  # type: ignore[attr-defined]
                code=WS_POLICY_VIOLATION, reasonUtf8=b"message rate over limit", isReply=False
            )
            return
        super().onMessage(payload, isBinary)  # type: ignore[misc]

    # -- outbound ---------------------------------------------------------------------

    def handle_reply(self, message: dict[str, Any]) -> None:
        if message.get("type") != "websocket.send":
            if self._ws_queue is not None and message.get("type") == "websocket.close":
                self._ws_queue.append(message)  # after the model's frames still waiting
                return
            super().handle_reply(message)  # type: ignore[misc]
            return
        state = self.state  # type: ignore[attr-defined]
        if state in (self.STATE_CLOSING, self.STATE_CLOSED):  # type: ignore[attr-defined]
            # Closing (a flood, a drop): autobahn would raise into the application for a
            # message nobody will read; the disconnect reaches it next.
            return
        if state == self.STATE_OPEN and self._ws_relayed():  # type: ignore[attr-defined]
            self._ws_relay_send(message)
            return
        if state == self.STATE_OPEN and (self._ws_pending is not None or self._ws_lagging()):  # type: ignore[attr-defined]
            # The previous sends have not drained: keep only the newest state.
            if self._ws_pending is not None:
                self._ws_replaced += 1
            self._ws_pending = message
            if self._ws_flush is None:
                self._ws_flush = _reactor().callLater(WS_FLUSH_INTERVAL, self._ws_try_flush)
            return
        super().handle_reply(message)  # type: ignore[misc]

    def _ws_relay_send(self, message: dict[str, Any]) -> None:
        """A model's frame: sent now, or queued behind the ones a lagging reader has not
        taken (never replaced); over :attr:`WebsocketLimits.relay_backlog_bytes` queued,
        the connection is dropped."""
        if self._ws_queue is None and not self._ws_lagging():
            super().handle_reply(message)  # type: ignore[misc]
            return
        if self._ws_queue is None:
            self._ws_queue = deque()
        self._ws_queue.append(message)
        self._ws_queued_bytes += len(message.get("bytes") or message.get("text") or "")
        limit = _WS_LIMITS[1].relay_backlog_bytes
        if self._ws_queued_bytes > limit:
            self._ws_log(
                f"websocket client not reading: over {limit} bytes of relayed frames "
                "waiting: dropped",
                queued=len(self._ws_queue),
            )
            self._ws_queue = None
            self.transport.abortConnection()  # type: ignore[attr-defined]
            return
        if self._ws_flush is None:
            self._ws_flush = _reactor().callLater(WS_FLUSH_INTERVAL, self._ws_try_flush)

    def _ws_lagging(self) -> bool:
        """Is the backlog over the mark? Starts (or ends) the stall clock."""
        if send_backlog(self.transport) < _WS_LIMITS[0].send_backlog_bytes:  # type: ignore[attr-defined]
            self._ws_stalled_since = None
            return False
        if self._ws_stalled_since is None:
            self._ws_stalled_since = time.monotonic()
        return True

    def _ws_try_flush(self) -> None:
        self._ws_flush = None
        if self._ws_queue is not None:
            self._ws_flush_relayed()
            return
        if self._ws_pending is None or self.state != self.STATE_OPEN:  # type: ignore[attr-defined]
            self._ws_pending = None
            return
        if self._ws_lagging():
            if not self._ws_stalled():
                self._ws_flush = _reactor().callLater(WS_FLUSH_INTERVAL, self._ws_try_flush)
            return
        message, self._ws_pending = self._ws_pending, None
        super().handle_reply(message)  # type: ignore[misc]

    def _ws_flush_relayed(self) -> None:
        """Send the queued frames, oldest first, while the reader keeps up."""
        queue = self._ws_queue
        if queue is None or self.state != self.STATE_OPEN:  # type: ignore[attr-defined]
            self._ws_queue = None
            return
        while queue and not self._ws_lagging():
            message = queue.popleft()
            self._ws_queued_bytes -= len(message.get("bytes") or message.get("text") or "")
            super().handle_reply(message)  # type: ignore[misc]
        if not queue:
            self._ws_queue = None
            self._ws_queued_bytes = 0
        elif not self._ws_stalled():
            self._ws_flush = _reactor().callLater(WS_FLUSH_INTERVAL, self._ws_try_flush)

    def _ws_stalled(self) -> bool:
        """Drop the connection when its backlog stayed over the mark too long."""
        since = self._ws_stalled_since
        limits = self._ws_limits()
        if since is None or time.monotonic() - since < limits.stall_timeout:
            return False
        self._ws_log(
            f"websocket client not reading: {send_backlog(self.transport)} bytes unsent "  # type: ignore[attr-defined]
            f"for {limits.stall_timeout:g}s: dropped",
            replaced=self._ws_replaced,
        )
        self._ws_pending = None
        self._ws_queue = None
        self.transport.abortConnection()  # type: ignore[attr-defined]
        return True

    def check_timeouts(self) -> None:
        """daphne calls this every 2 s: a client that reads nothing is found even when
        nothing more is being sent to it."""
        if self.state == self.STATE_OPEN and self._ws_lagging() and self._ws_stalled():  # type: ignore[attr-defined]
            return
        super().check_timeouts()  # type: ignore[misc]

    def connectionLost(self, reason: Any) -> None:
        if self._ws_flush is not None and self._ws_flush.active():
            self._ws_flush.cancel()
        self._ws_flush = None
        self._ws_pending = None
        self._ws_queue = None
        super().connectionLost(reason)  # type: ignore[misc]

    def _ws_log(self, why: str, **extra: Any) -> None:
        client = getattr(self, "client_addr", None)
        where = f"{client[0]}:{client[1]}" if client else "?"
        log.warning(why, extra={"client": where, "path": "websocket", **extra})
