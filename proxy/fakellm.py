"""A simulated llama-server: the "model process" of the example config and the end-to-end tests.

Standard library asyncio only, so it starts in a few tens of milliseconds and idles at no CPU::

    python -m proxy.fakellm --port 5800 [--host 127.0.0.1] [--load-seconds 2]
        [--tokens-per-second 50] [--model-name NAME] [--log-requests] [--record-file PATH]

It speaks enough of llama-server's HTTP surface for a proxy to be tested against it:
``GET /health`` (503 while "loading", then 200), ``GET /v1/models``, OpenAI-shaped
``POST /v1/chat/completions``, ``/v1/completions``, llama.cpp's native ``/completion``,
``/v1/embeddings`` and multipart ``/v1/audio/transcriptions``; any other POST is echoed.

Test controls, read from the JSON body (real servers ignore unknown fields) or, when the body
does not have them, from ``X-Fake-*`` headers (``X-Fake-Delay``, ``X-Fake-Tokens``, ...):

``fake_delay``
    seconds to wait before answering (before the first streamed byte).
``fake_tokens``
    number of tokens to generate, overriding ``max_tokens`` (default 16).
``fake_tokens_per_second``
    generation pace for this request, overriding ``--tokens-per-second`` (0 = no pacing).
``fake_status``
    answer with this HTTP status and an OpenAI-shaped error body instead.
``fake_crash_after``
    when streaming, exit the whole process with ``os._exit(3)`` once this many token
    chunks are sent: a model that dies mid-stream. The stream never sees ``[DONE]``.

Every request except ``GET /health`` and ``/fake/*`` is recorded; ``GET /fake/requests``
returns the records in arrival order and ``POST /fake/reset`` clears them. Records live in
memory and die with the process; ``--record-file PATH`` also appends each record, as it
arrives, as one JSON line to PATH, so a test can read what a model received before it was
swapped out or crashed (there ``finished_at``/``status`` are always null). A record is
``{seq, method, path, model, body, headers, received_at, finished_at, status, disconnected}``
where ``body`` is the parsed JSON body (or ``{"bytes": n}`` for anything else),
``finished_at``/``status`` are null until the answer is complete, and ``disconnected``
says the client went away before the answer was complete.

The HTTP/1.1 server is hand-written and small: keep-alive, ``Content-Length`` and chunked
request bodies, chunked streaming responses, ``Expect: 100-continue``. No TLS, no pipelining
guarantees beyond "requests on one connection are answered in order".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_TOKENS = 16
EMBEDDING_DIM = 8
CRASH_EXIT_CODE = 3
WORDS = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "."]

REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    413: "Content Too Large",
    429: "Too Many Requests",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "unavailable_error",
}


class BadRequest(Exception):
    """The request cannot be parsed; answered with ``status`` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Request:
    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]
    """Lower-case names; repeated headers joined with ``", "``."""
    body: bytes = b""

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


