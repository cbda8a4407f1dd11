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
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from django.http import HttpRequest, HttpResponse
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler.core.policy import Term
from scheduler.core.priority import BANDS, band_of
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


class MetricsObserver:
    """A dispatcher observer that counts dispatches, reorders, swaps and durations.

    Every call is a few dictionary lookups and counter increments on the dispatcher task.
    """

    def __init__(
        self, config: Config | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._dispatched = {band: DISPATCHED.labels(band.value) for band in BANDS}
        self._waits = {band: QUEUE_WAIT.labels(band.value) for band in BANDS}
        self._reorders = {
            (band, term): REORDERS.labels(band.value, term.value)
            for band in BANDS
            for term in TERMS
        }
        self._durations = {
            (band, outcome): REQUEST_DURATION.labels(band.value, outcome)
            for band in BANDS
            for outcome in OUTCOMES
        }
        self._loading_since: dict[str, float] = {}
        self._lane_dispatched: dict[tuple[str, object], Any] = {}
        if config is not None:
            for lane in config.lanes:
                for band in BANDS:
                    self._lane_dispatched[(lane, band)] = LANE_DISPATCHED.labels(lane, band.value)
            for model in config.models:
                MODEL_SWAPS.labels(model)
                MODEL_LOAD_DURATION.labels(model)

    def on_enqueue(self, ticket: Ticket) -> None:
        pass

    def on_dispatch(self, ticket: Ticket) -> None:
        decision = ticket.decision
        if decision is None:
            return
        band = decision.band
        self._dispatched[band].inc()
        lane = self._lane_dispatched.get((ticket.lane, band))
        if lane is None:
            lane = self._lane_dispatched[(ticket.lane, band)] = LANE_DISPATCHED.labels(ticket.lane, band.value)
        lane.inc()
        self._waits[band].observe(decision.queue_wait)
        for term in decision.reordered_by:
            self._reorders[(band, term)].inc()

    def on_finish(self, ticket: Ticket) -> None:
        if ticket.outcome is None or ticket.extra.get("preload"):
            return
        if ticket.extra.get("recorded_elsewhere"):  # fleet: counted where its client is
            return
        finished = ticket.finished_at if ticket.finished_at is not None else ticket.arrival
        band = ticket.decision.band if ticket.decision is not None else band_of(ticket.priority)
        child = self._durations.get((band, ticket.outcome.value))
        if child is not None:
            child.observe(max(0.0, finished - ticket.arrival))

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
