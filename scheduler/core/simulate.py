"""Replay a request trace through the scheduler on a virtual clock.

Pure: no Django, no I/O, no clock reads, no sleeps. The management command
``manage.py simulate`` parses arguments and files and calls these functions.

The scheduler replayed is the dispatcher's own: :class:`~scheduler.core.machine.Machine`
runs the same admission strategies (:mod:`scheduler.core.admission`: serial or fifo,
lanes, slots, the router's groups or matrix, ``concurrencyLimit``, ``maxWait``,
``maxQueueDepth``, ttl, failed starts), and this module is its clock: an event loop over
arrivals, loads that complete, jobs that end, clients that leave and the machine's timer.
At each instant the events apply first, then the arrivals (so an arrival at the same
instant as a completion competes for that dispatch), then the strategies decide. A
model's start costs its cold-load time, a request its service time once its model is
ready; a start counts as a swap (the very first load included: the GPU starts empty).

Also here: the settings overrides (``--set``), the results and their table, forced and
band swaps, with ``estimate=True`` the error of the estimated wait
(:mod:`scheduler.core.estimate`), and :data:`RECOMMENDED` (the overload targets are
:mod:`scheduler.core.targets`). Traces (files, generated shapes) are :mod:`scheduler.core.traces`;
recorded history becomes a trace in :mod:`scheduler.core.replay`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.core.admission import Abort, ModelRules, Refusal, Refuse, Rules, Start
from scheduler.core.admission import Dispatch as AdmitDispatch
from scheduler.core.estimate import (
    ArrivalRates,
    EstimateError,
    RunningMeans,
    estimate_error,
    estimate_waits,
)
from scheduler.core.lanes import DEFAULT_LANE
from scheduler.core.machine import Grant, Machine, MachineEffect
from scheduler.core.policy import (
    DEFAULT_AGING_DIVISOR,
    DEFAULT_SWAP_AFFINITY_BONUS,
    Decision,
    QueuedRequest,
    SchedulerSettings,
    Term,
)
from scheduler.core.priority import BANDS, Band
from scheduler.core.settings import parse_assignments
from scheduler.core.traces import GENERATED_LOAD_SECONDS as GENERATED_LOAD_SECONDS
from scheduler.core.traces import TRACE_SHAPES as TRACE_SHAPES
from scheduler.core.traces import TraceError as TraceError
from scheduler.core.traces import TraceRequest as TraceRequest
from scheduler.core.traces import generate_trace as generate_trace
from scheduler.core.traces import load_flags as load_flags
from scheduler.core.traces import load_trace as load_trace

DEFAULT_LOAD_SECONDS = 20.0
BAND_RANK = {band: rank for rank, band in enumerate(BANDS)}
"""0 for the most urgent band."""

# -- settings overrides ----------------------------------------------------------------


def parse_overrides(
    pairs: Iterable[str], base: SchedulerSettings | None = None
) -> SchedulerSettings:
    """Apply ``name=value`` overrides (``agingDivisor=600``, ``use=fifo``,
    ``bandShare.batch=0.25``, ``agingCap=none``) to settings: any setting of the table
    (:func:`scheduler.core.settings.parse_assignments`). ``recommended`` stands for
    :data:`RECOMMENDED` (the opt-in bounds).

    Each pair may hold several comma-separated overrides. Raises :class:`SettingsError`
    naming the key for an unknown name, a missing ``=`` or an invalid value.
    """
    settings = base or SchedulerSettings()
    pairs = [RECOMMENDED if p.strip() == "recommended" else p for p in pairs]
    changes = parse_assignments(pairs, settings.raw())
    return settings.with_changes(**changes) if changes else settings


def describe_settings(settings: SchedulerSettings) -> str:
    """A short label: the settings that differ from the defaults, or ``defaults``."""
    parts = []
    if settings.use.value != "serial":
        parts.append(f"use={settings.use.value}")
    else:
        if settings.aging_divisor != DEFAULT_AGING_DIVISOR:
            parts.append(f"agingDivisor={settings.aging_divisor:g}")
        if settings.swap_affinity_bonus != DEFAULT_SWAP_AFFINITY_BONUS:
            parts.append(f"swapAffinityBonus={settings.swap_affinity_bonus}")
        if settings.aging_cap is not None:
            parts.append(f"agingCap={settings.aging_cap:g}")
        for band, share in settings.band_share.items():
            parts.append(f"bandShare.{band.value}={share:g}")
    return ",".join(parts) or "defaults"


# -- the simulation --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One job as it ran."""

    request_id: str
    model: str
    band: Band
    arrival: float
    start: float
    """The pick time."""
    finish: float
    swap: bool
    reordered_by: frozenset[Term]
    lane: str = DEFAULT_LANE

    @property
    def wait(self) -> float:
        return self.start - self.arrival


