"""``python -m bench.stages ARGS...``: ``manage.py serve ARGS...`` with stage stamps.

For the dispatch-gap breakdown (bench/bench_gap.py). Wraps, at class level and only in
this process, the points a serial job change passes through, and notes
``time.monotonic_ns()`` at each (the model server notes the same clock):

``read``
    the proxy has the whole upstream answer (``Turn.note`` with an outcome);
``finish``
    ``Dispatcher.finish`` (the turn's end is posted to the dispatcher);
``handle``
    the dispatcher task takes that event from its inbox;
``pick`` / ``picked``
    the queue's ``pick`` (``LaneQueues``, or ``WaitingQueue`` before lanes) starts /
    returns the next request;
``grant``
    ``Dispatcher._grant`` (the ticket's future gets its result);
``turned``
    ``Dispatcher._start_turn`` returns (its log line and observers done);
``resume``
    the granted view's ``Turn.wait()`` returns;
``write``
    the next request starts being written to the upstream socket.

Durations, each noted as a ``*0``/``*1`` pair around the call: ``log`` (each call of the
dispatcher's logger, the arguments already built), ``fields`` (``Dispatcher._fields``, the
log line's fields), ``notify`` (the observers' callbacks), ``add`` (a new arrival filed
in the queue's ``add``), ``gc`` (a cyclic garbage collection, from ``gc.callbacks``), ``snapshot``
(the dashboard's live snapshot, built every 0.1 s while a dashboard is open) and
``record`` (a batch of the activity log written in Django's worker thread).

At exit the stamps go to the file named by ``BENCH_STAGES_OUT`` as JSON lines
``[kind, ns]``. Each wrapper costs one clock read and a list append.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any

EVENTS: list[tuple[str, int]] = []
GC_STATS: dict[int, tuple[int, int]] = {}
"""Per generation: collections, nanoseconds in all."""


def _stamp(kind: str) -> None:
    EVENTS.append((kind, time.monotonic_ns()))


def _queue_class() -> Any:
    """What the dispatcher picks from: the lanes' queues where there are lanes."""
    try:
        from scheduler.core.lanes import LaneQueues
    except ImportError:
        from scheduler.core.queue import WaitingQueue

        return WaitingQueue
    return LaneQueues


def install() -> None:
    from proxy.turn import Turn
    from scheduler.dispatch_state import Finished
    from scheduler.dispatcher import Dispatcher, Outcome

    def wrap(cls: Any, name: str, before: str | None = None, after: str | None = None) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before:
                _stamp(before)
            result = original(*args, **kwargs)
            if after:
                _stamp(after)
            return result

        setattr(cls, name, wrapper)

    note = Turn.note

    def noted(self: Turn, outcome: Outcome, *args: Any, **kwargs: Any) -> None:
        if outcome is Outcome.COMPLETED:
            _stamp("read")
        note(self, outcome, *args, **kwargs)

    Turn.note = noted  # type: ignore[method-assign]
    wrap(Dispatcher, "finish", before="finish")
    handle = Dispatcher._handle

    def handled(self: Dispatcher, event: object) -> None:
        if isinstance(event, Finished):
            _stamp("handle")
        handle(self, event)

    Dispatcher._handle = handled  # type: ignore[method-assign]
    wrap(_queue_class(), "pick", before="pick", after="picked")
    wrap(Dispatcher, "_grant", before="grant")
    wrap(Dispatcher, "_start_turn", after="turned")
    wait = Turn.wait

    async def waited(self: Turn) -> str:
        url = await wait(self)
        _stamp("resume")
        return url

    Turn.wait = waited  # type: ignore[method-assign]
    try:
        from proxy.upstream import _Connection
    except ImportError:  # the code before the lean transport: httpcore writes
        import httpcore._backends.anyio as anyio_backend

        write = anyio_backend.AnyIOStream.write

        async def wrote(self: Any, buffer: bytes, timeout: float | None = None) -> None:
            _stamp("write")
            await write(self, buffer, timeout)

        anyio_backend.AnyIOStream.write = wrote  # type: ignore[method-assign]
    else:
        write_request = _Connection.write_request

        async def writes(self: Any, request: Any, timeouts: Any) -> None:
            _stamp("write")
            await write_request(self, request, timeouts)

        _Connection.write_request = writes  # type: ignore[method-assign]


def _timed(cls: Any, name: str, kind: str, static: bool = False) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _stamp(kind + "0")
        try:
            return original(*args, **kwargs)
        finally:
            _stamp(kind + "1")

    setattr(cls, name, staticmethod(wrapper) if static else wrapper)  # a class or a module


