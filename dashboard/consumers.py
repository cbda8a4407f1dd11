"""The dashboard's websocket: a snapshot at once, then every coalesced update."""

from __future__ import annotations

from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from dashboard import live
from dashboard.views import login_required

CLOSE_LOGIN_REQUIRED = 4401


class DashboardConsumer(AsyncJsonWebsocketConsumer):
    """Joins the ``dashboard`` group, sends a snapshot on connect, relays updates."""

    group = live.GROUP

    async def connect(self) -> None:
        if login_required():
            user = self.scope.get("user")
            if user is None or not user.is_authenticated:
                await self.close(code=CLOSE_LOGIN_REQUIRED)
                return
        await self.channel_layer.group_add(self.group, self.channel_name)
        self.watching = True
        live.watcher_joined()
        await self.accept()
        await self.send_json(live.current_snapshot())

    async def disconnect(self, code: int) -> None:
        if getattr(self, "watching", False):
            self.watching = False
            live.watcher_left()
        await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """The page may ask for a full snapshot again (after a gap)."""
        if isinstance(content, dict) and content.get("type") == "refresh":
            await self.send_json(live.current_snapshot())

    async def dashboard_update(self, event: dict[str, Any]) -> None:
        await self.send_json(event["snapshot"])