@dataclass(frozen=True, slots=True)
class BandResult:
    requests: int
    wait_p50: float
    wait_p95: float
    wait_max: float


@dataclass(frozen=True)
class SimResult:
    """What one replay of a trace under one set of settings measured."""

    label: str
    settings: SchedulerSettings
    requests: int
    swaps: int
    busy: float
    """Seconds the GPU spent loading or serving."""
    makespan: float
    """Last finish minus first arrival."""
    reordered_aging: int
    reordered_affinity: int
    bands: Mapping[Band, BandResult]
    dispatches: tuple[Dispatch, ...]
    """Every job in dispatch order."""
    reordered: Mapping[Term, int] = field(default_factory=dict)
    """Dispatches each term changed, every term present (aging and swap_affinity too)."""
    forced_swaps: int = 0
    """Swaps with nothing waiting for the loaded model: only an idle GPU avoids them."""
    band_swaps: int = 0
    """Swaps to serve a more urgent band than any waiting request of the loaded model:
    the contract orders bands first (affinity never crosses one), so the pick could not
    stay. The swaps left (``swaps - forced_swaps - band_swaps``) are the policy's choice."""
    estimate_errors: Mapping[Band, EstimateError] | None = None
    """With ``estimate=True``: how far the estimated waits were from the waits that
    followed, per band (every waiting request, estimated at every pick)."""
    lanes: int = 1
    """GPUs (lanes) the replay ran on; ``busy`` is summed over them."""
    refusals: tuple[tuple[str, Refusal], ...] = ()
    """Requests answered without a turn (bounds, limits, failed starts), in order."""

    def refused(self) -> dict[str, int]:
        """Refusals by kind (``expired``, ``queue_full``, ...)."""
        counts: dict[str, int] = {}
        for _, kind in self.refusals:
            counts[kind.value] = counts.get(kind.value, 0) + 1
        return counts

    @property
    def busy_share(self) -> float:
        """Of the time the lanes had, the share they spent loading or serving."""
        return self.busy / (self.makespan * self.lanes) if self.makespan > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "label": self.label,
            "settings": self.settings.as_dict(),
            "requests": self.requests,
            "swaps": self.swaps,
            "busy_seconds": self.busy,
            "busy_share": self.busy_share,
            "makespan_seconds": self.makespan,
            "forced_swaps": self.forced_swaps,
            "refused": self.refused(),
            "band_swaps": self.band_swaps,
            "reordered": {term.value: self.reordered.get(term, 0) for term in Term},
            "bands": {
                band.value: {
                    "requests": r.requests,
                    "wait_p50_seconds": r.wait_p50,
                    "wait_p95_seconds": r.wait_p95,
                    "wait_max_seconds": r.wait_max,
                }
                for band, r in self.bands.items()
            },
            **(
                {
                    "estimate_error": {
                        band.value: e.as_dict() for band, e in self.estimate_errors.items()
                    }
                }
                if self.estimate_errors is not None
                else {}
            ),
        }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of an ascending sequence; 0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def simulate(
    trace: Sequence[TraceRequest],
    settings: SchedulerSettings,
    load_seconds: Mapping[str, float] | None = None,
    default_load: float = DEFAULT_LOAD_SECONDS,
    label: str | None = None,
    estimate: bool = False,
    lanes: Mapping[str, str] | None = None,
    slots: Mapping[str, int] | None = None,
    rules: Rules | None = None,
) -> SimResult:
    """Replay ``trace`` (sorted by arrival, as :func:`load_trace` returns it) through the
    admission machine (:class:`~scheduler.core.machine.Machine`: the dispatcher's
    strategies) on a virtual clock.

    ``lanes`` (model -> lane; others on the default lane) and ``rules`` (the config's
    slots, concurrency limits, router, bounds and ttl: :func:`scheduler.dispatcher.rules_of`
    builds them; by default one model per lane, one request at a time) replay the box as
    the server runs it; ``slots`` (model -> N) is a shortcut for rules with slots only.
    A model's load costs its ``load_seconds`` (``default_load`` otherwise), a request its
    ``service`` once its model is ready. With ``estimate``, at every pick on an idle lane
    the estimated wait of each of its waiting requests (:mod:`scheduler.core.estimate`,
    from the means of the jobs dispatched so far) is compared with the wait that followed.
    """
    if rules is None:
        models = {m: ModelRules(slots=n) for m, n in (slots or {}).items()}
        rules = Rules(models=models, fifo_limits=False)
    lane_of = dict(lanes or {})
    machine = Machine(settings, rules, lane_of, sorted(set(lane_of.values())))
    run = _Run(trace, machine, dict(load_seconds or {}), default_load, estimate)
    run.drive()
    dispatches = run.dispatches
    errors = None
    if estimate:
        start = {d.request_id: (d.start, d.band) for d in dispatches}
        pairs: dict[Band, list[tuple[float, float]]] = {band: [] for band in BANDS}
        for request_id, at, guess in run.estimates:
            if request_id in start:
                began, band = start[request_id]
                pairs[band].append((guess, began - at))
        errors = {band: estimate_error(p) for band, p in pairs.items()}
    result = summarize(
        trace,
        dispatches,
        settings,
        label=label or describe_settings(settings),
        busy=run.busy,
        reorders=run.reorders,
        forced_swaps=run.forced,
        estimate_errors=errors,
    )
    used = {d.lane for d in dispatches} or {DEFAULT_LANE}
    return dataclasses.replace(
        result,
        band_swaps=run.band_swaps,
        lanes=len(used),
        refusals=tuple(run.refusals),
    )


