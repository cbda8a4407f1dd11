"""A tiny websocket model server for the passthrough tests (``python -m tests.ws_model
--port P``): ``GET /health`` over HTTP, and on any other path a websocket that

* first sends ``{"hello": {path, subprotocol, headers}}`` (what the handshake carried);
* echoes every text or binary message as it came;
* on ``close:CODE:REASON`` closes with that code and reason;
* on ``big:N`` sends N bytes in one binary message;
* on ``burst:N:SIZE`` sends N binary messages of SIZE bytes at once, each starting with its
  index (4 bytes, big-endian).

``GET /last-close`` answers the close code (and reason) the last client closed with; any
other plain HTTP request ``plain HTTP`` with the path it arrived at in ``X-Path``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

last_close: dict[str, object] = {}


def http(connection: ServerConnection, request: Request) -> Response | None:
    if request.path == "/health":
        return connection.respond(HTTPStatus.OK, "OK\n")
    if request.path == "/last-close":
        return connection.respond(HTTPStatus.OK, json.dumps(last_close) + "\n")
    if request.path.startswith("/refuse"):
        return connection.respond(HTTPStatus.NOT_FOUND, "no websocket here\n")
    if "upgrade" not in request.headers.get("Connection", "").lower():
        response = connection.respond(HTTPStatus.OK, "plain HTTP\n")
        response.headers["X-Path"] = request.path  # as it arrived: encoded, with the query
        return response
    return None


async def session(ws: ServerConnection) -> None:
    request = ws.request
    assert request is not None
    headers = {k.lower(): v for k, v in request.headers.raw_items()}
    await ws.send(
        json.dumps(
            {"hello": {"path": request.path, "subprotocol": ws.subprotocol, "headers": headers}}
        )
    )
    try:
        async for message in ws:
            if isinstance(message, str) and message.startswith("close:"):
                _, code, reason = message.split(":", 2)
                await ws.close(int(code), reason)
                return
            if isinstance(message, str) and message.startswith("big:"):
                await ws.send(b"x" * int(message[4:]))
                continue
            if isinstance(message, str) and message.startswith("burst:"):
                _, count, size = message.split(":")
                for index in range(int(count)):
                    await ws.send(index.to_bytes(4, "big") + b"x" * (int(size) - 4))
                continue
            await ws.send(message)
    finally:
        received = ws.protocol.close_rcvd
        last_close.clear()
        if received is not None:
            last_close.update(code=received.code, reason=received.reason)


def pick(connection: ServerConnection, offered: list[str]) -> str | None:
    """The first offered subprotocol this server speaks; none offered is fine too."""
    return next((p for p in offered if p in ("comfy", "chat")), None)


async def main(port: int) -> None:
    async with serve(
        session,
        "127.0.0.1",
        port,
        process_request=http,
        select_subprotocol=pick,  # type: ignore[arg-type]
        max_size=None,
        compression=None,
    ) as server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(main(parser.parse_args().port))