def error_body(status: int, message: str) -> dict[str, Any]:
    """An OpenAI-shaped error, as llama-server sends it."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"code": status, "message": message, "type": kind}}


class Connection:
    """One client connection: buffered reads and HTTP/1.1 framing.

    All reads go through :meth:`_fill`, so the disconnect watcher can read ahead while a
    handler sleeps without losing the bytes of a next request.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.eof = False
        self.gone = asyncio.Event()
        """Set when the peer closed its side (or the socket failed)."""

    async def _fill(self) -> bool:
        try:
            data = await self.reader.read(65536)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
            self.gone.set()
            return False
        self.buf += data
        return True

    async def _read_until(self, sep: bytes, limit: int) -> bytes | None:
        start = 0
        while True:
            idx = self.buf.find(sep, start)
            if idx >= 0:
                end = idx + len(sep)
                data = bytes(self.buf[:end])
                del self.buf[:end]
                return data
            if len(self.buf) > limit:
                raise BadRequest(431 if sep == b"\r\n\r\n" else 400, "header or line too long")
            start = max(0, len(self.buf) - len(sep) + 1)
            if self.eof or not await self._fill():
                return None

    async def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if self.eof or not await self._fill():
                raise BadRequest(400, "body shorter than announced")
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def read_request(self) -> Request | None:
        """The next request, or None when the client closed the connection between requests."""
        while self.buf.startswith(b"\r\n"):  # tolerate stray CRLF between requests
            del self.buf[:2]
        head = await self._read_until(b"\r\n\r\n", MAX_HEADER_BYTES)
        if head is None:
            if self.buf.strip():
                raise BadRequest(400, "incomplete request head")
            return None
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise BadRequest(400, f"malformed request line {lines[0]!r}") from None
        if not version.startswith("HTTP/1."):
            raise BadRequest(505 if version.startswith("HTTP/") else 400, "unsupported version")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise BadRequest(400, f"malformed header line {line!r}")
            key = name.lower()
            value = value.strip()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        path, _, query = target.partition("?")
        request = Request(method.upper(), path, query, version, headers)

        if headers.get("expect", "").lower() == "100-continue":
            self.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            request.body = await self._read_chunked()
        elif "content-length" in headers:
            try:
                length = int(headers["content-length"])
            except ValueError:
                raise BadRequest(400, "invalid Content-Length") from None
            if length < 0 or length > MAX_BODY_BYTES:
                raise BadRequest(413, "body too large")
            request.body = await self._read_exact(length)
        return request

    async def _read_chunked(self) -> bytes:
        body = bytearray()
        while True:
            line = await self._read_until(b"\r\n", 1024)
            if line is None:
                raise BadRequest(400, "truncated chunked body")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise BadRequest(400, "invalid chunk size") from None
            if size == 0:
                break
            if len(body) + size > MAX_BODY_BYTES:
                raise BadRequest(413, "body too large")
            body += await self._read_exact(size)
            if await self._read_exact(2) != b"\r\n":
                raise BadRequest(400, "chunk not followed by CRLF")
        while True:  # trailers, up to the empty line
            line = await self._read_until(b"\r\n", MAX_HEADER_BYTES)
            if line is None or line == b"\r\n":
                return bytes(body)

    async def watch_peer(self) -> None:
        """Read ahead until the peer closes; sets :attr:`gone`. Run as a task while handling."""
        while len(self.buf) < MAX_HEADER_BYTES and not self.eof and await self._fill():
            pass

    async def pause(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when the client went away meanwhile."""
        if seconds > 0 and not self.gone.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.gone.wait(), seconds)
        return self.gone.is_set()

    # -- writing ---------------------------------------------------------------------------

    def _head(self, status: int, headers: dict[str, str], keep_alive: bool) -> bytes:
        lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", "Server: fakellm"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if not keep_alive:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def send(
        self, status: int, body: bytes, content_type: str, *, keep_alive: bool = True
    ) -> None:
        headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
        self.writer.write(self._head(status, headers, keep_alive) + body)
        await self.writer.drain()

    async def send_json(self, status: int, obj: Any, *, keep_alive: bool = True) -> None:
        body = json.dumps(obj).encode()
        await self.send(status, body, "application/json; charset=utf-8", keep_alive=keep_alive)

    async def start_stream(self, content_type: str = "text/event-stream") -> None:
        headers = {
            "Content-Type": content_type,
            "Cache-Control": "no-cache",
            "Transfer-Encoding": "chunked",
        }
        self.writer.write(self._head(200, headers, True))
        await self.writer.drain()

    async def send_chunk(self, data: bytes) -> None:
        self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await self.writer.drain()

    async def end_stream(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def count_tokens(value: Any) -> int:
    """A whitespace word count of the text in ``value``: a stand-in for a tokenizer."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, dict):  # a message or a content part: only the words count
        return sum(count_tokens(value.get(key)) for key in ("content", "text"))
    if isinstance(value, list):
        return sum(count_tokens(v) for v in value)
    return 0


def embed(text: str) -> list[float]:
    """A deterministic unit vector derived from the text."""
    digest = hashlib.sha256(text.encode()).digest()
    raw = [b - 127.5 for b in digest[:EMBEDDING_DIM]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


@dataclass
class Controls:
    delay: float = 0.0
    tokens: int | None = None
    tokens_per_second: float | None = None
    status: int | None = None
    crash_after: int | None = None


def read_controls(body: dict[str, Any], headers: dict[str, str]) -> Controls:
    def get(name: str, cast: type) -> Any:
        value = body.get(name)
        if value is None:
            value = headers.get("x-" + name.replace("_", "-"))
        if value is None:
            return None
        try:
            result = cast(value)
        except (TypeError, ValueError):
            raise BadRequest(400, f"{name} must be a {cast.__name__}") from None
        if result < 0:
            raise BadRequest(400, f"{name} must not be negative")
        return result

    return Controls(
        delay=get("fake_delay", float) or 0.0,
        tokens=get("fake_tokens", int),
        tokens_per_second=get("fake_tokens_per_second", float),
        status=get("fake_status", int),
        crash_after=get("fake_crash_after", int),
    )


class FakeLLM:
    """The application: routes requests on a :class:`Connection` and keeps the records."""

    def __init__(
        self,
        *,
        load_seconds: float = 0.0,
        tokens_per_second: float = 0.0,
        model_name: str = "",
        log_requests: bool = False,
        record_file: str = "",
    ) -> None:
        self.load_seconds = load_seconds
        self.tokens_per_second = tokens_per_second
        self.model_name = model_name
        self.log_requests = log_requests
        self.record_file = record_file
        self.started = time.monotonic()
        self.requests: list[dict[str, Any]] = []
        self.seq = itertools.count(1)
        self.ids = itertools.count(1)

    @property
    def loading(self) -> bool:
        return time.monotonic() - self.started < self.load_seconds

    def log(self, message: str) -> None:
        print(f"fakellm: {message}", file=sys.stderr, flush=True)

    async def handle_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        conn = Connection(reader, writer)
        try:
            while True:
                try:
                    request = await conn.read_request()
                except BadRequest as exc:
                    await conn.send_json(
                        exc.status, error_body(exc.status, exc.message), keep_alive=False
                    )
                    return
                if request is None:
                    return
                watcher = asyncio.create_task(conn.watch_peer())
                try:
                    await self.handle(conn, request)
                finally:
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher
                if not request.keep_alive or conn.gone.is_set():
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(self, conn: Connection, request: Request) -> None:
        started = time.monotonic()
        record: dict[str, Any] | None = None
        if request.path != "/health" and not request.path.startswith("/fake/"):
            record = {
                "seq": next(self.seq),
                "method": request.method,
                "path": request.path,
                "model": None,
                "body": {"bytes": len(request.body)},
                "headers": request.headers,
                "received_at": time.time(),
                "finished_at": None,
                "status": None,
                "disconnected": False,
            }
            if request.body and not request.headers.get("content-type", "").startswith(
                "multipart/"
            ):
                with contextlib.suppress(ValueError):
                    parsed = json.loads(request.body)
                    record["body"] = parsed
                    if isinstance(parsed, dict):
                        record["model"] = parsed.get("model")
            self.requests.append(record)
            if self.record_file:
                with open(self.record_file, "a") as f:
                    f.write(json.dumps(record) + "\n")
        status = await self.route(conn, request, record)
        if record is not None:
            record["finished_at"] = time.time()
            record["status"] = status
            record["disconnected"] = status is None or conn.gone.is_set()
        if self.log_requests:
            elapsed = time.monotonic() - started
            self.log(f"{request.method} {request.path} {status or 'disconnected'} {elapsed:.3f}s")

    async def route(
        self, conn: Connection, request: Request, record: dict[str, Any] | None
    ) -> int | None:
        """Answer the request; returns the status sent, or None if the client went away."""
        method, path, keep = request.method, request.path, request.keep_alive
        if path == "/fake/requests" and method == "GET":
            await conn.send_json(200, self.requests, keep_alive=keep)
            return 200
        if path == "/fake/reset" and method == "POST":
            self.requests.clear()
            await conn.send_json(200, {"ok": True}, keep_alive=keep)
            return 200
        if self.loading:
            await conn.send_json(503, error_body(503, "Loading model"), keep_alive=keep)
            return 503
        if path == "/health" and method == "GET":
            await conn.send_json(200, {"status": "ok"}, keep_alive=keep)
            return 200
        if path in ("/v1/models", "/models") and method == "GET":
            await conn.send_json(200, self.models_body(), keep_alive=keep)
            return 200
        if method != "POST":
            await conn.send_json(404, error_body(404, "File Not Found"), keep_alive=keep)
            return 404

        content_type = request.headers.get("content-type", "")
        if content_type.startswith("multipart/form-data"):
            return await self.multipart(conn, request, record)
        body: dict[str, Any] = {}
        if request.body.strip():
            try:
                parsed = json.loads(request.body)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                await conn.send_json(400, error_body(400, f"invalid JSON: {exc}"), keep_alive=keep)
                return 400
            if not isinstance(parsed, dict):
                await conn.send_json(
                    400, error_body(400, "the body must be a JSON object"), keep_alive=keep
                )
                return 400
            body = parsed
        try:
            controls = read_controls(body, request.headers)
        except BadRequest as exc:
            await conn.send_json(exc.status, error_body(exc.status, exc.message), keep_alive=keep)
            return exc.status

        if await conn.pause(controls.delay):
            return None
        if controls.status is not None and controls.status != 200:
            message = f"fake_status {controls.status}"
            await conn.send_json(
                controls.status, error_body(controls.status, message), keep_alive=keep
            )
            return controls.status

        model = body.get("model") or self.model_name or "fakellm"
        if path == "/v1/chat/completions":
            return await self.generate(conn, request, body, controls, model, "chat")
        if path == "/v1/completions":
            return await self.generate(conn, request, body, controls, model, "text")
        if path == "/completion":
            return await self.generate(conn, request, body, controls, model, "native")
        if path == "/v1/embeddings":
            return await self.embeddings(conn, body, model, keep)
        await conn.send_json(200, {"path": path, "ok": True}, keep_alive=keep)
        return 200

    def models_body(self) -> dict[str, Any]:
        name = self.model_name or "fakellm"
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": int(self.started), "owned_by": "fakellm"}
            ],
        }

    async def embeddings(
        self, conn: Connection, body: dict[str, Any], model: str, keep: bool
    ) -> int:
        inputs = body.get("input", "")
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
            await conn.send_json(
                400, error_body(400, "input must be a string or a list of strings"), keep_alive=keep
            )
            return 400
        n = max(1, count_tokens(inputs))
        await conn.send_json(
            200,
            {
                "object": "list",
                "model": model,
                "data": [
                    {"object": "embedding", "index": i, "embedding": embed(text)}
                    for i, text in enumerate(inputs)
                ],
                "usage": {"prompt_tokens": n, "total_tokens": n},
            },
            keep_alive=keep,
        )
        return 200

    async def multipart(
        self, conn: Connection, request: Request, record: dict[str, Any] | None
    ) -> int:
        from email.parser import BytesParser  # only here: keeps start-up fast
        from email.policy import HTTP

        head = f"Content-Type: {request.headers['content-type']}\r\n\r\n".encode("latin-1")
        message = BytesParser(policy=HTTP).parsebytes(head + request.body)
        fields: dict[str, str] = {}
        files: dict[str, int] = {}
        if message.is_multipart():
            for part in message.iter_parts():
                name = part.get_param("name", header="content-disposition") or ""
                payload = part.get_payload(decode=True)
                data = payload if isinstance(payload, bytes) else b""
                filename = part.get_filename()
                if filename:
                    files[filename] = len(data)
                else:
                    fields[str(name)] = data.decode("utf-8", "replace")
        if record is not None:
            record["body"] = {"fields": fields, "files": files}
            record["model"] = fields.get("model")
        keep = request.keep_alive
        if request.path.endswith("/audio/transcriptions"):
            described = ", ".join(f"{name} ({size} bytes)" for name, size in files.items())
            await conn.send_json(
                200, {"text": f"fake transcription of {described or 'nothing'}"}, keep_alive=keep
            )
        else:
            await conn.send_json(200, {"path": request.path, "ok": True}, keep_alive=keep)
        return 200

    async def generate(
        self,
        conn: Connection,
        request: Request,
        body: dict[str, Any],
        controls: Controls,
        model: str,
        kind: str,
    ) -> int | None:
        """Chat, OpenAI text and llama.cpp native completions, streaming or not."""
        prompt = body.get("messages") if kind == "chat" else body.get("prompt", "")
        prompt_n = max(1, count_tokens(prompt))
        limit = body.get("n_predict") if kind == "native" else None
        limit = limit if limit is not None else body.get("max_completion_tokens")
        limit = limit if limit is not None else body.get("max_tokens")
        if controls.tokens is not None:
            n, finish = controls.tokens, "stop"
        elif isinstance(limit, int) and limit >= 0:
            n, finish = limit, "length"
        else:
            n, finish = DEFAULT_TOKENS, "stop"
        tps = controls.tokens_per_second
        tps = self.tokens_per_second if tps is None else tps
        interval = 1.0 / tps if tps > 0 else 0.0
        ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-fake{next(self.ids)}"
        created = int(time.time())
        tokens = [WORDS[i % len(WORDS)] + " " for i in range(n)]

        def timings(elapsed: float) -> dict[str, float]:
            prompt_ms = prompt_n * 0.1
            predicted_ms = max(elapsed * 1000.0, n * 0.01, 0.001)
            return {
                "prompt_n": prompt_n,
                "prompt_ms": round(prompt_ms, 3),
                "prompt_per_second": round(prompt_n / prompt_ms * 1000.0, 3),
                "predicted_n": n,
                "predicted_ms": round(predicted_ms, 3),
                "predicted_per_second": round(n / predicted_ms * 1000.0, 3),
            }

        usage = {"prompt_tokens": prompt_n, "completion_tokens": n, "total_tokens": prompt_n + n}

        if not body.get("stream"):
            began = time.monotonic()
            if await conn.pause(interval * n):
                return None
            text = "".join(tokens)
            result: dict[str, Any]
            if kind == "native":
                result = {
                    "content": text,
                    "model": model,
                    "stop": True,
                    "tokens_predicted": n,
                    "tokens_evaluated": prompt_n,
                    "timings": timings(time.monotonic() - began),
                }
            else:
                if kind == "chat":
                    choice: dict[str, Any] = {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                    }
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                result = {
                    "id": ident,
                    "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": created,
                    "model": model,
                    "system_fingerprint": "fakellm",
                    "choices": [choice],
                    "usage": usage,
                    "timings": timings(time.monotonic() - began),
                }
            await conn.send_json(200, result, keep_alive=request.keep_alive)
            return 200

        def chunk(delta: str | None, finish_reason: str | None) -> dict[str, Any]:
            if kind == "native":
                return {"content": delta or "", "stop": finish_reason is not None}
            if kind == "chat":
                choice = {
                    "index": 0,
                    "delta": {} if delta is None else {"content": delta},
                    "finish_reason": finish_reason,
                }
            else:
                choice = {
                    "index": 0,
                    "text": delta or "",
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            return {
                "id": ident,
                "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": created,
                "model": model,
                "system_fingerprint": "fakellm",
                "choices": [choice],
            }

        async def crash_if_due(sent: int) -> None:
            if controls.crash_after is not None and sent >= controls.crash_after:
                self.log(f"crashing after {sent} chunks (fake_crash_after)")
                with contextlib.suppress(ConnectionError, OSError):
                    await conn.writer.drain()
                os._exit(CRASH_EXIT_CODE)

        await conn.start_stream()
        began = time.monotonic()
        if kind == "chat":
            first = chunk(None, None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": None}
            await conn.send_chunk(sse(first))
        for i, token in enumerate(tokens):
            await crash_if_due(i)
            if i and await conn.pause(interval):
                return None
            if conn.gone.is_set():
                return None
            await conn.send_chunk(sse(chunk(token, None)))
        await crash_if_due(n)
        last = chunk(None, finish)
        last["timings"] = timings(time.monotonic() - began)
        if kind == "native":
            last.update(model=model, tokens_predicted=n, tokens_evaluated=prompt_n)
        await conn.send_chunk(sse(last))
        options = body.get("stream_options") or {}
        if kind != "native" and isinstance(options, dict) and options.get("include_usage"):
            tail = chunk(None, None)
            tail["choices"] = []
            tail["usage"] = usage
            tail["timings"] = last["timings"]
            await conn.send_chunk(sse(tail))
        if kind != "native":  # llama.cpp's native /completion stream has no [DONE]
            await conn.send_chunk(b"data: [DONE]\n\n")
        await conn.end_stream()
        return 200


async def serve(args: argparse.Namespace) -> None:
    app = FakeLLM(
        load_seconds=args.load_seconds,
        tokens_per_second=args.tokens_per_second,
        model_name=args.model_name,
        log_requests=args.log_requests,
        record_file=args.record_file,
    )
    server = await asyncio.start_server(app.handle_connection, args.host, args.port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app.log(
        f"listening on http://{args.host}:{args.port} pid={os.getpid()} "
        f"model={args.model_name or '-'} load_seconds={args.load_seconds}"
    )
    if args.load_seconds > 0:
        loop.call_later(args.load_seconds, app.log, "model loaded")
    else:
        app.log("model loaded")
    async with server:
        await stop.wait()
    app.log("shutting down")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m proxy.fakellm", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--load-seconds", type=float, default=0.0)
    parser.add_argument("--tokens-per-second", type=float, default=0.0)
    parser.add_argument("--model-name", default="")
    parser.add_argument("--log-requests", action="store_true")
    parser.add_argument("--record-file", default="", help="append each request as a JSON line")
    asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
