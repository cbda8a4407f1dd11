"""The simulated llama-server as one ASGI application: ``create_app(State(...))``.

It speaks enough of llama-server's HTTP surface for a proxy to be tested against it:
``GET /health`` (503 while "loading", then 200), ``GET /v1/models``, OpenAI-shaped
``POST /v1/chat/completions``, ``/v1/completions``, llama.cpp's native ``/completion``,
``/v1/embeddings`` and multipart ``/v1/audio/transcriptions``, ``GET /slots`` (the last
request received, headers and body: what llama-server's shows of other clients); any other
POST is echoed.

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

HTTP itself (keep-alive, chunked bodies, ``Expect: 100-continue``) is the server's business:
``python -m fakellm`` runs this application under daphne. Standard library only here.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

DEFAULT_TOKENS = 16
EMBEDDING_DIM = 8
CRASH_EXIT_CODE = 3
CRASH_FLUSH_SECONDS = 0.05
"""Before ``os._exit``, the event loop gets this long to write the chunks already sent
(the server buffers writes until its next loop turn), as a crashed llama-server's last
writes are already in the kernel."""
UNPACED_YIELD_EVERY = 16
WATCHED_PAUSE = 0.05
"""Paced waits from this long on return as soon as the client goes away; shorter ones are
plain sleeps."""
"""An unpaced stream lets the server write (and notice a disconnect) every this many chunks."""
WORDS = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "."]
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "unavailable_error",
}
JSON_HEADERS = [(b"content-type", b"application/json; charset=utf-8")]
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class BadRequest(Exception):
    """A control or body that cannot be used; answered with ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class State:
    """The server's settings (the command-line flags) and what it has recorded."""

    load_seconds: float = 0.0
    tokens_per_second: float = 0.0
    model_name: str = ""
    log_requests: bool = False
    record_file: str = ""
    started: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))
    requests: list[dict[str, Any]] = field(default_factory=list)
    seq: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def loading(self) -> bool:
        return time.monotonic() - self.started < self.load_seconds


def log(message: str) -> None:
    print(f"fakellm: {message}", file=sys.stderr, flush=True)


def error_body(status: int, message: str) -> dict[str, Any]:
    """An OpenAI-shaped error, as llama-server sends it."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"code": status, "message": message, "type": kind}}


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


class Exchange:
    """One request and its answer over ASGI ``receive``/``send``.

    After the body is read, ``receive()`` only ever returns ``http.disconnect``: a watcher
    task waits for it (started by :meth:`pause` and :meth:`start_stream`, the only places a
    request can outlive its client) and sets :attr:`gone`.
    """

    __slots__ = ("method", "path", "headers", "receive", "send", "gone", "done", "watcher")

    def __init__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self.method: str = scope["method"].upper()
        self.path: str = scope["path"]
        headers: dict[str, str] = {}
        for raw_name, raw_value in scope["headers"]:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self.headers = headers
        """Lower-case names; repeated headers joined with ``", "``."""
        self.receive = receive
        self.send = send
        self.gone = asyncio.Event()
        """Set when the client went away before the answer was complete."""
        self.done = False
        self.watcher: asyncio.Future[None] | None = None

    async def read_body(self) -> bytes | None:
        """The whole request body, or None when the client left first."""
        chunks = []
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def watch(self) -> None:
        if self.watcher is None:
            self.watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        if not self.done:  # daphne also says disconnect once the answer is complete
            self.gone.set()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()

    async def pause(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when the client went away meanwhile."""
        if seconds > 0 and not self.gone.is_set():
            self.watch()
            try:
                await asyncio.wait_for(self.gone.wait(), seconds)
            except TimeoutError:
                pass
        return self.gone.is_set()

    async def send_json(self, status: int, obj: Any) -> int:
        body = json.dumps(obj).encode()
        headers = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        self.done = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})
        return status

    async def start_stream(self) -> None:
        self.watch()
        await self.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def send_chunk(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self) -> None:
        self.done = True
        await self.send({"type": "http.response.body", "body": b""})


def create_app(state: State) -> App:
    """The ASGI application serving ``state`` (HTTP scopes only)."""

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        ex = Exchange(scope, receive, send)
        try:
            await handle(state, ex)
        except Exception:
            traceback.print_exc()
            if not ex.done:
                await ex.send_json(500, error_body(500, "fakellm failed; see its stderr"))
        finally:
            ex.close()

    return app


