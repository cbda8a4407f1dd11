"""llama-swap's logs: ``GET /logs`` (the proxy's lines and the models' output, in the
order they were written: llama-swap's combined log), ``GET /logs/stream`` (every model's output, ``[model]``
prefixed), ``/logs/stream/upstream`` (the same: llama-swap's upstream log),
``/logs/stream/proxy`` (llamaswap's own lines, :mod:`scheduler.proxylog`) and
``/logs/stream/{model}`` (one model's output as it printed it; ids may hold ``/``).

Chunked text: what the buffer holds first (unless ``?no-history``), then live lines. Each
reader has its own bounded queue (:class:`scheduler.logbuffer.LogSubscription`): one that
does not read loses lines, never slows the models.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse

from scheduler import proxylog
from scheduler.logbuffer import LogBuffer
from web.errors import echo, error_response
from web.runtime import runtime_of

_TEXT = "text/plain; charset=utf-8"


def stream(request: HttpRequest, buffer: LogBuffer, model: str | None = None) -> HttpResponseBase:
    """``buffer``'s lines (of ``model`` only when given) as a chunked text response."""
    if request.method == "HEAD":  # the headers only: no stream that never ends
        head = HttpResponse(content_type=_TEXT)
        head["X-Accel-Buffering"] = "no"
        return head
    with_history = "no-history" not in request.GET

    async def lines() -> AsyncIterator[bytes]:
        subscription = buffer.subscribe(model)
        try:
            yield b""  # headers now (daphne sends them with the first body write)
            if with_history:
                history = buffer.history(model)
                if history:
                    yield history
            async for chunk in subscription:
                yield chunk
        finally:
            buffer.unsubscribe(subscription)

    response = StreamingHttpResponse(lines(), content_type=_TEXT)
    response["X-Accel-Buffering"] = "no"
    return response


def combined_history(upstream: LogBuffer, proxy: LogBuffer) -> bytes:
    """Both buffers' lines in the order they were written (their sequence numbers): the
    proxy's as they are, each model's ``[model]`` prefixed."""
    lines = sorted(
        [(seq, b"[" + model.encode() + b"] " + line) for seq, _, model, line in upstream.since(0)]
        + [(seq, line) for seq, _, _, line in proxy.since(0)]
    )
    return b"".join(line for _, line in lines)


async def logs(request: HttpRequest) -> HttpResponse:
    """GET /logs: the combined log as text."""
    text = combined_history(runtime_of(request).dispatcher.logs, proxylog.proxy_log)
    return HttpResponse(text, content_type="text/plain")


async def logs_stream(request: HttpRequest) -> HttpResponseBase:
    """GET /logs/stream and /logs/stream/upstream: every model's output."""
    return stream(request, runtime_of(request).dispatcher.logs)


async def proxy_stream(request: HttpRequest) -> HttpResponseBase:
    """GET /logs/stream/proxy: llamaswap's own log lines."""
    return stream(request, proxylog.proxy_log)


async def model_stream(request: HttpRequest, model_name: str) -> HttpResponseBase:
    """GET /logs/stream/{model}: one model's output (a name or an alias; 404 otherwise)."""
    rt = runtime_of(request)
    model = rt.config.resolve(model_name)
    if model is None:
        return error_response(404, f"model {echo(model_name)} not found", code="model_not_found")
    return stream(request, rt.dispatcher.logs, model.id)
