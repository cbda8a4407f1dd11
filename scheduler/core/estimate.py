"""Estimated wait of each waiting request: its place in line and measured times.

Pure: no Django, no clock. The estimate of a waiting request is the time until it is
picked (its queue wait, as recorded in ``queue_wait_ms``; its own model load comes
after): what is left of the running job, plus for every request ahead of it in dispatch
order the typical GPU time of its model, plus a cold load each time the line switches to
a model that is not loaded.

Requests that arrive later in a higher band go ahead of it: the time ahead is
stretched by ``1 / (1 - load of the bands above)`` (the classic priority-queue
correction), with that load measured over the last hour (:class:`ArrivalRates`). Aging
overtakes, ``bandShare`` overrides and a later request of the loaded model winning on
affinity are not predicted. ``llamaswap simulate --estimate`` measures the error on a
trace.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.core.policy import QueuedRequest, Ranked
from scheduler.core.priority import BANDS, Band

MAX_LOAD_ABOVE = 0.9
"""The stretch factor stops at 10x: beyond it the estimate would mean nothing."""
RATE_WINDOW_SECONDS = 3600.0

DEFAULT_SERVICE_SECONDS = 30.0
DEFAULT_LOAD_SECONDS = 20.0


@dataclass(frozen=True)
class ServiceTimes:
    """Typical GPU seconds per request and cold-load seconds, per model."""

    service: Mapping[str, float] = field(default_factory=dict)
    load: Mapping[str, float] = field(default_factory=dict)
    default_service: float = DEFAULT_SERVICE_SECONDS
    """For a model with no measurement yet: the mean over every model, else this."""
    default_load: float = DEFAULT_LOAD_SECONDS
    by_band: Mapping[tuple[str, Band], float] = field(default_factory=dict)
    """Per model and band (a model serves short chats and long batch jobs alike)."""
    load_above: Mapping[Band, float] = field(default_factory=dict)
    """Share of GPU time taken by arrivals of the bands above each band (0..1)."""

    def service_of(self, model: str, band: Band | None = None) -> float:
        if band is not None:
            value = self.by_band.get((model, band))
            if value is not None:
                return value
        return self.service.get(model, self.default_service)

    def stretch(self, band: Band) -> float:
        return 1.0 / (1.0 - min(MAX_LOAD_ABOVE, max(0.0, self.load_above.get(band, 0.0))))

    def load_of(self, model: str) -> float:
        return self.load.get(model, self.default_load)


def estimate_waits(
    ahead_in_order: Sequence[Ranked | QueuedRequest],
    loaded: Iterable[str],
    running_left: float,
    times: ServiceTimes,
) -> list[float]:
    """Seconds until each request (in dispatch order, as ``WaitingQueue.peek`` returns
    them) is picked. ``running_left``: what is left of the running job (0 when idle).
    O(len) in one pass."""
    resident = set(loaded)
    clock = max(0.0, running_left)
    out = []
    for item in ahead_in_order:
        request = item.request if isinstance(item, Ranked) else item
        out.append(clock * times.stretch(request.band))
        if request.model not in resident:
            clock += times.load_of(request.model)
            resident = {request.model}
        clock += times.service_of(request.model, request.band)
    return out


class RunningMeans:
    """Means per model, updated as jobs finish (what the server measures as it runs)."""

    def __init__(self, default_service: float = DEFAULT_SERVICE_SECONDS) -> None:
        self._service: dict[str, tuple[float, int]] = {}
        self._squares: dict[str, float] = {}
        """Sum of squared service seconds per model, for :meth:`spread`."""
        self._by_band: dict[tuple[str, Band], tuple[float, int]] = {}
        self._band: dict[Band, tuple[float, int]] = {}
        self._load: dict[str, tuple[float, int]] = {}
        self._default = default_service

    def add_service(self, model: str, seconds: float, band: Band | None = None) -> None:
        total, count = self._service.get(model, (0.0, 0))
        self._service[model] = (total + seconds, count + 1)
        self._squares[model] = self._squares.get(model, 0.0) + seconds * seconds
        if band is not None:
            total, count = self._by_band.get((model, band), (0.0, 0))
            self._by_band[(model, band)] = (total + seconds, count + 1)
            total, count = self._band.get(band, (0.0, 0))
            self._band[band] = (total + seconds, count + 1)

    def spread(self, model: str) -> float | None:
        """Standard deviation of ``model``'s service seconds (None under two samples)."""
        total, count = self._service.get(model, (0.0, 0))
        if count < 2:
            return None
        variance = self._squares.get(model, 0.0) / count - (total / count) ** 2
        return math.sqrt(max(0.0, variance) * count / (count - 1))

    def samples(self, model: str) -> int:
        """Finished jobs of ``model`` measured so far."""
        return self._service.get(model, (0.0, 0))[1]

    def band_mean(self, band: Band) -> float | None:
        total, count = self._band.get(band, (0.0, 0))
        return total / count if count else None

    def add_load(self, model: str, seconds: float) -> None:
        total, count = self._load.get(model, (0.0, 0))
        self._load[model] = (total + seconds, count + 1)

    def times(
        self,
        default_load: float = DEFAULT_LOAD_SECONDS,
        rates: ArrivalRates | None = None,
        now: float = 0.0,
    ) -> ServiceTimes:
        service = {m: t / c for m, (t, c) in self._service.items()}
        overall = sum(t for t, _ in self._service.values())
        count = sum(c for _, c in self._service.values())
        default = overall / count if count else self._default
        load_above: dict[Band, float] = {}
        if rates is not None:
            per_band = {
                band: rates.rate(band, now) * (self.band_mean(band) or default) for band in BANDS
            }
            above = 0.0
            for band in BANDS:  # most urgent first
                load_above[band] = above
                above += per_band[band]
        return ServiceTimes(
            service=service,
            load={m: t / c for m, (t, c) in self._load.items()},
            default_service=default,
            default_load=default_load,
            by_band={k: t / c for k, (t, c) in self._by_band.items()},
            load_above=load_above,
        )


