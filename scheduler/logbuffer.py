"""The recent output of every model, bounded by bytes, with live subscriptions (``/logs``,
``/logs/stream``, ``logToStdout``)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable


def _prefixed(model: str, line: bytes) -> bytes:
    return b"[" + model.encode() + b"] " + line


class LogSubscription:
    """A live tail of a :class:`LogBuffer`: an async iterator of lines (bytes, newline-ended).

    Lines are queued per subscriber up to ``maxsize``; when the queue is full new lines are
    dropped and counted in :attr:`dropped`, so a slow reader never blocks the models. Ends
    (``StopAsyncIteration``) after :meth:`close`, once the lines already queued are read.
    """

    def __init__(self, buffer: LogBuffer, model: str | None, maxsize: int) -> None:
        self.model = model
        self.dropped = 0
        self.closed = False
        self._buffer = buffer
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize)

    def _offer(self, model: str, line: bytes) -> None:
        if self.closed or (self.model is not None and model != self.model):
            return
        try:
            self._queue.put_nowait(line if self.model is not None else _prefixed(model, line))
        except asyncio.QueueFull:
            self.dropped += 1

    def close(self) -> None:
        """Stop receiving; a reader waiting in ``async for`` finishes."""
        if self.closed:
            return
        self.closed = True
        self._buffer._subscribers.discard(self)
        if self._queue.full():  # make room for the end marker
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(None)

    def __aiter__(self) -> LogSubscription:
        return self

    async def __anext__(self) -> bytes:
        item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # keep ending for any later call
            raise StopAsyncIteration
        return item

    async def __aenter__(self) -> LogSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class LogBuffer:
    """The recent output of every model, bounded by bytes, with live subscriptions.

    Lines are kept with the id of the model that wrote them. :meth:`history` without a model
    gives every line prefixed ``[model-id] `` (as llama-swap's combined upstream log does);
    with a model, that model's lines as written. When the total passes ``max_bytes`` the
    oldest lines are dropped.
    """

    def __init__(self, max_bytes: int = 1024 * 1024, *, subscriber_queue: int = 1024) -> None:
        self.max_bytes = max_bytes
        self.subscriber_queue = subscriber_queue
        self._lines: collections.deque[tuple[str, bytes]] = collections.deque()
        self._size = 0
        self._subscribers: set[LogSubscription] = set()
        self.echo: Callable[[str, bytes], None] | None = None
        """Also called with every line (``logToStdout: upstream`` or ``both`` writes them
        to stdout: :func:`llamaswap_site.logfmt.apply_log_config`)."""

    def write(self, model: str, line: bytes) -> None:
        """Append one line of ``model``'s output; a missing final newline is added."""
        if not line.endswith(b"\n"):
            line += b"\n"
        if self.echo is not None:
            self.echo(model, line)
        self._lines.append((model, line))
        self._size += len(line) + len(model) + 3
        while self._size > self.max_bytes and self._lines:
            old_model, old_line = self._lines.popleft()
            self._size -= len(old_line) + len(old_model) + 3
        for subscriber in tuple(self._subscribers):
            subscriber._offer(model, line)

    def history(self, model: str | None = None) -> bytes:
        if model is None:
            return b"".join(_prefixed(m, line) for m, line in self._lines)
        return b"".join(line for m, line in self._lines if m == model)

    def subscribe(self, model: str | None = None, *, maxsize: int | None = None) -> LogSubscription:
        """Lines written from now on (of one model, unprefixed, when ``model`` is given)."""
        subscription = LogSubscription(self, model, maxsize or self.subscriber_queue)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: LogSubscription) -> None:
        subscription.close()
