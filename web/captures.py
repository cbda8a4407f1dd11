"""Request/response captures (llama-swap's ``captureBuffer``), bounded in memory.

With ``captureBuffer: N`` (MB; 0, the default here, keeps nothing), each answered request
relayed to a local model leaves a capture: its path, headers (credentials and cookies
``[REDACTED]``, as llama-swap does) and body, and the response's headers and body. The
store holds at most N MB of them (bodies and header text counted); the oldest go first,
and a capture bigger than the whole budget is not kept. ``GET /api/captures/{id}`` reads
one by the request's id or by its activity row's id.

Kept uncompressed: compressing on the event loop would cost every request CPU there
(llama-swap compresses with zstd in a goroutine); the bound is on what is kept, so N MB
hold fewer captures than llama-swap's. Bodies whose media llama-swap does not capture
(audio and images) are left out as it leaves them out (:data:`FIELDS_BY_PATH`).
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SENSITIVE = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie", "x-api-key"})
REDACTED = "[REDACTED]"

REQ_HEADERS, REQ_BODY, RESP_HEADERS, RESP_BODY = 1, 2, 4, 8
ALL = REQ_HEADERS | REQ_BODY | RESP_HEADERS | RESP_BODY
FIELDS_BY_PATH = {
    "/v1/audio/speech": REQ_HEADERS | REQ_BODY | RESP_HEADERS,
    "/v1/audio/voices": REQ_HEADERS | RESP_HEADERS | RESP_BODY,
    "/v1/audio/transcriptions": REQ_HEADERS | RESP_HEADERS | RESP_BODY,
    "/v1/images/generations": REQ_HEADERS | REQ_BODY | RESP_HEADERS,
    "/v1/images/edits": REQ_HEADERS | RESP_HEADERS,
    "/sdapi/v1/txt2img": REQ_HEADERS | REQ_BODY | RESP_HEADERS,
    "/sdapi/v1/img2img": REQ_HEADERS | RESP_HEADERS,
}
"""What llama-swap keeps of routes with large binary bodies (all of any other route)."""


def fields_for(path: str) -> int:
    return FIELDS_BY_PATH.get(path, ALL)


@dataclass
class Capture:
    request_id: str
    req_path: str
    req_headers: dict[str, str]
    req_body: bytes
    resp_headers: dict[str, str]
    resp_body: bytes

    @property
    def size(self) -> int:
        text = sum(
            len(k) + len(v) for k, v in (*self.req_headers.items(), *self.resp_headers.items())
        )
        return len(self.req_body) + len(self.resp_body) + text + len(self.req_path) + 64

    def as_json(self, row_id: int | None) -> dict[str, Any]:
        """llama-swap's shape: bodies base64 (Go's ``[]byte``), ``null`` when not kept."""

        def b64(data: bytes) -> str | None:
            return base64.b64encode(data).decode() if data else None

        return {
            "id": row_id if row_id is not None else 0,
            "request_id": self.request_id,
            "req_path": self.req_path,
            "req_headers": self.req_headers,
            "req_body": b64(self.req_body),
            "resp_headers": self.resp_headers,
            "resp_body": b64(self.resp_body),
        }


def header_map(headers: Iterable[tuple[bytes | str, bytes | str]]) -> dict[str, str]:
    """The first value of each header, credentials redacted (llama-swap's map)."""
    out: dict[str, str] = {}
    for key, value in headers:
        name = key.decode("latin-1") if isinstance(key, bytes) else key
        if name in out:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        out[name] = REDACTED if name.lower() in SENSITIVE else text
    return out


class CaptureStore:
    """Captures by request id, oldest evicted first, at most ``limit`` bytes in all."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self.used = 0
        self._items: OrderedDict[str, Capture] = OrderedDict()

    def resize(self, limit: int) -> None:
        self.limit = limit
        self._trim()

    def add(self, capture: Capture) -> bool:
        size = capture.size
        if size > self.limit:
            return False
        old = self._items.pop(capture.request_id, None)
        if old is not None:
            self.used -= old.size
        self._items[capture.request_id] = capture
        self.used += size
        self._trim()
        return True

    def get(self, request_id: str) -> Capture | None:
        return self._items.get(request_id)

    def has(self, request_id: str) -> bool:
        return request_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def _trim(self) -> None:
        while self.used > self.limit and self._items:
            _, old = self._items.popitem(last=False)
            self.used -= old.size


store = CaptureStore()
"""The server's captures (sized by ``captureBuffer`` when a config is applied)."""


def limit_bytes(config: Any) -> int:
    return int(getattr(config, "capture_buffer_mb", 0)) * 1024 * 1024


def has(request_id: str) -> bool:
    return store.has(request_id)


def enabled(config: Any) -> bool:
    """Does ``config`` ask for captures? (The store follows its ``captureBuffer``.)"""
    limit = limit_bytes(config)
    if limit != store.limit:
        store.resize(limit)
    return limit > 0


def keep(
    request_id: str,
    path: str,
    req_headers: Iterable[tuple[bytes, bytes]],
    req_body: bytes,
    resp_headers: Iterable[tuple[str, str]],
    resp_body: bytes,
) -> bool:
    """Store one exchange's capture (what :data:`FIELDS_BY_PATH` says of its path)."""
    fields = fields_for(path)
    return store.add(
        Capture(
            request_id=request_id,
            req_path=path,
            req_headers=header_map(req_headers) if fields & REQ_HEADERS else {},
            req_body=req_body if fields & REQ_BODY else b"",
            resp_headers=header_map(resp_headers) if fields & RESP_HEADERS else {},
            resp_body=resp_body if fields & RESP_BODY else b"",
        )
    )
