"""A loopback TCP forwarder a test owns, to cut a server's link to a shared service.

``Cut(upstream_host, upstream_port)`` listens on a free loopback port (``.port``) and pumps
every accepted connection both ways to the upstream. :meth:`Cut.cut` closes every open
connection and from then on closes each new one as soon as it is accepted (the client
sees the service go away, as when it restarts); :meth:`Cut.stall` stops every byte both
ways and leaves the connections open, new ones included (a network that drops packets:
only the client's timeouts notice); :meth:`Cut.drop` is a stall after which the
connections open now never carry a byte again, nor close (the server forgot them during a
partition: a client that only reads never learns it); :meth:`Cut.restore` forwards again
(a stalled connection carries on; a dropped one stays silent). The machine's service itself is never touched, so other tests
sharing it see nothing.

It runs an asyncio loop in a daemon thread of its own: usable from synchronous tests that
drive subprocesses. ``close()`` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from urllib.parse import urlsplit, urlunsplit

BUFFER = 64 * 1024


class Cut:
    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.accepted = 0
        """Connections accepted since start (forwarded or cut)."""
        self._cut = False
        self._flowing: asyncio.Event | None = None
        self._cutting = asyncio.Event()
        """Set while cut: ends the dropped connections' silence."""
        self._generation = 0
        """Connections accepted so far; those numbered below ``_dead_below`` are dropped."""
        self._dead_below = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(started,), name="tcp-cut", daemon=True
        )
        self._thread.start()
        started.wait(5)
        assert self._server is not None, "the forwarder did not start"
        self.port: int = self._server.sockets[0].getsockname()[1]

    def url(self, url: str) -> str:
        """``url`` (redis://, postgres://) with its host and port replaced by this forwarder."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@" if userinfo else ""
        return urlunsplit(parts._replace(netloc=f"{netloc}127.0.0.1:{self.port}"))

    def cut(self) -> None:
        """Close every forwarded connection now and refuse new ones until :meth:`restore`."""
        asyncio.run_coroutine_threadsafe(self._set(True), self._loop).result(5)

    def stall(self) -> None:
        """Hold every byte, both ways, until :meth:`restore`; connections stay open."""
        asyncio.run_coroutine_threadsafe(self._hold(), self._loop).result(5)

    def drop(self) -> None:
        """Hold every byte until :meth:`restore`, and those of the connections open now
        for ever (they stay open)."""
        asyncio.run_coroutine_threadsafe(self._hold(drop=True), self._loop).result(5)

    def restore(self) -> None:
        asyncio.run_coroutine_threadsafe(self._set(False), self._loop).result(5)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- the forwarder's thread ----------------------------------------------------------

    def _main(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def listen() -> None:
            self._flowing = asyncio.Event()
            self._flowing.set()
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

        self._loop.run_until_complete(listen())
        started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _hold(self, drop: bool = False) -> None:
        assert self._flowing is not None
        self._flowing.clear()
        if drop:
            self._dead_below = self._generation

    async def _set(self, cut: bool) -> None:
        assert self._flowing is not None
        self._cut = cut
        self._flowing.set()
        if cut:
            self._cutting.set()
        else:
            self._cutting.clear()
        if cut:
            for writer in list(self._writers):
                writer.close()

    async def _stop(self) -> None:
        await self._set(True)
        if self._server is not None:
            self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._generation += 1
        number = self._generation
        if self._cut:
            writer.close()
            return
        assert self._flowing is not None
        await self._flowing.wait()  # stalled: the client waits (its connect went through)
        if self._cut:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        if self._cut:  # cut while connecting
            writer.close()
            up_writer.close()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, number), self._pump(up_reader, writer, number)
            )
        finally:
            self._writers -= {writer, up_writer}
            writer.close()
            up_writer.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int
    ) -> None:
        """Copy until either side ends; then end the other (both directions end
        together). While stalled, what arrives is held (and delivered once it flows
        again); a dropped connection's bytes never are."""
        assert self._flowing is not None
        try:
            while data := await reader.read(BUFFER):
                await self._flowing.wait()
                if number <= self._dead_below:  # dropped: silent until cut (or closed)
                    await self._cutting.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
