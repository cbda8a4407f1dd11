"""This node's membership in the fleet: one task publishes its view, one keeps the others'.

Fleet mode is on when ``REDIS_URL`` is set and the node has a name (``--node`` or
``LLAMASWAP_NODE``): see :func:`enabled`. Every node of a fleet shares ``DATABASE_URL``
(the shared record) and ``REDIS_URL`` (presence and live state); nothing else is agreed
between them, so there is no consensus to get wrong.

* The publisher reads this node's state every :data:`TICK` seconds (in memory, from the
  dispatcher) and publishes it on the channel ``<prefix>:views`` when its shape changed
  (models, states, queue depth), else every :data:`HEARTBEAT` seconds; the same message
  is stored under ``<prefix>:node:<name>`` with a TTL of :data:`DOWN_SECONDS` (presence:
  a node that starts reads every live node from these keys at once).
* The subscriber keeps :class:`fleet.view.FleetView` current from the channel. A node not
  heard from for :data:`DOWN_SECONDS` is shown down; its next message brings it back.

Control rows (issued keys, scheduler settings) are shared in PostgreSQL; a change saved
on one node is announced on ``<prefix>:control`` (:meth:`Fleet.announce`, installed as
``control.changes``' announcer) and every other node reads the rows again
(``control.remote.apply_remote``, in a thread), so a key revoked on one node stops
working on every node within a moment.

Redis down: both tasks retry with a backoff (0.1 s doubling to 2 s), the view says
``degraded`` and placement keeps every request here; the node serves its own models
throughout. No request ever waits on Redis: the request path reads the view in memory. A
subscription that hears nothing, not even this node's own heartbeats, for
:data:`DOWN_SECONDS` while they go out is dead (Redis forgot it; no reset came): it is
made again. Each message carries the records this node holds because the database is away
(``delayed``, from the recorder), so every node shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from activity.recorder import Recorder
from control import changes, remote
from fleet.view import BadMessage, FleetView, decode_message, encode, local_view, shape
from scheduler.core.placement import DOWN_SECONDS
from scheduler.dispatcher import Dispatcher

log = logging.getLogger("llamaswap.fleet")

TICK = 0.25
"""Seconds between two looks at this node's state: a change is published within this."""
HEARTBEAT = 1.0
"""Seconds between two publications when nothing changed."""
MIN_BACKOFF, MAX_BACKOFF = 0.1, 2.0
CONNECT_TIMEOUT = 1.0
STOP_TIMEOUT = 2.0
MAX_CONTROL_BYTES = 1024
MAX_ANNOUNCING = 16
"""Announcements in flight at most (an admin's saves; beyond it one is dropped and logged)."""


def enabled(redis_url: str, node: str) -> bool:
    """Fleet mode: a Redis to meet in and a name to be known by."""
    return bool(redis_url and node)


