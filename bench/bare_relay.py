"""The floor of a serial relay on this stack: daphne, no framework, one request at a time.

``python -m bench.bare_relay --port N --upstream HOST:PORT``: an ASGI app with no
framework (like ``bench/bare.py``) served by daphne, which relays every request to the
upstream one at a time, in arrival order, over one raw asyncio keep-alive connection (no
httpx, no Django), and answers with the upstream's status, content type and body. The
requests wait in an ``asyncio.Queue``; one worker task writes the next one as soon as it
has read the whole answer to the one before, with no other hop on the event loop
between. Upstream answers must carry a ``Content-Length`` (``bench/stampmodel.py``'s do).

``bench/bench_gap.py`` runs it in front of the same stamping model with the same client
as the product (1,000 waiting): the GPU's idle time between two jobs that this fixed stack
(daphne, Twisted on asyncio, one Python process) leaves when the relay does nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from typing import Any

UPSTREAM = os.environ.get("BENCH_RELAY_UPSTREAM", "127.0.0.1:9")
SKIP = frozenset({b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"})

Answer = tuple[int, bytes, bytes]
"""Status, content type, body."""

_line: asyncio.Queue[tuple[bytes, asyncio.Future[Answer]]] | None = None
_worker_task: asyncio.Task[None] | None = None
"""Held here: the event loop keeps only a weak reference to a task, and while the worker
waits for the model nothing else holds it (the stream protocol holds its reader weakly),
so a garbage collection would destroy it mid-request."""


async def _exchange(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None, raw: bytes
) -> tuple[tuple[asyncio.StreamReader, asyncio.StreamWriter], Answer]:
    """Write one request on the keep-alive connection (opened if need be), read its answer."""
    if conn is None:
        host, _, port = UPSTREAM.rpartition(":")
        conn = await asyncio.open_connection(host, int(port))
        conn[1].transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
    reader, writer = conn
    writer.write(raw)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length, content_type = 0, b"application/json"
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"content-type":
            content_type = value.strip()
    return conn, (status, content_type, await reader.readexactly(length))


async def _worker(line: asyncio.Queue[tuple[bytes, asyncio.Future[Answer]]]) -> None:
    """Relays the queued requests one at a time, in the order they came."""
    conn = None
    while True:
        raw, answer = await line.get()
        try:
            conn, result = await _exchange(conn, raw)
        except Exception as error:  # the connection is lost: a new one for the next
            if conn is not None:
                conn[1].close()
            conn = None
            if not answer.done():
                answer.set_exception(error)
            continue
        if not answer.done():
            answer.set_result(result)


def _queue() -> asyncio.Queue[tuple[bytes, asyncio.Future[Answer]]]:
    global _line, _worker_task
    if _line is None:  # daphne has no lifespan: started with the first request
        _line = asyncio.Queue()
        _worker_task = asyncio.get_running_loop().create_task(_worker(_line))
    return _line


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return  # the client left
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    target = scope["path"].encode() + (
        b"?" + scope["query_string"] if scope["query_string"] else b""
    )
    head = [scope["method"].encode() + b" " + target + b" HTTP/1.1", b"Host: " + UPSTREAM.encode()]
    head += [name + b": " + value for name, value in scope["headers"] if name not in SKIP]
    head.append(b"Content-Length: " + str(len(body)).encode())
    answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
    _queue().put_nowait((b"\r\n".join(head) + b"\r\n\r\n" + body, answer))
    try:
        status, content_type, content = await answer
    except Exception:
        status, content_type, content = 502, b"application/json", b'{"error":"upstream"}'
    headers = [(b"content-type", content_type), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_relay")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the model server")
    args = parser.parse_args()
    global UPSTREAM
    UPSTREAM = args.upstream
    import daphne.server  # installs Twisted's asyncio reactor
    from daphne.server import Server

    class RelayServer(Server):  # type: ignore[misc]  # daphne has no types
        def listen_success(self, port: object) -> None:
            super().listen_success(port)
            print(f"bare_relay: listening on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)

    assert daphne.server.twisted_loop is not None
    # The product's listen backlog (manage.py serve), so 1,001 connections are not refused.
    RelayServer(
        app, endpoints=[f"tcp:port={args.port}:interface=127.0.0.1:backlog=1024"], verbosity=0
    ).run()


if __name__ == "__main__":
    main()