def simulate_lanes(
    trace: Sequence[TraceRequest],
    settings: SchedulerSettings,
    load_seconds: Mapping[str, float] | None,
    default_load: float,
    label: str | None,
    lanes: Mapping[str, str],
    slots: Mapping[str, int],
) -> SimResult:
    """:func:`simulate` with lanes and slots (kept for its callers: one machine runs both)."""
    return simulate(trace, settings, load_seconds, default_load, label, lanes=lanes, slots=slots)


_FINISH, _READY, _GONE, _TICK = range(4)
"""Event kinds; at one instant they apply in this order, then the arrivals, then the
strategies decide (as the dispatcher applies a batch of events, then decides)."""


class _Run:
    """One replay: the event loop of the virtual clock around the machine."""

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        machine: Machine,
        loads: Mapping[str, float],
        default_load: float,
        estimate: bool,
    ) -> None:
        self.trace = trace
        self.machine = machine
        self.loads = loads
        self.default_load = default_load
        self.estimate = estimate
        self.events: list[tuple[float, int, int, str, str]] = []
        self.seq = 0
        self.by_id: dict[str, TraceRequest] = {}
        self.started: list[tuple[TraceRequest, Decision, float, bool, str]] = []
        """Each turn as it was dispatched: the job, the pick, when, whether it loaded."""
        self.finishes: dict[str, float] = {}
        self.refusals: list[tuple[str, Refusal]] = []
        self.reorders = dict.fromkeys(Term, 0)
        self.busy = 0.0
        self.busy_since: dict[str, float] = {}
        self.forced = self.band_swaps = 0
        self.means = RunningMeans()
        self.rates = ArrivalRates()
        self.estimates: list[tuple[str, float, float]] = []
        self.loading: dict[str, int] = {}
        """Lane -> the event of its load in progress (an aborted load's never comes)."""
        self.starting: dict[str, Decision] = {}
        """Lane -> the decision whose turn starts the lane's next load."""

    @property
    def dispatches(self) -> list[Dispatch]:
        """Every job in dispatch order (one never granted: finish NaN)."""
        finishes = self.finishes
        return [
            Dispatch(
                job.request_id,
                job.model,
                decision.band,
                job.arrival,
                start,
                finishes.get(job.request_id, math.nan),
                load,
                decision.reordered_by,
                lane,
            )
            for job, decision, start, load, lane in self.started
        ]

    def push(self, at: float, kind: int, a: str, b: str = "") -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, kind, self.seq, a, b))

    def drive(self) -> None:
        trace, machine, events = self.trace, self.machine, self.events
        pop, push, apply = heapq.heappop, self.push, self.apply
        arrive, decide, finish = machine.arrive, machine.decide, machine.finish
        by_id, add_rate = self.by_id, self.rates.add
        timed = machine.timed
        n, i = len(trace), 0
        armed: float | None = None
        while i < n or events:
            now = events[0][0] if events else math.inf
            if i < n and trace[i].arrival < now:
                now = trace[i].arrival
            changed = False  # whether a lane's turns or load may have changed (busy time)
            while events and events[0][0] <= now:
                _, kind, seq, a, b = pop(events)
                changed = True
                if kind == _FINISH:
                    effects = finish(now, a)
                    if effects:
                        apply(now, effects)
                elif kind == _READY:
                    if self.loading.get(a) == seq:
                        del self.loading[a]
                        apply(now, machine.ready(now, a, b))
                elif kind == _GONE:
                    effects = finish(now, a, completed=False)
                    if effects:
                        apply(now, effects)
                else:
                    armed = None
                    apply(now, machine.tick(now))
            while i < n and trace[i].arrival <= now:
                r = trace[i]
                i += 1
                by_id[r.request_id] = r
                request = QueuedRequest(r.request_id, r.model, r.priority, r.arrival)
                add_rate(request.band, r.arrival)
                refused = arrive(now, request)
                if refused:
                    apply(now, refused)
                if r.gone is not None:
                    push(r.gone, _GONE, r.request_id)
            if self.estimate:
                self.guess(now)
            effects = decide(now)
            if effects:
                apply(now, effects)
                changed = True
            if timed:
                deadline = machine.deadline()
                if deadline is not None and (armed is None or deadline < armed):
                    armed = deadline
                    push(max(deadline, now), _TICK, "")
            if changed:
                self.account(now)
            if (
                i < n
                and not timed
                and (not events or trace[i].arrival < events[0][0])
                and machine.settled()
            ):
                # No lane can take an arrival before the next event: take them in one go.
                while i < n and (not events or trace[i].arrival < events[0][0]):
                    r = trace[i]
                    i += 1
                    by_id[r.request_id] = r
                    request = QueuedRequest(r.request_id, r.model, r.priority, r.arrival)
                    add_rate(request.band, r.arrival)
                    refused = arrive(r.arrival, request)
                    if refused:
                        apply(r.arrival, refused)
                    if r.gone is not None:
                        push(r.gone, _GONE, r.request_id)

    def apply(self, now: float, effects: list[MachineEffect]) -> None:
        for effect in effects:
            kind = type(effect)
            if kind is Grant:
                rid = effect.request_id  # type: ignore[union-attr]
                finish = now + self.by_id[rid].service
                self.finishes[rid] = finish
                self.push(finish, _FINISH, rid)
            elif kind is AdmitDispatch:
                assert isinstance(effect, AdmitDispatch)
                decision = effect.decision
                job = self.by_id[decision.request_id]
                for term in decision.reordered_by:
                    self.reorders[term] += 1
                self.started.append((job, decision, now, effect.starts_load, effect.lane))
                self.means.add_service(job.model, job.service, decision.band)
                if effect.starts_load:
                    self.starting[effect.lane] = decision
            elif kind is Start:
                assert isinstance(effect, Start)
                load = self.loads.get(effect.model, self.default_load)
                self.means.add_load(effect.model, load)
                self.count_swap(effect)
                self.push(now + load, _READY, effect.lane, effect.model)
                self.loading[effect.lane] = self.seq
            elif kind is Abort:
                assert isinstance(effect, Abort)  # the load stops at once
                self.loading.pop(effect.lane, None)
                self.machine.aborted(now, effect.lane, effect.model)
            elif kind is Refuse:
                assert isinstance(effect, Refuse)
                self.refusals.append((effect.request_id, effect.kind))

    def count_swap(self, start: Start) -> None:
        """A forced swap: nothing waited for the models it replaced; a band swap: the
        pick's band was more urgent than anything waiting for them."""
        decision = self.starting.pop(start.lane, None)
        if decision is None:
            return
        most_urgent_for = self.machine.queues.lane(start.lane).most_urgent_for
        mine: int | None = None  # the best band rank waiting for a model loaded before
        models = self.machine.lanes[start.lane].models
        for model in (*start.evict, *(m for m in models if m != start.model)):
            head = most_urgent_for(model)
            if head is not None:
                rank = BAND_RANK[head.band]
                mine = rank if mine is None or rank < mine else mine
        if mine is None:
            self.forced += 1
        elif BAND_RANK[decision.band] < mine:
            self.band_swaps += 1

    def account(self, now: float) -> None:
        """Busy time: each lane's intervals with anything running or loading."""
        for name, lane in self.machine.lanes.items():
            active = bool(lane.running) or lane.swapping is not None
            if active and name not in self.busy_since:
                self.busy_since[name] = now
            elif not active and name in self.busy_since:
                self.busy += now - self.busy_since.pop(name)

    def guess(self, now: float) -> None:
        """The estimated wait of each request waiting on an idle lane, now."""
        machine = self.machine
        for name, lane in machine.lanes.items():
            queue = machine.queues.lane(name)
            if not queue or lane.running or lane.swapping is not None:
                continue
            ranked = queue.peek(now)
            times = self.means.times(self.default_load, self.rates, now)
            guesses = estimate_waits(ranked, queue.loaded_models, 0.0, times)
            self.estimates += [
                (x.request.request_id, now, g) for x, g in zip(ranked, guesses, strict=True)
            ]