async def handle(state: State, ex: Exchange) -> None:
    started = time.monotonic()
    body = await ex.read_body()
    record: dict[str, Any] | None = None
    if ex.path != "/health" and not ex.path.startswith("/fake/"):
        record = {
            "seq": next(state.seq),
            "method": ex.method,
            "path": ex.path,
            "model": None,
            "body": {"bytes": len(body or b"")},
            "headers": ex.headers,
            "received_at": time.time(),
            "finished_at": None,
            "status": None,
            "disconnected": False,
        }
        if body and not ex.headers.get("content-type", "").startswith("multipart/"):
            try:
                parsed = json.loads(body)
            except ValueError:
                pass
            else:
                record["body"] = parsed
                if isinstance(parsed, dict):
                    record["model"] = parsed.get("model")
        state.requests.append(record)
        if state.record_file:
            with open(state.record_file, "a") as f:
                f.write(json.dumps(record) + "\n")
    status = None if body is None else await route(state, ex, body, record)
    if record is not None:
        record["finished_at"] = time.time()
        record["status"] = status
        record["disconnected"] = status is None or ex.gone.is_set()
    if state.log_requests:
        elapsed = time.monotonic() - started
        log(f"{ex.method} {ex.path} {status or 'disconnected'} {elapsed:.3f}s")


async def route(
    state: State, ex: Exchange, raw: bytes, record: dict[str, Any] | None
) -> int | None:
    """Answer the request; returns the status sent, or None if the client went away."""
    method, path = ex.method, ex.path
    if path == "/fake/requests" and method == "GET":
        return await ex.send_json(200, state.requests)
    if path == "/fake/reset" and method == "POST":
        state.requests.clear()
        return await ex.send_json(200, {"ok": True})
    if state.loading:
        return await ex.send_json(503, error_body(503, "Loading model"))
    if path == "/health" and method == "GET":
        return await ex.send_json(200, {"status": "ok"})
    if path in ("/v1/models", "/models") and method == "GET":
        return await ex.send_json(200, models_body(state))
    if path == "/slots" and method == "GET":
        # llama-server's operator endpoint: what each slot holds, other clients' prompts too.
        last = next((r for r in reversed(state.requests) if r["path"] != "/slots"), None)
        return await ex.send_json(200, [{"id": 0, "is_processing": False, "last": last}])
    if method != "POST":
        return await ex.send_json(404, error_body(404, "File Not Found"))

    if ex.headers.get("content-type", "").startswith("multipart/form-data"):
        return await multipart(ex, raw, record)
    body: dict[str, Any] = {}
    if raw.strip():
        try:
            parsed = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return await ex.send_json(400, error_body(400, f"invalid JSON: {exc}"))
        if not isinstance(parsed, dict):
            return await ex.send_json(400, error_body(400, "the body must be a JSON object"))
        body = parsed
    try:
        controls = read_controls(body, ex.headers)
    except BadRequest as exc:
        return await ex.send_json(exc.status, error_body(exc.status, exc.message))

    if await ex.pause(controls.delay):
        return None
    if controls.status is not None and controls.status != 200:
        message = f"fake_status {controls.status}"
        return await ex.send_json(controls.status, error_body(controls.status, message))

    model = body.get("model") or state.model_name or "fakellm"
    if path == "/v1/chat/completions":
        return await generate(state, ex, body, controls, model, "chat")
    if path == "/v1/completions":
        return await generate(state, ex, body, controls, model, "text")
    if path == "/completion":
        return await generate(state, ex, body, controls, model, "native")
    if path == "/v1/embeddings":
        return await embeddings(ex, body, model)
    return await ex.send_json(200, {"path": path, "ok": True})


def models_body(state: State) -> dict[str, Any]:
    name = state.model_name or "fakellm"
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": state.created, "owned_by": "fakellm"}],
    }


async def embeddings(ex: Exchange, body: dict[str, Any], model: str) -> int:
    inputs = body.get("input", "")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        return await ex.send_json(
            400, error_body(400, "input must be a string or a list of strings")
        )
    n = max(1, count_tokens(inputs))
    return await ex.send_json(
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
    )


