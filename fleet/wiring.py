"""``serve``'s part: the node's name, and the fleet it joins (with its metrics)."""

from __future__ import annotations

import socket

from django.conf import settings

import fleet.metrics  # noqa: F401  (registers the llamaswap_fleet_* family on /metrics)
from fleet.node import Fleet, enabled
from scheduler.dispatcher import Dispatcher


def from_settings(
    node: str, dispatcher: Dispatcher, host: str, port: int, tls: bool
) -> Fleet | None:
    """``serve``'s fleet: the node's name (``--node``, else ``LLAMASWAP_NODE``) is the
    records' ``node`` from now on; with ``REDIS_URL`` too, the fleet this node joins (its
    URL: ``LLAMASWAP_NODE_URL``, else the listen address, the host name for every
    interface). None outside fleet mode."""
    name = node_name(node)
    if not enabled(settings.REDIS_URL, name):
        return None
    _own_channel_layer(name)
    where = socket.gethostname() if host in ("0.0.0.0", "::") else host
    where = f"[{where}]" if ":" in where else where
    url = settings.LLAMASWAP_NODE_URL or f"{'https' if tls else 'http'}://{where}:{port}"
    return Fleet(name, url, settings.REDIS_URL, dispatcher, prefix=settings.LLAMASWAP_FLEET_PREFIX)


def node_name(node: str) -> str:
    """This server's name (``--node``, else ``LLAMASWAP_NODE``), stored in the setting
    that the records and the control rows (``control.models.this_node``) read."""
    name = (node or settings.LLAMASWAP_NODE).strip()
    settings.LLAMASWAP_NODE = name
    return name


def _own_channel_layer(name: str) -> None:
    """The nodes share the Redis of the channel layer: each node's groups (the dashboard's
    live snapshots) get a prefix of their own, or every node's dashboard would show every
    node's snapshots in turn. Before any layer exists (the dashboard's task starts later)."""
    layers = settings.CHANNEL_LAYERS
    config = layers.get("default", {}).get("CONFIG")
    if isinstance(config, dict) and "hosts" in config:
        default = {**layers["default"], "CONFIG": {**config, "prefix": f"asgi:{name}"}}
        settings.CHANNEL_LAYERS = {**layers, "default": default}
