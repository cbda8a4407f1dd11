"""A model server that notes when each request arrives and when its answer left.

``python -m bench.stampmodel --port N``: a raw asyncio HTTP/1.1 server (keep-alive,
Content-Length bodies only) for the dispatch-gap benchmark. Its own cost is a few tens of
microseconds per request, so the gap it sees between one job's answer and the next job's
arrival is the proxy's, not a web framework's.

* ``GET /health``: 200.
* ``POST`` anything else: a short chat-completion JSON answer at once (or after
  ``X-Stamp-Delay`` seconds); the arrival (the first byte of the request) and the moment the
  last byte of the answer was handed to the kernel are noted, ``time.monotonic_ns()``
  (CLOCK_MONOTONIC: comparable across processes on one machine).
* ``GET /stamps``: ``[[arrived_ns, answered_ns, body_bytes], ...]`` in arrival order, and
  forgets them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

ANSWER = json.dumps(
    {
        "id": "chatcmpl-stamp",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


def response(status: int, body: bytes) -> bytes:
    return (
        f"HTTP/1.1 {status} OK\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class Stamps:
    def __init__(self) -> None:
        self.rows: list[list[int]] = []


class StampProtocol(asyncio.Protocol):
    def __init__(self, stamps: Stamps) -> None:
        self.stamps = stamps
        self.buf = bytearray()
        self.arrived = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.buf:
            self.arrived = time.monotonic_ns()
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            length = 0
            delay = 0.0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "x-stamp-delay":
                    delay = float(value)
            if len(self.buf) < end + 4 + length:
                return
            method, path = head.split(" ", 2)[:2]
            del self.buf[: end + 4 + length]
            arrived = self.arrived
            self.arrived = time.monotonic_ns()  # a pipelined next request (not expected)
            self.handle(method, path, arrived, length, delay)

    def handle(self, method: str, path: str, arrived: int, length: int, delay: float) -> None:
        assert self.transport is not None
        if method == "GET" and path == "/health":
            self.transport.write(response(200, b'{"status":"ok"}'))
            return
        if method == "GET" and path == "/stamps":
            rows, self.stamps.rows = self.stamps.rows, []
            self.transport.write(response(200, json.dumps(rows).encode()))
            return
        row = [arrived, 0, length]
        self.stamps.rows.append(row)
        if delay:
            asyncio.get_running_loop().call_later(delay, self.answer, row)
        else:
            self.answer(row)

    def answer(self, row: list[int]) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(response(200, ANSWER))
        row[1] = time.monotonic_ns()


async def serve(host: str, port: int) -> None:
    stamps = Stamps()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: StampProtocol(stamps), host, port, backlog=1024)
    print(f"stampmodel: listening on http://{host}:{port}", file=sys.stderr, flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stampmodel")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