class ArrivalRates:
    """Arrivals per second per band over the last ``window`` seconds. O(1) amortized."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        self._window = window
        self._times: dict[Band, deque[float]] = {band: deque() for band in BANDS}

    def add(self, band: Band, at: float) -> None:
        self._times[band].append(at)

    def rate(self, band: Band, now: float) -> float:
        times = self._times[band]
        while times and times[0] < now - self._window:
            times.popleft()
        return len(times) / self._window


@dataclass(frozen=True)
class EstimateError:
    """How far estimates were from the waits that followed (seconds; signed = actual -
    estimate, so > 0 means it waited longer than estimated)."""

    samples: int
    abs_p50: float
    abs_p90: float
    bias_p50: float
    within_factor_2: float
    """Share of estimates within a factor of 2 of the actual remaining wait (both over a
    minute, or both under)."""

    def as_dict(self) -> dict[str, float]:
        return {
            "samples": self.samples,
            "abs_error_p50_seconds": self.abs_p50,
            "abs_error_p90_seconds": self.abs_p90,
            "signed_error_p50_seconds": self.bias_p50,
            "within_factor_2": self.within_factor_2,
        }


def estimate_error(pairs: Iterable[tuple[float, float]]) -> EstimateError:
    """(estimate, actual) pairs into the summary."""
    errors = []
    absolute = []
    close = 0
    for estimate, actual in pairs:
        errors.append(actual - estimate)
        absolute.append(abs(actual - estimate))
        if (estimate < 60 and actual < 60) or (
            estimate > 0 and actual > 0 and 0.5 <= actual / estimate <= 2
        ):
            close += 1
    if not errors:
        return EstimateError(0, 0.0, 0.0, 0.0, 0.0)
    errors.sort()
    absolute.sort()

    def q(values: list[float], p: float) -> float:
        return values[min(len(values) - 1, int(p * len(values)))]

    return EstimateError(
        samples=len(errors),
        abs_p50=q(absolute, 0.5),
        abs_p90=q(absolute, 0.9),
        bias_p50=q(errors, 0.5),
        within_factor_2=close / len(errors),
    )


class WaitEstimator:
    """What a queue's owner keeps to estimate waits: call :meth:`arrived` on every
    request added, :meth:`finished` when a job ends (its run seconds and its load's, if
    it waited for one), and :meth:`estimates` wherever the queue is shown. Pure and
    cheap: O(1) per event, O(shown) per estimate."""

    def __init__(self, default_load: float = DEFAULT_LOAD_SECONDS) -> None:
        self.means = RunningMeans()
        self.rates = ArrivalRates()
        self.default_load = default_load

    def arrived(self, request: QueuedRequest) -> None:
        self.rates.add(request.band, request.arrival)

    def finished(
        self, model: str, band: Band, run_seconds: float, load_seconds: float | None = None
    ) -> None:
        self.means.add_service(model, max(0.0, run_seconds), band)
        if load_seconds is not None and load_seconds > 0:
            self.means.add_load(model, load_seconds)

    def running_left(
        self, model: str, band: Band, started: float, now: float, loading: bool = False
    ) -> float:
        """What is probably left of the running job (0 once it overruns its mean)."""
        return max(0.0, self.usual(model, band, loading) - (now - started))

    def usual(self, model: str, band: Band, loading: bool = False) -> float:
        """A job's usual time: its model's (and band's) mean, plus a load if it loads."""
        times = self.means.times(self.default_load)
        return times.service_of(model, band) + (times.load_of(model) if loading else 0.0)

    def estimates(
        self,
        in_order: Sequence[Ranked | QueuedRequest],
        loaded: Iterable[str],
        running_left: float,
        now: float,
    ) -> list[float]:
        """Seconds until each shown request (in dispatch order) is picked."""
        times = self.means.times(self.default_load, self.rates, now)
        return estimate_waits(in_order, loaded, running_left, times)


@dataclass(frozen=True)
class WaitRange:
    """A waiting request's estimated wait as a person should read it (:func:`wait_range`)."""

    seconds: float
    """The point estimate (:func:`estimate_waits`)."""
    low: float
    """It will probably wait at least this long."""
    high: float | None
    """... and probably at most this long; None: unknown (the running job overran)."""
    at_least: bool
    """The running job is past its usual time: nobody knows when it ends, so the wait is
    at least ``seconds`` plus whatever the running job still takes."""
    overrun: float
    """Seconds the running job is past its usual time (0 when it is not)."""
    measured: bool
    """The figures come from finished jobs (else from defaults: a guess)."""


def wait_range(
    estimate: float,
    *,
    spread: float,
    running_usual: float | None,
    running_elapsed: float,
    measured: bool = True,
) -> WaitRange:
    """How to read ``estimate`` (seconds until the request is picked, from
    :func:`estimate_waits`).

    ``spread``: the standard deviation of the time ahead (the jobs ahead and what is left
    of the running one, :func:`spreads`); the likely range is the estimate plus or
    minus it. ``running_usual``: the running job's usual time (its model's mean, plus a
    load if it is loading), None when the lane is idle; ``running_elapsed``: how long it
    has run. Once it has run past its usual time, :func:`estimate_waits` counts nothing
    left of it, so the estimate becomes a floor: ``at_least``, no upper bound."""
    estimate = max(0.0, estimate)
    spread = max(0.0, spread)
    overrun = 0.0
    if running_usual is not None and running_elapsed > running_usual:
        overrun = running_elapsed - running_usual
    if overrun > 0:
        return WaitRange(estimate, estimate, None, True, overrun, measured)
    return WaitRange(estimate, max(0.0, estimate - spread), estimate + spread, False, 0.0, measured)


def spreads(
    models_in_order: Iterable[str], running: Iterable[str], means: RunningMeans
) -> list[float]:
    """For each request of a lane in dispatch order (its model in ``models_in_order``):
    the standard deviation of the time until it is picked, counting the running jobs
    (``running``: their models) and the jobs ahead of it as independent (their variances
    add). A model with fewer than two measured jobs counts half its mean (else the
    default service time) as its spread. O(len) in one pass."""
    times = means.times()
    cache: dict[str, float] = {}

    def variance(model: str) -> float:
        value = cache.get(model)
        if value is None:
            sd = means.spread(model)
            if sd is None:
                sd = 0.5 * times.service_of(model)
            value = cache[model] = sd * sd
        return value

    total = sum(variance(model) for model in running)
    out = []
    for model in models_in_order:
        out.append(math.sqrt(total))
        total += variance(model)
    return out
