"""A node's picture of the fleet, held in memory and read on the request path.

* :func:`local_view`: this node's own state from its dispatcher (models and their states,
  each lane's queue depth per band and the estimated wait of a new request per band,
  measured load and service times). O(models + lanes + running), no queue scan.
* :func:`encode` / :func:`decode`: a view as the JSON message published on Redis, and
  back (a malformed or oversized message is refused, never half read).
* :class:`FleetView`: every node's last view, when it was heard (this node's monotonic
  clock: no clock is compared across machines), whether the fleet's Redis is reachable
  (``degraded``), and the requests this node sent to each node since that node's last
  view (``pending``, for :func:`scheduler.core.placement.place`). Written only by the
  fleet's tasks and the placement hook, all on the event loop's thread.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler.core.estimate import DEFAULT_LOAD_SECONDS
from scheduler.core.placement import DOWN_SECONDS, LaneWait, NodeView, lane_waits
from scheduler.core.priority import BANDS
from scheduler.dispatcher import Dispatcher, TicketState
from scheduler.process import ModelState

MAX_MESSAGE_BYTES = 256 * 1024
"""A node's view larger than this is refused (a few thousand models would fit)."""
MAX_NODES = 256
"""Views kept at most; beyond it a new node's view is ignored (and logged by the caller)."""


def local_view(node: str, url: str, dispatcher: Dispatcher, now: float) -> NodeView:
    """This node's view, from its dispatcher's read-only state (event loop's thread)."""
    queue = dispatcher.queue
    models = {
        m: s.value for m, s in dispatcher.model_states().items() if s is not ModelState.STOPPED
    }
    lane_of = {m: queue.lane_for(m) for m in dispatcher.config.models}
    _, estimators = dispatcher.queue_views()
    lanes: dict[str, LaneWait] = {}
    load_seconds: dict[str, float] = {}
    service_total, service_count = 0.0, 0
    for lane in dispatcher.lanes():
        estimator = estimators.get(lane.name)
        if estimator is None:
            continue
        times = estimator.means.times(estimator.default_load)
        for model in lane.models:
            load_seconds[model] = times.load_of(model)
        left = 0.0
        for ticket in lane.running:
            d = ticket.decision
            if d is None:
                continue
            started = (
                ticket.ready_at if ticket.ready_at is not None else ticket.dispatched_at or now
            )
            loading = ticket.state is TicketState.LOADING
            left = max(left, estimator.running_left(ticket.model.id, d.band, started, now, loading))
        stats = queue.lane(lane.name).band_stats(now)
        depth = {band: stats[band].depth for band in BANDS if band in stats}
        service = {band: estimator.means.band_mean(band) or times.default_service for band in BANDS}
        lanes[lane.name] = LaneWait(
            depth={band.value: n for band, n in depth.items()},
            wait=lane_waits(depth, left, service),
            running=len(lane.running),
        )
        service_total += times.default_service
        service_count += 1
    return NodeView(
        node=node,
        url=url,
        serves=frozenset(dispatcher.config.models),
        models=models,
        lane_of=lane_of,
        lanes=lanes,
        load_seconds=load_seconds,
        default_load=DEFAULT_LOAD_SECONDS,
        service_seconds=service_total / service_count if service_count else 30.0,
        heard=now,
    )


def shape(view: NodeView) -> tuple[Any, ...]:
    """What a change is: models and states, depth and running per lane (waits drift on
    their own as time passes; the heartbeat carries them)."""
    return (
        tuple(sorted(view.models.items())),
        tuple(
            (name, tuple(sorted(lane.depth.items())), lane.running)
            for name, lane in sorted(view.lanes.items())
        ),
        view.url,
    )


def encode(view: NodeView, token: str, seq: int, delayed: int = 0) -> bytes:
    """The message a node publishes about itself (``delayed``: records it holds because
    the shared database is away, :attr:`FleetView.delayed`)."""
    return json.dumps(
        {
            "v": 1,
            "delayed": delayed,
            "node": view.node,
            "url": view.url,
            "token": token,
            "seq": seq,
            "serves": sorted(view.serves),
            "models": dict(view.models),
            "lane_of": dict(view.lane_of),
            "lanes": {
                name: {"depth": dict(lane.depth), "wait": dict(lane.wait), "running": lane.running}
                for name, lane in view.lanes.items()
            },
            "load": {m: round(s, 3) for m, s in view.load_seconds.items()},
            "default_load": view.default_load,
            "service": round(view.service_seconds, 3),
        },
        separators=(",", ":"),
    ).encode()


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class BadMessage(ValueError):
    """A fleet message that is not a node's view."""


def _str_map(value: Any, kind: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadMessage("not an object")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str) or isinstance(item, bool) or not isinstance(item, kind):
            raise BadMessage(f"bad entry {key!r}")
        out[key] = item
    return out


def decode(raw: bytes | str, heard: float) -> tuple[NodeView, str, int]:
    """A published message as (view heard at ``heard``, the node's token, its sequence
    number). Raises :class:`BadMessage`."""
    view, token, seq, _ = decode_message(raw, heard)
    return view, token, seq


