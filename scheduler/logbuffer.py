"""The recent output of every model, bounded by bytes, with live subscriptions (``/logs``,
``/logs/stream``, ``logToStdout``)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable

_SEQ = itertools.count(1)
"""Numbers every line of every buffer (the proxy's log and the models'): a reader that
polls several buffers (the dashboard's logs page) asks for what came after one number."""

Entry = tuple[int, float, str, bytes]
"""(sequence number, wall-clock time written, model id ("" none), line)."""


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
        prefix = self.model is None and self._buffer.prefixed
        try:
            self._queue.put_nowait(_prefixed(model, line) if prefix else line)
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
    oldest lines are dropped. Each line keeps when it was written and a sequence number
    (:meth:`since`). ``prefixed=False`` (the proxy's own log, :mod:`scheduler.proxylog`):
    lines are given as written either way; the model is only a filter.
    """

    def __init__(
        self,
        max_bytes: int = 1024 * 1024,
        *,
        subscriber_queue: int = 1024,
        prefixed: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_bytes = max_bytes
        self.subscriber_queue = subscriber_queue
        self.prefixed = prefixed
        self._clock = clock
        self._lines: collections.deque[Entry] = collections.deque()
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
        self._lines.append((next(_SEQ), self._clock(), model, line))
        self._size += len(line) + len(model) + 3
        while self._size > self.max_bytes and self._lines:
            _, _, old_model, old_line = self._lines.popleft()
            self._size -= len(old_line) + len(old_model) + 3
        for subscriber in tuple(self._subscribers):
            subscriber._offer(model, line)

    def history(self, model: str | None = None) -> bytes:
        if model is None:
            if not self.prefixed:
                return b"".join(line for _, _, _, line in self._lines)
            return b"".join(_prefixed(m, line) for _, _, m, line in self._lines)
        return b"".join(line for _, _, m, line in self._lines if m == model)

    def since(self, after: int, limit: int | None = None) -> list[Entry]:
        """The last ``limit`` lines numbered above ``after`` (oldest first). Reads from the
        newest end and stops at ``after``: a poller that keeps up reads only what is new."""
        out: list[Entry] = []
        for entry in reversed(self._lines):
            if entry[0] <= after or (limit is not None and len(out) >= limit):
                break
            out.append(entry)
        out.reverse()
        return out

    def subscribe(self, model: str | None = None, *, maxsize: int | None = None) -> LogSubscription:
        """Lines written from now on (of one model, unprefixed, when ``model`` is given)."""
        subscription = LogSubscription(self, model, maxsize or self.subscriber_queue)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: LogSubscription) -> None:
        subscription.close()
