"""The dashboard's websocket: a snapshot at once, then every coalesced update.

What a client may send is bounded twice: daphne's websocket protocol closes a client over
its message budget with 1008 before a message is queued for this consumer
(``llamaswap_site.ws_limits.install_websocket_limits``), and here ``refresh`` requests
are merged: one full snapshot at most every :data:`REFRESH_SPACING` seconds, however many
arrive. A message that is not a JSON object closes the socket with
:data:`CLOSE_BAD_MESSAGE`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from dashboard import live
from dashboard.access import login_required
from web.runtime import scope_runtime

CLOSE_LOGIN_REQUIRED = 4401
CLOSE_BAD_MESSAGE = 4400
REFRESH_SPACING = 0.1
"""Seconds between two full snapshots sent for ``refresh`` requests on one socket."""


class DashboardConsumer(AsyncJsonWebsocketConsumer):  # type: ignore[misc]  # channels ships no types
    """Joins the ``dashboard`` group, sends a snapshot on connect, relays updates."""

    group = live.GROUP
    _refresh_task: asyncio.Task[None] | None = None
    """The merged refresh that is due, if any."""
    _refreshed_at = float("-inf")

    async def connect(self) -> None:
        if login_required(scope_runtime(self.scope)):
            user = self.scope.get("user")
            if user is None or not user.is_authenticated:
                await self.close(code=CLOSE_LOGIN_REQUIRED)
                return
        await self.channel_layer.group_add(self.group, self.channel_name)
        self.watching = True
        live.watcher_joined()
        await self.accept()
        self._refreshed_at = asyncio.get_running_loop().time()
        await self.send_json(live.current_snapshot())

    async def disconnect(self, code: int) -> None:
        task = self._refresh_task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if getattr(self, "watching", False):
            self.watching = False
            live.watcher_left()
        await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            content = json.loads(text_data) if text_data is not None else None
        except ValueError:
            content = None
        if not isinstance(content, dict):
            await self.close(code=CLOSE_BAD_MESSAGE)
            return
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """The page may ask for a full snapshot again (after a gap)."""
        if isinstance(content, dict) and content.get("type") == "refresh":
            await self.refresh()

    async def refresh(self) -> None:
        """One full snapshot for every refresh that arrives while one is due or within
        :data:`REFRESH_SPACING` of the last: building one walks the waiting list on the
        event loop, so a client asking a thousand times gets a handful."""
        if self._refresh_task is not None:
            return  # merged into the one that is due
        loop = asyncio.get_running_loop()
        wait = self._refreshed_at + REFRESH_SPACING - loop.time()
        if wait <= 0:
            self._refreshed_at = loop.time()
            await self.send_json(live.current_snapshot())
            return
        self._refresh_task = loop.create_task(self._refresh_after(wait))

    async def _refresh_after(self, wait: float) -> None:
        await asyncio.sleep(wait)
        self._refresh_task = None
        self._refreshed_at = asyncio.get_running_loop().time()
        await self.send_json(live.current_snapshot())

    async def dashboard_update(self, event: dict[str, Any]) -> None:
        await self.send_json(event["snapshot"])