def decode_message(raw: bytes | str, heard: float) -> tuple[NodeView, str, int, int]:
    """:func:`decode`, and the records the node said it holds for the database
    (``delayed``; 0 when the message has none)."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"message over {MAX_MESSAGE_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadMessage(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("v") != 1:
        raise BadMessage("not a version 1 view")
    node, url, token, seq = data.get("node"), data.get("url"), data.get("token"), data.get("seq")
    if not (isinstance(node, str) and node and isinstance(url, str) and isinstance(token, str)):
        raise BadMessage("node, url and token must be strings")
    if not isinstance(seq, int) or isinstance(seq, bool):
        raise BadMessage("seq must be an integer")
    serves = data.get("serves")
    if not isinstance(serves, list) or not all(isinstance(m, str) for m in serves):
        raise BadMessage("serves must be a list of model ids")
    lanes_raw = data.get("lanes")
    if not isinstance(lanes_raw, dict):
        raise BadMessage("lanes must be an object")
    lanes = {}
    for name, lane in lanes_raw.items():
        if not isinstance(lane, dict):
            raise BadMessage(f"lane {name!r} must be an object")
        running = lane.get("running", 0)
        if not isinstance(running, int) or isinstance(running, bool):
            raise BadMessage(f"lane {name!r}: running must be an integer")
        lanes[str(name)] = LaneWait(
            depth=_str_map(lane.get("depth", {}), int),
            wait={k: float(v) for k, v in _str_map(lane.get("wait", {}), int | float).items()},
            running=running,
        )
    delayed = data.get("delayed", 0)
    if not isinstance(delayed, int) or isinstance(delayed, bool) or delayed < 0:
        raise BadMessage("delayed must be a count")
    default_load, service = data.get("default_load"), data.get("service")
    if not (_number(default_load) and _number(service)):
        raise BadMessage("default_load and service must be numbers")
    assert isinstance(default_load, int | float) and isinstance(service, int | float)
    view = NodeView(
        node=node,
        url=url,
        serves=frozenset(serves),
        models=_str_map(data.get("models", {}), str),
        lane_of=_str_map(data.get("lane_of", {}), str),
        lanes=lanes,
        load_seconds={k: float(v) for k, v in _str_map(data.get("load", {}), int | float).items()},
        default_load=float(default_load),
        service_seconds=float(service),
        heard=heard,
    )
    return view, token, seq, delayed


@dataclass
class FleetView:
    """Every node's last view (this one's included), as this node knows them."""

    here: str
    views: dict[str, NodeView] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    """Each node's token (random per start): a forwarded request proves its origin with it."""
    seqs: dict[str, int] = field(default_factory=dict)
    pending: dict[str, int] = field(default_factory=dict)
    delayed: dict[str, int] = field(default_factory=dict)
    """Records each node holds (journaled) because the shared database is away from it, as
    it last said: the fleet's history lacks them until they arrive."""
    degraded: bool = True
    """Redis unreachable (or not yet reached): placement keeps every request here."""
    reason: str = "not connected yet"
    changed_at: float = 0.0
    """When the view last changed (a node's shape, up or down; this node's clock)."""
    _shapes: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    _up: dict[str, bool] = field(default_factory=dict)

    def update(self, view: NodeView, token: str, seq: int) -> bool:
        """Take a node's view; False when it is not newer than the one held (or the
        table is full). Requests sent to it since its last view are now in it."""
        node = view.node
        if node not in self.views and len(self.views) >= MAX_NODES:
            return False
        if self.tokens.get(node) == token and seq <= self.seqs.get(node, -1):
            return False
        self.views[node] = view
        self.tokens[node] = token
        self.seqs[node] = seq
        self.pending.pop(node, None)
        new_shape = shape(view)
        if self._shapes.get(node) != new_shape or not self._up.get(node):
            self._shapes[node] = new_shape
            self._up[node] = True
            self.changed_at = view.heard
        return True

    def up(self, node: str, now: float) -> bool:
        view = self.views.get(node)
        return view is not None and now - view.heard < DOWN_SECONDS

    def sweep(self, now: float) -> None:
        """Note nodes that went down since the last sweep (for ``changed_at``)."""
        for node in self.views:
            up = self.up(node, now)
            if self._up.get(node) != up:
                self._up[node] = up
                self.changed_at = now

    def unreachable(self, node: str, now: float) -> None:
        """A node refused a connection: down (out of placement) until it publishes again."""
        view = self.views.get(node)
        if view is not None and node != self.here:
            self.views[node] = replace(view, heard=min(view.heard, now - DOWN_SECONDS))
            self.sweep(now)

    def sent(self, node: str) -> None:
        self.pending[node] = self.pending.get(node, 0) + 1

    def state(self, now: float) -> dict[str, Any]:
        """The fleet as the dashboard and the metrics show it (JSON-ready). A node that is
        down shows nothing loaded, waiting or running: whatever it held is gone with it."""
        nodes = []
        for name in sorted(self.views):
            view = self.views[name]
            up = name == self.here or self.up(name, now)
            depth = {band.value: 0 for band in BANDS}
            lanes = view.lanes.values() if up else ()
            for lane in lanes:
                for band, n in lane.depth.items():
                    if band in depth:
                        depth[band] += n
            models = dict(sorted(view.models.items())) if up else {}
            nodes.append(
                {
                    "node": name,
                    "here": name == self.here,
                    "url": view.url,
                    "up": up,
                    "heard_ago": round(max(0.0, now - view.heard), 1),
                    "loaded": sorted(m for m, s in models.items() if s == "ready"),
                    "models": models,
                    "depth": depth,
                    "running": sum(lane.running for lane in lanes),
                    "delayed": self.delayed.get(name, 0),
                }
            )
        return {
            "here": self.here,
            "degraded": self.degraded,
            "status": f"degraded: {self.reason}" if self.degraded else "ok",
            "nodes": nodes,
            "up": sum(1 for n in nodes if n["up"]),
            "records_delayed": sum(n["delayed"] for n in nodes),
        }