class Fleet:
    """This node in the fleet: ``await start()`` on the server's loop, ``await stop()``."""

    def __init__(
        self,
        node: str,
        url: str,
        redis_url: str,
        dispatcher: Dispatcher,
        *,
        prefix: str = "llamaswap:fleet",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.url = url.rstrip("/")
        self.redis_url = redis_url
        self.dispatcher = dispatcher
        self.prefix = prefix
        self.channel = f"{prefix}:views"
        self.control_channel = f"{prefix}:control"
        self.clock = clock
        self.token = secrets.token_hex(16)
        """Random per start: forwarded requests carry it to prove they come from here."""
        self.view = FleetView(here=node)
        self._recorder = next((o for o in dispatcher.observers if isinstance(o, Recorder)), None)
        """Its records held while the database is away are published (``delayed``)."""
        self.placed = 0
        """Requests this node sent to another node since it started."""
        self.placed_to: dict[str, int] = {}
        self._seq = 0
        self._pub_ok = False
        self._published_at = float("-inf")
        """When this node's view last went out (its own subscription hears it back)."""
        self._sub_ok = False
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._warned: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._announcing: set[asyncio.Task[None]] = set()
        self._applying: set[str] = set()
        self._again: set[str] = set()

    def presence_key(self, node: str) -> str:
        return f"{self.prefix}:node:{node}"

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        global _current
        _current = self
        self._stopping = False
        self.refresh()
        loop = asyncio.get_running_loop()
        self._loop = loop
        changes.set_announcer(self.announce)
        self._tasks = [
            loop.create_task(self._publish(), name="fleet-publisher"),
            loop.create_task(self._subscribe(), name="fleet-subscriber"),
        ]
        log.info("fleet: joined", extra={"node": self.node, "url": self.url})

    async def stop(self) -> None:
        global _current
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # redis-py can turn a cancel into a timeout: the flag ends them too
            await asyncio.wait(self._tasks, timeout=STOP_TIMEOUT)
        self._tasks = []
        client = self._client()
        try:  # leave at once rather than after the TTL (best effort)
            async with asyncio.timeout(CONNECT_TIMEOUT):
                await client.delete(self.presence_key(self.node))
        except (RedisError, OSError, TimeoutError):
            pass
        finally:
            await client.aclose()
        if _current is self:
            _current = None
            changes.set_announcer(None)

    # -- what the request path reads -----------------------------------------------------

    def refresh(self) -> None:
        """This node's own view, from its dispatcher now."""
        now = self.clock()
        self._seq += 1
        self.view.update(
            local_view(self.node, self.url, self.dispatcher, now), self.token, self._seq
        )
        self.view.delayed[self.node] = self._recorder.delayed if self._recorder else 0

    def degraded(self) -> bool:
        return self.view.degraded

    def origin_ok(self, node: str, token: str) -> bool:
        """A forwarded request's claim to come from ``node`` holds."""
        known = self.view.tokens.get(node)
        return known is not None and secrets.compare_digest(known, token)

    def placed_on(self, node: str) -> None:
        """A request went to ``node`` (``llamaswap_fleet_placed_total``)."""
        self.placed += 1
        self.placed_to[node] = self.placed_to.get(node, 0) + 1

    def state(self) -> dict[str, Any]:
        return self.view.state(self.clock())

    # -- control rows changed here: tell the others -------------------------------------

    def announce(self, kind: str) -> None:
        """A control row of ``kind`` changed on this node (any thread): published on
        ``<prefix>:control`` for the other nodes (best effort: a node that misses it reads
        the rows at its next start)."""
        loop = self._loop
        if loop is not None and not loop.is_closed() and not self._stopping:
            loop.call_soon_threadsafe(self._announce_soon, kind)

    def _announce_soon(self, kind: str) -> None:
        if len(self._announcing) >= MAX_ANNOUNCING:
            log.warning(
                "fleet: too many announcements in flight, one dropped", extra={"kind": kind}
            )
            return
        task = asyncio.get_running_loop().create_task(self._announce(kind))
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)

    async def _announce(self, kind: str) -> None:
        message = json.dumps({"v": 1, "node": self.node, "kind": kind}).encode()
        client = self._client()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT * 2):
                await client.publish(self.control_channel, message)
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning(
                "fleet: a change not announced (other nodes read it at their next start)",
                extra={"kind": kind, "cause": f"{type(exc).__name__}: {exc}"},
            )
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    def _control(self, raw: bytes | str) -> None:
        """Another node changed a control row: read it again (one reader per kind; a
        change that arrives meanwhile is read once more after it)."""
        try:
            if len(raw) > MAX_CONTROL_BYTES:
                raise ValueError("too long")
            data = json.loads(raw)
            node, kind = data["node"], data["kind"]
        except (ValueError, KeyError, TypeError):
            log.warning("fleet: a control message that is not one")
            return
        if node == self.node or kind not in changes.KINDS or not isinstance(node, str):
            return
        if kind in self._applying:
            self._again.add(kind)
            return
        self._applying.add(kind)
        asyncio.get_running_loop().create_task(self._apply(kind, node[:64]))

    async def _apply(self, kind: str, node: str) -> None:
        try:
            while True:
                self._again.discard(kind)
                await asyncio.to_thread(remote.apply_remote, kind, node)
                if kind not in self._again:
                    return
        finally:
            self._applying.discard(kind)

    # -- the two tasks -------------------------------------------------------------------

    def _client(self) -> aioredis.Redis:
        return aioredis.from_url(
            self.redis_url,
            socket_connect_timeout=CONNECT_TIMEOUT,
            socket_timeout=CONNECT_TIMEOUT * 2,
            health_check_interval=HEARTBEAT * 2,
        )

    def _set_health(
        self, *, pub: bool | None = None, sub: bool | None = None, why: str = ""
    ) -> None:
        if pub is not None:
            self._pub_ok = pub
        if sub is not None:
            self._sub_ok = sub
        degraded = not (self._pub_ok and self._sub_ok)
        if degraded and why:
            self.view.reason = why
        if degraded != self.view.degraded:
            self.view.degraded = degraded
            self.view.changed_at = self.clock()
            if degraded:
                log.warning("fleet: degraded, serving this node's models only", extra={"why": why})
            else:
                log.info("fleet: connected", extra={"node": self.node})

    async def _publish(self) -> None:
        """Publish this node's view on change (checked every TICK) and every HEARTBEAT."""
        backoff = MIN_BACKOFF
        client: aioredis.Redis | None = None
        last_shape: tuple[Any, ...] | None = None
        last_sent = float("-inf")
        ttl_ms = int(DOWN_SECONDS * 1000)
        try:
            while not self._stopping:
                self.refresh()
                view = self.view.views[self.node]
                now = self.clock()
                if shape(view) != last_shape or now - last_sent >= HEARTBEAT:
                    message = encode(view, self.token, self._seq, self.view.delayed[self.node])
                    try:
                        if client is None:
                            client = self._client()
                        async with client.pipeline(transaction=False) as pipe:
                            pipe.publish(self.channel, message)
                            pipe.set(self.presence_key(self.node), message, px=ttl_ms)
                            await pipe.execute()
                    except (RedisError, OSError, TimeoutError) as exc:
                        _still_running()
                        self._set_health(
                            pub=False, why=f"cannot publish: {type(exc).__name__}: {exc}"
                        )
                        if client is not None:
                            with contextlib.suppress(Exception):
                                await client.aclose()
                            client = None
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, MAX_BACKOFF)
                        continue
                    backoff = MIN_BACKOFF
                    last_shape, last_sent = shape(view), now
                    self._published_at = self.clock()
                    self._set_health(pub=True)
                await asyncio.sleep(TICK)
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.aclose()

    async def _subscribe(self) -> None:
        """Keep the other nodes' views: the presence keys once connected, then the channel."""
        backoff = MIN_BACKOFF
        control = self.control_channel.encode()
        while not self._stopping:
            client = self._client()
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(self.channel, self.control_channel)
                seen = 0
                async for key in client.scan_iter(match=self.presence_key("*"), count=100):
                    raw = await client.get(key)
                    if raw is not None:
                        self._take(raw)
                    seen += 1
                    if seen >= 256:
                        break
                self._set_health(sub=True)
                backoff = MIN_BACKOFF
                heard = self.clock()
                while not self._stopping:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=TICK)
                    if message is not None:
                        heard = self.clock()
                    elif self._published_at - heard > DOWN_SECONDS:
                        # This node's own heartbeats went out and never came back: Redis
                        # forgot this subscription (a partition) and no reset reached it.
                        raise RedisConnectionError(
                            f"nothing heard for {DOWN_SECONDS:.0f} s while publishing"
                        )
                    if message is not None and message.get("type") == "message":
                        if message.get("channel") in (self.control_channel, control):
                            self._control(message["data"])
                        else:
                            self._take(message["data"])
                    self.view.sweep(self.clock())
            except (RedisError, OSError, TimeoutError) as exc:
                _still_running()
                self._set_health(
                    sub=False, why=f"subscriber lost Redis: {type(exc).__name__}: {exc}"
                )
                self.view.sweep(self.clock())
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed in newer redis
                with contextlib.suppress(Exception):
                    await client.aclose()

    def _take(self, raw: bytes | str) -> None:
        try:
            view, token, seq, delayed = decode_message(raw, self.clock())
        except BadMessage as exc:
            log.warning("fleet: a message that is not a node's view", extra={"why": str(exc)})
            return
        if view.node == self.node:
            if token != self.token and token not in self._warned and len(self._warned) < 16:
                self._warned.add(token)
                log.error("fleet: another server uses this node's name", extra={"node": self.node})
            return
        if self.view.update(view, token, seq):
            self.view.delayed[view.node] = delayed
        elif view.node not in self.view.views:
            log.warning("fleet: too many nodes, one ignored", extra={"node": view.node})


def _still_running() -> None:
    """Raise CancelledError when this task is being cancelled (redis-py may have turned
    the cancel into a timeout: the loop must not take it for a Redis fault)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


_current: Fleet | None = None


def current() -> Fleet | None:
    """This server's fleet membership, None outside fleet mode."""
    return _current


def section() -> dict[str, Any] | None:
    """The dashboard's fleet section (nodes, up or down, models loaded, queue depth per
    band), from memory; None outside fleet mode."""
    fleet = _current
    return fleet.state() if fleet is not None else None