class _TimedLogger:
    """The dispatcher's logger, each call timed (``log0``/``log1``)."""

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._logger, name)
        if name not in ("debug", "info", "warning", "error", "exception"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            _stamp("log0")
            try:
                return attr(*args, **kwargs)
            finally:
                _stamp("log1")

        return call


def install_durations() -> None:
    import gc

    import scheduler.dispatcher as dispatcher_module
    from dashboard.live import LiveObserver
    from scheduler.dispatcher import Dispatcher

    dispatcher_module.log = _TimedLogger(dispatcher_module.log)  # type: ignore[assignment]
    _timed(Dispatcher, "_fields", "fields", static=True)
    _timed(Dispatcher, "_notify", "notify")
    _timed(_queue_class(), "add", "add")
    _timed(LiveObserver, "snapshot", "snapshot")
    import activity.recorder as recorder_module

    _timed(recorder_module, "write_records", "record")  # before serve builds the Recorder
    started: list[int] = [0]

    def collected(phase: str, info: dict[str, Any]) -> None:
        now = time.monotonic_ns()
        if phase == "start":
            started[0] = now
            EVENTS.append(("gc0", now))
            return
        EVENTS.append(("gc1", now))
        count, total = GC_STATS.get(info["generation"], (0, 0))
        GC_STATS[info["generation"]] = (count + 1, total + now - started[0])

    gc.callbacks.append(collected)


def install_request_path() -> None:
    """Stamps along one request's path through the server (``bench/relay_timeline.py``):
    ``rx`` (Twisted hands daphne the request's bytes), ``parsed`` (daphne has the whole
    request), ``app`` (the proxy's handler starts), ``submit`` (the view puts its request in
    line), ``arrived`` (the dispatcher takes it from its inbox), ``headers`` (the model's
    response headers are read), ``reply`` (daphne is given the response's start),
    ``tx`` (Twisted writes bytes to a client's socket)."""
    from daphne.http_protocol import WebRequest
    from twisted.internet import tcp
    from twisted.web.http import HTTPChannel

    from proxy.handler import ProxyHandler
    from proxy.upstream import Upstreams
    from scheduler.dispatch_state import Arrived
    from scheduler.dispatcher import Dispatcher

    received = HTTPChannel.dataReceived

    def data_received(self: Any, data: bytes) -> None:
        _stamp("rx")
        received(self, data)

    HTTPChannel.dataReceived = data_received  # type: ignore[method-assign]
    process = WebRequest.process

    def processed(self: Any) -> Any:
        _stamp("parsed")
        return process(self)

    WebRequest.process = processed  # type: ignore[method-assign]
    handle = ProxyHandler.handle

    async def handled(self: Any, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") == "http":
            _stamp("app")
        await handle(self, scope, receive, send)
        _stamp("appdone")

    ProxyHandler.handle = handled  # type: ignore[method-assign]
    submit = Dispatcher.submit

    def submitted(self: Any, *args: Any, **kwargs: Any) -> Any:
        _stamp("submit")
        return submit(self, *args, **kwargs)

    Dispatcher.submit = submitted  # type: ignore[method-assign]
    on_event = Dispatcher._handle

    def on_arrived(self: Any, event: object) -> None:
        if isinstance(event, Arrived):
            _stamp("arrived")
        on_event(self, event)

    Dispatcher._handle = on_arrived  # type: ignore[method-assign]
    _timed(Dispatcher, "_dispatch", "disp")
    _timed(ProxyHandler, "create_request", "req")
    send = Upstreams.send

    async def sent(self: Any, request: Any) -> Any:
        response = await send(self, request)
        _stamp("headers")
        return response

    Upstreams.send = sent  # type: ignore[method-assign]
    reply = WebRequest.handle_reply

    def replied(self: Any, message: Any) -> None:
        if message.get("type") == "http.response.start":
            _stamp("reply")
        else:
            _stamp("body")
        reply(self, message)
        _stamp("replied")

    WebRequest.handle_reply = replied  # type: ignore[method-assign]
    write_some = tcp.Connection.writeSomeData

    def wrote_some(self: Any, data: Any) -> Any:
        _stamp("tx")
        return write_some(self, data)

    tcp.Connection.writeSomeData = wrote_some  # type: ignore[method-assign]


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")
    import django

    django.setup()
    install()
    install_durations()
    if os.environ.get("BENCH_STAGES_REQUEST_PATH"):
        install_request_path()
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(["manage.py", "serve", *sys.argv[1:]])
    finally:
        out = os.environ.get("BENCH_STAGES_OUT")
        if out:
            with open(out, "w") as f:
                for event in EVENTS:
                    f.write(json.dumps(event) + "\n")
                for generation, (count, total) in sorted(GC_STATS.items()):
                    f.write(json.dumps([f"gcstats{generation}", count, total]) + "\n")


if __name__ == "__main__":
    main()