def summarize(
    trace: Sequence[TraceRequest],
    dispatches: Sequence[Dispatch],
    settings: SchedulerSettings,
    label: str,
    busy: float,
    reorders: Mapping[Term, int] | None = None,
    forced_swaps: int = 0,
    estimate_errors: Mapping[Band, EstimateError] | None = None,
) -> SimResult:
    """The figures of a run, simulated or recorded (dispatches in dispatch order)."""
    reorders = dict(reorders) if reorders is not None else dict.fromkeys(Term, 0)
    if not any(reorders.values()):
        for d in dispatches:
            for term in d.reordered_by:
                reorders[term] = reorders.get(term, 0) + 1
    waits: dict[Band, list[float]] = {band: [] for band in BANDS}
    for d in dispatches:
        waits[d.band].append(d.wait)
    bands = {}
    for band, values in waits.items():
        values.sort()
        bands[band] = BandResult(
            requests=len(values),
            wait_p50=percentile(values, 50),
            wait_p95=percentile(values, 95),
            wait_max=values[-1] if values else 0.0,
        )
    first = min((r.arrival for r in trace), default=0.0)
    makespan = max((d.finish for d in dispatches), default=first) - first
    return SimResult(
        label=label,
        settings=settings,
        requests=len(dispatches),
        swaps=sum(d.swap for d in dispatches),
        busy=busy,
        makespan=makespan,
        reordered_aging=reorders.get(Term.AGING, 0),
        reordered_affinity=reorders.get(Term.SWAP_AFFINITY, 0),
        bands=bands,
        dispatches=tuple(dispatches),
        reordered=reorders,
        forced_swaps=forced_swaps,
        estimate_errors=estimate_errors,
    )


