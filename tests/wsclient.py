"""A minimal blocking websocket client (RFC 6455) for tests against the real server.

Raw sockets on purpose: a test must be able to flood without reading, never read at all,
or shrink its receive buffer, which a full client library hides. Text frames only, no
extensions; server pings are answered while reading.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time
from typing import Any

TEXT, CLOSE, PING, PONG = 0x1, 0x8, 0x9, 0xA


class Closed(Exception):
    """The server closed the websocket; ``code`` is its close code (None: no frame)."""

    def __init__(self, code: int | None, reason: str = "") -> None:
        super().__init__(f"closed: {code} {reason}")
        self.code = code
        self.reason = reason


class WebSocket:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""

    @classmethod
    def connect(
        cls, port: int, path: str = "/ws/dashboard/", rcvbuf: int | None = None, timeout: float = 5
    ) -> WebSocket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect: the window is negotiated then
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        sock.sendall(
            (
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Origin: http://127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        ws = cls(sock)
        head = ws._read_until(b"\r\n\r\n", timeout)
        if not head.startswith(b"HTTP/1.1 101"):
            sock.close()
            raise ConnectionError(head.decode("latin-1"))
        return ws

    def _read_until(self, marker: bytes, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while marker not in self._buf:
            self._fill(deadline)
        head, _, self._buf = self._buf.partition(marker)
        return head

    def _fill(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("websocket read timed out")
        self.sock.settimeout(left)
        chunk = self.sock.recv(262144)
        if not chunk:
            raise Closed(None, "connection closed")
        self._buf += chunk

    def _take(self, n: int, deadline: float) -> bytes:
        while len(self._buf) < n:
            self._fill(deadline)
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    @staticmethod
    def frame(opcode: int, payload: bytes) -> bytes:
        """One masked frame (clients must mask)."""
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 65536:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        return head + mask + masked

    def send_text(self, text: str) -> None:
        self.sock.sendall(self.frame(TEXT, text.encode()))

    def send_json(self, value: Any) -> None:
        self.send_text(json.dumps(value))

    def recv(self, timeout: float = 5) -> str:
        """The next text message; answers pings; raises :class:`Closed` on a close."""
        deadline = time.monotonic() + timeout
        while True:
            b0, b1 = self._take(2, deadline)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", self._take(2, deadline))
            elif n == 127:
                (n,) = struct.unpack("!Q", self._take(8, deadline))
            payload = self._take(n, deadline)
            if opcode == PING:
                self.sock.sendall(self.frame(PONG, payload))
            elif opcode == CLOSE:
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
                raise Closed(code, payload[2:].decode(errors="replace"))
            elif opcode == TEXT:
                return payload.decode()

    def recv_json(self, timeout: float = 5) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.recv(timeout))
        return value

    def close(self) -> None:
        try:
            self.sock.sendall(self.frame(CLOSE, struct.pack("!H", 1000)))
        except OSError:
            pass
        self.sock.close()