async def multipart(ex: Exchange, raw: bytes, record: dict[str, Any] | None) -> int:
    fields, files = parse_multipart(ex.headers["content-type"], raw)
    if record is not None:
        record["body"] = {"fields": fields, "files": files}
        record["model"] = fields.get("model")
    if ex.path.endswith("/audio/transcriptions"):
        described = ", ".join(f"{name} ({size} bytes)" for name, size in files.items())
        return await ex.send_json(200, {"text": f"fake transcription of {described or 'nothing'}"})
    return await ex.send_json(200, {"path": ex.path, "ok": True})


def _params(header: str) -> dict[str, str]:
    """``name="value"`` parameters of a Content-Type or Content-Disposition header."""
    params = {}
    for part in header.split(";")[1:]:
        key, sep, value = part.strip().partition("=")
        if sep:
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = value[1:-1].replace('\\"', '"')
            params[key.strip().lower()] = value
    return params


def parse_multipart(content_type: str, raw: bytes) -> tuple[dict[str, str], dict[str, int]]:
    """The text fields, and each file's size by file name, of a multipart/form-data body.

    Found by searching for the boundary: a file's bytes are measured, never copied (an
    upload of many megabytes costs the simulated server next to nothing)."""
    fields: dict[str, str] = {}
    files: dict[str, int] = {}
    boundary = _params(content_type).get("boundary", "")
    if not boundary:
        return fields, files
    delimiter = b"--" + boundary.encode("latin-1")
    pos = raw.find(delimiter)
    while pos >= 0:
        start = pos + len(delimiter)
        if raw[start : start + 2] == b"--":
            break
        head_end = raw.find(b"\r\n\r\n", start)
        if head_end < 0:
            break
        end = raw.find(b"\r\n" + delimiter, head_end + 4)
        if end < 0:
            break
        disposition = ""
        for line in raw[start:head_end].decode("latin-1").split("\r\n"):
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-disposition":
                disposition = value
        params = _params(disposition)
        if "filename" in params:
            files[params["filename"]] = end - (head_end + 4)
        else:
            fields[params.get("name", "")] = raw[head_end + 4 : end].decode("utf-8", "replace")
        pos = end + 2
    return fields, files


async def generate(
    state: State,
    ex: Exchange,
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
    tps = state.tokens_per_second if tps is None else tps
    interval = 1.0 / tps if tps > 0 else 0.0
    ident = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-fake{next(state.ids)}"
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
        if await ex.pause(interval * n):
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
        return await ex.send_json(200, result)

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
            log(f"crashing after {sent} chunks (fake_crash_after)")
            await asyncio.sleep(CRASH_FLUSH_SECONDS)  # the chunks sent reach the socket
            os._exit(CRASH_EXIT_CODE)

    await ex.start_stream()
    began = time.monotonic()
    if kind == "chat":
        first = chunk(None, None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": None}
        await ex.send_chunk(sse(first))
    due = began
    for i, token in enumerate(tokens):
        await crash_if_due(i)
        if interval:
            if i:
                # On a schedule (``interval`` apart from the first token), so that the pace
                # holds however long a send takes. A short wait is a plain sleep (no task
                # per token); a client gone meanwhile shows at the next token.
                due += interval
                delay = due - time.monotonic()
                if delay >= WATCHED_PAUSE:
                    if await ex.pause(delay):
                        return None
                else:
                    ex.watch()
                    await asyncio.sleep(max(delay, 0.0))
        elif i % UNPACED_YIELD_EVERY == 0:
            await asyncio.sleep(0)  # the server writes what was sent; a disconnect shows
        if ex.gone.is_set():
            return None
        await ex.send_chunk(sse(chunk(token, None)))
    await crash_if_due(n)
    last = chunk(None, finish)
    last["timings"] = timings(time.monotonic() - began)
    if kind == "native":
        last.update(model=model, tokens_predicted=n, tokens_evaluated=prompt_n)
    await ex.send_chunk(sse(last))
    options = body.get("stream_options") or {}
    if kind != "native" and isinstance(options, dict) and options.get("include_usage"):
        tail = chunk(None, None)
        tail["choices"] = []
        tail["usage"] = usage
        tail["timings"] = last["timings"]
        await ex.send_chunk(sse(tail))
    if kind != "native":  # llama.cpp's native /completion stream has no [DONE]
        await ex.send_chunk(b"data: [DONE]\n\n")
    await ex.end_stream()
    return 200