# -- the table -------------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    """``0s``, ``4.2s``, ``3m07s``, ``2h05m``, ``1d03h``."""
    if seconds <= 0:
        return "0s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _rows(result: SimResult, extra_terms: Sequence[Term] = ()) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for band in BANDS:
        r = result.bands[band]
        rows += [
            (f"{band.value} requests", str(r.requests)),
            (f"{band.value} wait p50", format_duration(r.wait_p50)),
            (f"{band.value} wait p95", format_duration(r.wait_p95)),
            (f"{band.value} wait max", format_duration(r.wait_max)),
        ]
    rows += [
        ("all requests", str(result.requests)),
        ("swaps (cold loads)", str(result.swaps)),
        ("GPU busy", f"{result.busy_share:.1%}"),
        ("makespan", format_duration(result.makespan)),
        ("reordered by aging", str(result.reordered_aging)),
        ("reordered by swap_affinity", str(result.reordered_affinity)),
    ]
    for term in extra_terms:
        rows.append((f"reordered by {term.value}", str(result.reordered.get(term, 0))))
    return rows


def table_rows(results: Sequence[SimResult]) -> tuple[list[str], list[list[str]]]:
    """The table's header (the labels) and rows (metric name, then one cell per result);
    the reorder rows of the opt-in terms only when a result uses them."""
    extra = [
        term
        for term, on in (
            (Term.AGING_CAP, any(r.settings.aging_cap is not None for r in results)),
            (Term.BAND_SHARE, any(r.settings.band_share for r in results)),
        )
        if on
    ]
    columns = [_rows(r, extra) for r in results]
    names = [name for name, _ in columns[0]] if columns else []
    header = ["", *(r.label for r in results)]
    body = [[name, *(col[k][1] for col in columns)] for k, name in enumerate(names)]
    return header, body


def format_table(results: Sequence[SimResult]) -> str:
    """Metrics as rows, one column per result (settings variant)."""
    if not results:
        return ""
    header, body = table_rows(results)
    widths = [max(len(row[c]) for row in [header, *body]) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(widths[c]) for c, cell in enumerate(cells[1:], start=1))
        return "  ".join([first, *rest]).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    for k, row in enumerate(body):
        if k and k % 4 == 0 and k <= 4 * len(BANDS):
            out.append("")  # a blank line between bands and before the totals
        out.append(line(row))
    return "\n".join(out)


RECOMMENDED = "agingCap=100,swapAffinityBonus=30,bandShare.batch=0.2"
"""The opt-in settings the README recommends for a box that is overloaded at times."""
