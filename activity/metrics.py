"""Prometheus metrics for the scheduler, declared once, and the ``GET /metrics`` export.

The queue gauges are read at scrape time by :class:`QueueCollector` straight from the
dispatcher's queue (``WaitingQueue.band_stats``, O(1) per band), so they are never stale.
Counters and histograms are fed by :class:`MetricsObserver`, a dispatcher observer: native
code on the dispatcher task, no middleware and no thread hop per proxied request.

Every band label (and every band x term pair of the reorder counter) exists from the
start, at zero, so dashboards and alerts never see a series appear out of nowhere.

The export runs in the event loop's thread (an async view served by the lean
``ProxyHandler``), the thread that owns the dispatcher, so the collector reads the queue
without locks. django-prometheus' own metrics (pages, database) share the registry.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

from django.http import HttpRequest, HttpResponse
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.core.policy import Term
from scheduler.core.priority import BANDS, Band, band_of
from scheduler.dispatcher import Outcome
from scheduler.process import ModelState

if TYPE_CHECKING:
    from scheduler.config import Config
    from scheduler.dispatcher import Dispatcher, Ticket

TERMS: tuple[Term, ...] = tuple(Term)  # aging, swap_affinity, aging_cap, band_share
OUTCOMES = tuple(outcome.value for outcome in Outcome)

QUEUE_DEPTH = "llamaswap_scheduler_queue_depth"
QUEUE_OLDEST_WAIT = "llamaswap_scheduler_queue_oldest_wait_seconds"
LANE_QUEUE_DEPTH = "llamaswap_lane_queue_depth"
LANE_RUNNING = "llamaswap_lane_running"

DISPATCHED = Counter(
    "llamaswap_scheduler_dispatched_total",
    "Requests dispatched (picked to run next), by band.",
    ["band"],
)
REORDERS = Counter(
    "llamaswap_scheduler_reorders_total",
    "Dispatches where a score term (aging, swap_affinity, or the opt-in aging_cap and "
    "band_share) changed which request went "
    "next, by the band of the request picked and the term.",
    ["band", "term"],
)
QUEUE_WAIT = Histogram(
    "llamaswap_scheduler_queue_wait_seconds",
    "Time from arrival to dispatch (not counting a model load), by band.",
    ["band"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600),
)
REQUEST_DURATION = Histogram(
    "llamaswap_request_duration_seconds",
    "Inference requests from arrival to the end of the response (streams included), by "
    "band and outcome. Its _count is the number of proxied inference requests.",
    ["band", "outcome"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 12 * 3600),
)
MODEL_SWAPS = Counter(
    "llamaswap_model_swaps_total",
    "Model loads started (a swap onto the GPU), by model.",
    ["model"],
)
MODEL_LOAD_DURATION = Histogram(
    "llamaswap_model_load_duration_seconds",
    "Time from starting a model to it being ready, by model (successful loads).",
    ["model"],
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)
LANE_DISPATCHED = Counter(
    "llamaswap_lane_dispatched_total",
    "Requests dispatched, by lane (GPU) and band; summed over lanes it is "
    "llamaswap_scheduler_dispatched_total.",
    ["lane", "band"],
)
RECORDS_WRITTEN = Counter(
    "llamaswap_activity_records_written_total",
    "Activity-log records saved to the database.",
)
RECORDS_DROPPED = Counter(
    "llamaswap_activity_records_dropped_total",
    "Activity-log records dropped: the buffer was full while the database was "
    "unavailable, or the database refused them.",
)
RECORDS_BUFFERED = Gauge(
    "llamaswap_activity_records_buffered",
    "Activity-log records waiting in memory to be saved.",
)

for _band in BANDS:
    DISPATCHED.labels(_band.value)
    QUEUE_WAIT.labels(_band.value)
    for _term in TERMS:
        REORDERS.labels(_band.value, _term.value)
    for _outcome in OUTCOMES:
        REQUEST_DURATION.labels(_band.value, _outcome)


def _running_dispatcher() -> Dispatcher | None:
    from scheduler import runtime

    return runtime.current().dispatcher if runtime.is_running() else None


class QueueCollector(Collector):
    """Queue depth and oldest wait per band, read from the dispatcher at scrape time.

    Call :meth:`collect` on the dispatcher's thread (the event loop's).
    """

    def __init__(self, source: Callable[[], Dispatcher | None] = _running_dispatcher) -> None:
        self._source = source

    def describe(self) -> Iterable[Metric]:
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._source())

    @staticmethod
    def _families(dispatcher: Dispatcher | None) -> list[Metric]:
        depth = GaugeMetricFamily(QUEUE_DEPTH, "Requests waiting, by band.", labels=["band"])
        oldest = GaugeMetricFamily(
            QUEUE_OLDEST_WAIT,
            "How long the longest-waiting request of each band has waited (0 when none).",
            labels=["band"],
        )
        lane_depth = GaugeMetricFamily(
            LANE_QUEUE_DEPTH,
            "Requests waiting, by lane (GPU) and band; summed over lanes it is "
            f"{QUEUE_DEPTH}.",
            labels=["lane", "band"],
        )
        lane_running = GaugeMetricFamily(
            LANE_RUNNING, "Requests being served or loading their model, by lane (GPU).", labels=["lane"]
        )
        stats = dispatcher.queue.band_stats(dispatcher.now()) if dispatcher is not None else None
        for band in BANDS:
            entry = stats.get(band) if stats is not None else None
            depth.add_metric([band.value], entry.depth if entry else 0)
            oldest.add_metric([band.value], entry.oldest_wait if entry else 0.0)
        if dispatcher is not None:
            now = dispatcher.now()
            for lane in dispatcher.lanes():
                per_band = dispatcher.queue.lane(lane.name).band_stats(now)
                for band in BANDS:
                    lane_depth.add_metric([lane.name, band.value], per_band[band].depth)
                lane_running.add_metric([lane.name], len(lane.running))
        return [depth, oldest, lane_depth, lane_running]


QUEUE_COLLECTOR = QueueCollector()
REGISTRY.register(QUEUE_COLLECTOR)


def _adder(child: Any) -> Callable[[float], None]:
    """``child.inc`` without what a counter child checks on every call (that it has its
    labels, that the amount is not negative, an exemplar): the children here have their
    labels and count by one. The public ``inc`` if this prometheus_client keeps its value
    elsewhere."""
    inc = getattr(getattr(child, "_value", None), "inc", None)
    return cast(Callable[[float], None], inc if callable(inc) else child.inc)


def _observer(child: Any) -> Callable[[float], None]:
    """``child.observe`` of a histogram child, its bucket found by bisection instead of a
    Python loop over the bounds: the same sum and buckets (a NaN in no bucket, as
    ``Histogram.observe`` does). The public ``observe`` if this prometheus_client keeps
    them elsewhere."""
    bounds = getattr(child, "_upper_bounds", None)
    buckets = getattr(child, "_buckets", None)
    total = getattr(child, "_sum", None)
    if (
        not isinstance(bounds, list)
        or not isinstance(buckets, list)
        or len(bounds) != len(buckets)
        or bounds != sorted(bounds)
        or not callable(getattr(total, "inc", None))
        or not all(callable(getattr(bucket, "inc", None)) for bucket in buckets)
    ):
        return cast(Callable[[float], None], child.observe)
    add = cast(Any, total).inc
    counts = [bucket.inc for bucket in buckets]

    def observe(amount: float) -> None:
        add(amount)
        if amount == amount:  # not NaN
            counts[bisect_left(bounds, amount)](1)

    return observe


class MetricsObserver:
    """A dispatcher observer that counts dispatches, reorders, swaps and durations.

    Every call is a few dictionary lookups and counter increments on the dispatcher task:
    the label children are looked up once, and what a request updates is kept per band
    (and lane, outcome) as the children's own update functions (:func:`_adder`,
    :func:`_observer`: ~1 µs a request less than ``inc``/``observe``).
    """

    def __init__(
        self, config: Config | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._dispatched = {band: _adder(DISPATCHED.labels(band.value)) for band in BANDS}
        self._waits = {band: _observer(QUEUE_WAIT.labels(band.value)) for band in BANDS}
        self._reorders = {
            band: {term: _adder(REORDERS.labels(band.value, term.value)) for term in TERMS}
            for band in BANDS
        }
        self._durations = {
            band: {
                outcome: _observer(REQUEST_DURATION.labels(band.value, outcome.value))
                for outcome in Outcome
            }
            for band in BANDS
        }
        self._loading_since: dict[str, float] = {}
        self._lane_dispatched: dict[str, dict[Band, Callable[[float], None]]] = {}
        if config is not None:
            for lane in config.lanes:
                for band in BANDS:
                    self._lane_counter(lane, band)
            for model in config.models:
                MODEL_SWAPS.labels(model)
                MODEL_LOAD_DURATION.labels(model)

    def _lane_counter(self, lane: str, band: Band) -> Callable[[float], None]:
        """The lane's dispatch counter of the band, its series made on first use (the
        configured lanes' at the start)."""
        inc = _adder(LANE_DISPATCHED.labels(lane, band.value))
        self._lane_dispatched.setdefault(lane, {})[band] = inc
        return inc

    def on_enqueue(self, ticket: Ticket) -> None:
        pass

    def on_dispatch(self, ticket: Ticket) -> None:
        decision = ticket.decision
        if decision is None:
            return
        band = decision.band
        self._dispatched[band](1)
        lane = self._lane_dispatched.get(ticket.lane)
        count = lane.get(band) if lane is not None else None
        if count is None:
            count = self._lane_counter(ticket.lane, band)
        count(1)
        self._waits[band](decision.queue_wait)
        if decision.reordered_by:
            reorders = self._reorders[band]
            for term in decision.reordered_by:
                reorders[term](1)

    def on_finish(self, ticket: Ticket) -> None:
        outcome = ticket.outcome
        if outcome is None:
            return
        extra = ticket.extra
        if extra and (extra.get("preload") or extra.get("recorded_elsewhere")):
            return  # a preload; or fleet: counted where its client is
        finished = ticket.finished_at if ticket.finished_at is not None else ticket.arrival
        band = ticket.decision.band if ticket.decision is not None else band_of(ticket.priority)
        self._durations[band][outcome](max(0.0, finished - ticket.arrival))

    def on_model_state(self, model: str, state: ModelState) -> None:
        if state is ModelState.STARTING:
            MODEL_SWAPS.labels(model).inc()
            self._loading_since[model] = self._clock()
        elif state is ModelState.READY:
            started = self._loading_since.pop(model, None)
            if started is not None:
                MODEL_LOAD_DURATION.labels(model).observe(max(0.0, self._clock() - started))
        elif state is ModelState.STOPPED:
            self._loading_since.pop(model, None)  # a failed start

    def on_settings(self, settings: object, source: str) -> None:
        pass


def export(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)


async def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics: computed on the event loop's thread (see :class:`QueueCollector`)."""
    return HttpResponse(export(), content_type=CONTENT_TYPE_LATEST)
