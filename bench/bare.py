"""The cost of daphne alone: an ASGI app with no framework that answers at once.

``python -m daphne -b 127.0.0.1 -p N bench.bare:app``: reads the request's body, answers
200 with a short JSON body. What every request served by daphne costs before Django, a
view or a relay do anything; ``bench/bench_gap.py`` measures its CPU time per request
beside the minimal relay (``bench/floor.py``) and the product.
"""

from __future__ import annotations

from typing import Any

BODY = b'{"ok":true}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})
