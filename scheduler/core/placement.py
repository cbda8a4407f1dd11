"""Where a request starts soonest in a fleet: here, or on another node that serves its model.

Pure: no Django, asyncio, network or clock; ``now`` and every node's view come in as
arguments (the fleet's in-memory view, kept current by pub/sub: fleet/). A node's view
says, per lane, how long a new request of each band would wait before it is picked
(what is left of the running job and the requests ahead of it in its band and above),
which models are loaded, and how long a cold load of each model takes there.

The rule (:func:`place`): a request starts on a node after the wait of its band on the
model's lane there, plus a cold load when the model is not loaded there. It goes to the
node where that sum is smallest, unless here is as good (a tie, or a gain too small to
pay the hop: :data:`MIN_GAIN_SECONDS` and :data:`MIN_GAIN_SHARE`), and it stays here
whenever the fleet view is degraded or a node's view is older than
:data:`STALE_SECONDS`. Requests sent to a node since its last view count against it
(``pending``), so a burst does not all go to the one idle node before it says it is
busy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from scheduler.core.priority import Band, band_of

STALE_SECONDS = 1.5
"""A node's view older than this takes no placed request (it publishes every ~1 s)."""
DOWN_SECONDS = 3.0
"""A node not heard from for this long is shown down."""
MIN_GAIN_SECONDS = 0.1
MIN_GAIN_SHARE = 0.25
"""A request leaves here only when another node starts it sooner by more than both:
``MIN_GAIN_SECONDS`` and this share of here's wait (the hop costs a little; a tie stays)."""
WARM = frozenset({"ready", "starting"})
"""Model states that need no cold load (a starting model is loading already)."""


@dataclass(frozen=True)
class LaneWait:
    """One lane of a node: requests waiting per band and the estimated seconds until a new
    request of each band would be picked (running job's rest, then those ahead of it)."""

    depth: Mapping[str, int] = field(default_factory=dict)
    wait: Mapping[str, float] = field(default_factory=dict)
    running: int = 0


@dataclass(frozen=True)
class NodeView:
    """What one node published about itself (and when it was heard, on the reader's clock)."""

    node: str
    url: str = ""
    serves: frozenset[str] = frozenset()
    """Model ids configured there."""
    models: Mapping[str, str] = field(default_factory=dict)
    """Model id -> state (``ready``, ``starting``, ``stopping``) of the models not stopped."""
    lane_of: Mapping[str, str] = field(default_factory=dict)
    lanes: Mapping[str, LaneWait] = field(default_factory=dict)
    load_seconds: Mapping[str, float] = field(default_factory=dict)
    """A cold load of each model there (measured, else the default)."""
    default_load: float = 20.0
    service_seconds: float = 30.0
    """The typical seconds one request takes there (for requests sent since its view)."""
    heard: float = 0.0
    """When this view arrived (the reader's monotonic clock)."""

    def start_in(self, model: str, band: Band, pending: int = 0) -> tuple[float, bool]:
        """Estimated seconds until a new request of ``band`` for ``model`` starts here
        and whether the model is warm (no cold load)."""
        lane = self.lanes.get(self.lane_of.get(model, "default"))
        wait = 0.0 if lane is None else lane.wait.get(band.value, 0.0)
        warm = self.models.get(model) in WARM
        load = 0.0 if warm else self.load_seconds.get(model, self.default_load)
        return max(0.0, wait) + load + pending * self.service_seconds, warm


@dataclass(frozen=True)
class Placement:
    """Where a request goes and why, in words for the why-page and the log."""

    node: str
    reason: str
    forward: bool = False
    here_seconds: float | None = None
    there_seconds: float | None = None


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def place(
    model: str,
    priority: int,
    here: NodeView | None,
    views: Mapping[str, NodeView],
    now: float,
    *,
    degraded: bool = False,
    pending: Mapping[str, int] | None = None,
) -> Placement:
    """Where ``model`` at ``priority`` would start soonest (see the module's rule).
    O(nodes). ``views`` may include ``here`` (it is skipped); ``pending``: requests sent
    to each node (here included) since its view."""
    name = here.node if here is not None else ""
    if here is None or degraded:
        return Placement(name, "stayed here: the fleet view is degraded")
    band = band_of(priority)
    sent = pending or {}
    here_s, here_warm = here.start_in(model, band, sent.get(name, 0))
    best: NodeView | None = None
    best_s = here_s
    best_warm = here_warm
    for view in views.values():
        if view.node == name or model not in view.serves or not view.url:
            continue
        if now - view.heard > STALE_SECONDS:
            continue
        there_s, there_warm = view.start_in(model, band, sent.get(view.node, 0))
        if there_s < best_s or (best is not None and there_s == best_s and view.node < best.node):
            best, best_s, best_warm = view, there_s, there_warm
    if best is None or here_s - best_s <= max(MIN_GAIN_SECONDS, MIN_GAIN_SHARE * here_s):
        return Placement(
            name, f"stayed here: estimated start {_seconds(here_s)}", here_seconds=here_s
        )
    why = "model loaded there" if best_warm else "shorter wait there"
    if best_warm and not here_warm:
        why += ", not loaded here"
    return Placement(
        best.node,
        f"sent to {best.node}: {why}, estimated wait {_seconds(best_s)} "
        f"against {_seconds(here_s)} here",
        forward=True,
        here_seconds=here_s,
        there_seconds=best_s,
    )


def lane_waits(
    depth: Mapping[Band, int], running_left: float, service: Mapping[Band, float]
) -> dict[str, float]:
    """Seconds until a new request of each band would be picked on one lane: what is left
    of the running job, then every request waiting in its band or above at its band's
    typical time (a new request goes behind its own band: arrival order breaks ties).
    Aging, affinity and loads between them are not predicted. O(bands)."""
    out: dict[str, float] = {}
    ahead = max(0.0, running_left)
    for band in (Band.INTERACTIVE, Band.NORMAL, Band.BATCH):  # most urgent first
        ahead += depth.get(band, 0) * service.get(band, 0.0)
        out[band.value] = ahead
    return out
