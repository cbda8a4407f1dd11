"""Replay a request trace through the real WaitingQueue on a virtual clock.

Pure: no Django, no I/O, no clock reads, no sleeps. The management command
``manage.py simulate`` parses arguments and files and calls these functions.

The model is the spec's serial GPU (docs/scheduling.md): one job at a
time, non-preemptive. The loop is event-driven over two kinds of events, arrivals and
the completion of the running job; because the GPU runs one job, "the next completion"
is a single number rather than a heap. At each dispatch instant every arrival at or
before that instant is added first (so an arrival at the same instant as a completion
competes for that dispatch), then the queue picks. A pick of a model other than the
loaded one costs that model's cold-load time before its service time, and counts as a
swap (the very first load included: the GPU starts empty).

Also here: three generated trace shapes (:func:`generate_trace`: overload, steady,
bursty), the overload targets (:func:`check_targets`, :data:`RECOMMENDED`), forced swaps
(nothing waiting for the loaded model), and with ``estimate=True`` the error of the
estimated wait (:mod:`scheduler.core.estimate`). Recorded history becomes a trace in
:mod:`scheduler.core.replay`. One queue, one GPU, one job at a time: a multi-lane run
would keep one :class:`WaitingQueue` and one ``free_at`` per lane in the same loop.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from scheduler.core.estimate import (
    ArrivalRates,
    EstimateError,
    RunningMeans,
    estimate_error,
    estimate_waits,
)
from scheduler.core.lanes import DEFAULT_LANE, LaneQueues, fill_slots
from scheduler.core.policy import (
    DEFAULT_AGING_DIVISOR,
    DEFAULT_SWAP_AFFINITY_BONUS,
    QueuedRequest,
    SchedulerSettings,
    SettingsError,
    Term,
)
from scheduler.core.priority import BANDS, Band, parse_priority
from scheduler.core.queue import WaitingQueue

DEFAULT_LOAD_SECONDS = 20.0
BAND_RANK = {band: rank for rank, band in enumerate(BANDS)}
"""0 for the most urgent band."""

# The generator's models and their cold-load times: a small chat model, a larger one
# and an image model (``--load-seconds`` flags are printed for them).
GENERATED_LOAD_SECONDS: dict[str, float] = {"qwen3": 15.0, "llama3": 30.0, "flux": 45.0}

# Settings names accepted by --set / --compare, as in the YAML (routing.scheduler...).
# ``bandShare`` is given per band: ``bandShare.batch=0.25``; ``agingCap=none`` removes a cap.
SETTING_NAMES: dict[str, str] = {
    "use": "use",
    "agingDivisor": "aging_divisor",
    "swapAffinityBonus": "swap_affinity_bonus",
    "agingCap": "aging_cap",
    "bandShare": "band_share",
}


class TraceError(ValueError):
    """A bad trace line; ``line`` is 1-based."""

    def __init__(self, line: int, problem: str) -> None:
        self.line = line
        self.problem = problem
        super().__init__(f"line {line}: {problem}")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    request_id: str
    arrival: float
    """Seconds from any origin."""
    model: str
    priority: int
    service: float
    """Seconds on the GPU once the model is loaded."""

    def as_json(self) -> str:
        return json.dumps(
            {
                "id": self.request_id,
                "arrival": self.arrival,
                "model": self.model,
                "priority": self.priority,
                "service": self.service,
            }
        )


# -- trace loading ---------------------------------------------------------------------


def _number(obj: Mapping[str, Any], key: str, line: int) -> float:
    if key not in obj:
        raise TraceError(line, f"missing {key!r}")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(line, f"{key!r} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise TraceError(line, f"{key!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def _priority(obj: Mapping[str, Any], line: int) -> int:
    """An int as is; a string with the header's semantics (aliases, else 0); absent is 0."""
    value = obj.get("priority")
    if value is None or isinstance(value, str):
        return parse_priority(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TraceError(line, f"'priority' must be an integer or a string, got {value!r}")


def load_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Parse JSONL trace lines (blank lines skipped) into requests sorted by arrival.

    Each line is an object with ``arrival`` and ``service`` (seconds >= 0), ``model``
    (non-empty string), ``priority`` (an int as is, or a string parsed like the
    X-LlamaSwap-Priority header: aliases, else 0) and an optional ``id`` (string or
    int; default ``line<N>``). Raises :class:`TraceError` naming the line.
    """
    requests: list[TraceRequest] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(number, f"not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(number, "expected a JSON object")
        model = obj.get("model")
        if not isinstance(model, str) or not model:
            raise TraceError(number, f"'model' must be a non-empty string, got {model!r}")
        raw_id = obj.get("id", f"line{number}")
        if isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or raw_id == "":
            raise TraceError(number, f"'id' must be a non-empty string or an int, got {raw_id!r}")
        request_id = str(raw_id)
        if request_id in seen:
            raise TraceError(
                number, f"duplicate id {request_id!r} (first on line {seen[request_id]})"
            )
        seen[request_id] = number
        requests.append(
            TraceRequest(
                request_id=request_id,
                arrival=_number(obj, "arrival", number),
                model=model,
                priority=_priority(obj, number),
                service=_number(obj, "service", number),
            )
        )
    requests.sort(key=lambda r: r.arrival)  # stable: equal arrivals keep file order
    return requests


# -- settings overrides ----------------------------------------------------------------


def _setting_value(text: str) -> object:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_overrides(
    pairs: Iterable[str], base: SchedulerSettings | None = None
) -> SchedulerSettings:
    """Apply ``name=value`` overrides (``agingDivisor=600``, ``use=fifo``) to settings.
    ``recommended`` stands for :data:`RECOMMENDED` (the opt-in bounds).

    Each pair may hold several comma-separated overrides. Raises :class:`SettingsError`
    naming the key for an unknown name, a missing ``=`` or an invalid value.
    """
    settings = base or SchedulerSettings()
    changes: dict[str, object] = {}
    shares: dict[str, object] = {b.value: s for b, s in settings.band_share.items()}
    pairs = [RECOMMENDED if p.strip() == "recommended" else p for p in pairs]
    for pair in pairs:
        for item in pair.split(","):
            item = item.strip()
            if not item or item in ("default", "defaults"):
                continue
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep:
                raise SettingsError(name, item, "expected name=value")
            if name.startswith("bandShare."):
                shares[name.removeprefix("bandShare.")] = _setting_value(value.strip())
                changes["band_share"] = shares
                continue
            if name not in SETTING_NAMES or name == "bandShare":
                known = ", ".join([*SETTING_NAMES][:-1]) + ", bandShare.<band>"
                raise SettingsError(name, value, f"unknown setting (known: {known})")
            parsed = _setting_value(value.strip())
            if name == "agingCap" and parsed in ("none", "null", ""):
                parsed = None
            changes[SETTING_NAMES[name]] = parsed
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
) -> SimResult:
    """Replay ``trace`` (sorted by arrival, as :func:`load_trace` returns it).

    With ``estimate``, at every pick the estimated wait of every waiting request
    (:mod:`scheduler.core.estimate`, from the means of the jobs finished so far) is
    compared with the wait that followed. ``lanes`` (model -> lane; others on the default
    lane) and ``slots`` (model -> N) replay a box with several GPUs and models served N
    at a time, as the dispatcher runs them (:func:`simulate_lanes`).
    """
    if lanes or any(n > 1 for n in (slots or {}).values()):
        return simulate_lanes(
            trace, settings, load_seconds, default_load, label, lanes or {}, slots or {}
        )
    loads = dict(load_seconds or {})
    queue = WaitingQueue(settings)
    pick, add = queue.pick, queue.add  # the hot loop: bind once
    n = len(trace)
    i = 0
    free_at = -math.inf
    loaded: str | None = None
    busy = 0.0
    swaps = forced = band_swaps = 0
    reorders = dict.fromkeys(Term, 0)
    dispatches: list[Dispatch] = []
    by_id: dict[str, TraceRequest] = {}
    means = RunningMeans()
    rates = ArrivalRates()
    estimates: list[tuple[str, float, float]] = []  # (request id, at, estimated wait)
    while i < n or len(queue):
        # The next dispatch instant: the running job's end, or the next arrival if idle.
        now = free_at if len(queue) else max(free_at, trace[i].arrival)
        while i < n and trace[i].arrival <= now:
            r = trace[i]
            by_id[r.request_id] = r
            request = QueuedRequest(r.request_id, r.model, r.priority, r.arrival)
            add(request)
            rates.add(request.band, r.arrival)
            i += 1
        if estimate:
            ranked = queue.peek(now)
            times = means.times(default_load, rates, now)
            guesses = estimate_waits(ranked, queue.loaded_models, 0.0, times)
            estimates += [
                (x.request.request_id, now, g) for x, g in zip(ranked, guesses, strict=True)
            ]
        mine = queue.most_urgent_for(loaded) if loaded is not None else None
        decision = pick(now)
        assert decision is not None
        job = by_id.pop(decision.request_id)
        cost = job.service
        swap = decision.model != loaded
        if swap:
            load = loads.get(decision.model, default_load)
            cost += load
            means.add_load(decision.model, load)
            loaded = decision.model
            queue.set_loaded_model(loaded)
            swaps += 1
            if mine is None:
                forced += 1
            elif BAND_RANK[decision.band] < BAND_RANK[mine.band]:
                band_swaps += 1
        means.add_service(job.model, job.service, decision.band)
        reordered = decision.reordered_by
        for term in reordered:
            reorders[term] += 1
        free_at = now + cost
        busy += cost
        dispatches.append(
            Dispatch(
                job.request_id, job.model, decision.band, job.arrival, now, free_at, swap, reordered
            )
        )
    errors = None
    if estimate:
        start = {d.request_id: (d.start, d.band) for d in dispatches}
        pairs: dict[Band, list[tuple[float, float]]] = {band: [] for band in BANDS}
        for request_id, at, guess in estimates:
            began, band = start[request_id]
            pairs[band].append((guess, began - at))
        errors = {band: estimate_error(p) for band, p in pairs.items()}
    result = summarize(
        trace,
        dispatches,
        settings,
        label=label or describe_settings(settings),
        busy=busy,
        reorders=reorders,
        forced_swaps=forced,
        estimate_errors=errors,
    )
    return dataclasses.replace(result, band_swaps=band_swaps)


def simulate_lanes(
    trace: Sequence[TraceRequest],
    settings: SchedulerSettings,
    load_seconds: Mapping[str, float] | None,
    default_load: float,
    label: str | None,
    lanes: Mapping[str, str],
    slots: Mapping[str, int],
) -> SimResult:
    """The serial scheduler on several lanes, with slots: each lane picks from its own
    queue by score when it is idle; while it runs requests of a model with ``slots: N``
    it admits more of that model up to N as long as the lane's best waiting request is
    for it (:func:`scheduler.core.lanes.fill_slots`), then drains before the next swap.
    A swap's load is paid by the requests admitted with it; requests joining a loading
    model start when it is ready. ``busy`` is summed over lanes (time each lane had
    anything running or loading)."""
    loads = dict(load_seconds or {})
    queues = LaneQueues(settings, lanes, sorted(set(lanes.values())))
    names = queues.names
    loaded: dict[str, str | None] = dict.fromkeys(names, None)
    running: dict[str, int] = dict.fromkeys(names, 0)
    ready_at: dict[str, float] = dict.fromkeys(names, -math.inf)
    busy_since: dict[str, float] = {}
    finishes: list[tuple[float, int, str]] = []  # (time, seq, lane)
    seq = 0
    busy = 0.0
    forced = 0
    reorders = dict.fromkeys(Term, 0)
    dispatches: list[Dispatch] = []
    by_id: dict[str, TraceRequest] = {}
    n, i = len(trace), 0
    while i < n or finishes or len(queues):
        # The next event: a job's end or an arrival, whichever comes first.
        candidates = []
        if finishes:
            candidates.append(finishes[0][0])
        if i < n:
            candidates.append(trace[i].arrival)
        if not candidates:
            break  # requests wait on a lane that can never run them (cannot happen)
        now = min(candidates)
        while finishes and finishes[0][0] <= now:
            _, _, lane = heapq.heappop(finishes)
            running[lane] -= 1
            if running[lane] == 0:
                busy += now - busy_since.pop(lane)
        while i < n and trace[i].arrival <= now:
            r = trace[i]
            by_id[r.request_id] = r
            queues.add(QueuedRequest(r.request_id, r.model, r.priority, r.arrival))
            i += 1
        for lane in names:
            queue = queues.lane(lane)
            if not queue:
                continue
            admitted = []
            model = loaded[lane]
            if running[lane] == 0:
                nothing_for_loaded = model is None or not queue.waiting_for(model)
                decision = queues.pick(now, lane)
                assert decision is not None
                if decision.model != model:
                    model = loaded[lane] = decision.model
                    queue.set_loaded_models([model])
                    ready_at[lane] = now + loads.get(model, default_load)
                    forced += nothing_for_loaded
                    admitted.append((decision, True))
                else:
                    admitted.append((decision, False))
                busy_since[lane] = now
            if model is not None:
                limit = slots.get(model, 1)
                busy_now = running[lane] + len(admitted)
                if limit > 1 and busy_now < limit:
                    admitted += [
                        (d, False) for d in fill_slots(queues, lane, now, model, busy_now, limit)
                    ]
            for decision, swap in admitted:
                job = by_id.pop(decision.request_id)
                if swap:  # the same arithmetic as simulate(): equal floats on one lane
                    finish = now + (job.service + loads.get(job.model, default_load))
                else:
                    finish = max(now, ready_at[lane]) + job.service
                seq += 1
                heapq.heappush(finishes, (finish, seq, lane))
                running[lane] += 1
                for term in decision.reordered_by:
                    reorders[term] += 1
                dispatches.append(
                    Dispatch(
                        job.request_id,
                        job.model,
                        decision.band,
                        job.arrival,
                        now,
                        finish,
                        swap,
                        decision.reordered_by,
                        lane,
                    )
                )
    result = summarize(
        trace,
        dispatches,
        settings,
        label=label or describe_settings(settings),
        busy=busy,
        reorders=reorders,
        forced_swaps=forced,
    )
    used = {d.lane for d in dispatches} or {DEFAULT_LANE}
    return dataclasses.replace(result, lanes=len(used))


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


# -- the generator ---------------------------------------------------------------------

_DAY = 86_400.0
_REQUESTS_PER_DAY = 1000
_FLOOD_SIZE = 200
_FLOOD_WINDOW = 300.0
"""A flood arrives within this many seconds (one script submitting its jobs)."""


def _overload_trace(n: int, seed: int) -> list[TraceRequest]:
    """The overloaded trace of ``n`` requests, the same for the same seed.

    One simulated day per 1000 requests. In it: interactive chat in bursts (a person
    sending 3-12 messages a few seconds apart, service 1-10 s, mostly during the
    working day), a steady normal stream (service 5-60 s), and a flood of batch jobs
    submitted at once by one caller (200 a day, arriving within 5 minutes, service
    60-900 s log-uniform). Roughly 20% batch, 45% interactive, 35% normal. Models:
    qwen3 and llama3 for chat, flux for renders; see :data:`GENERATED_LOAD_SECONDS`.
    Priorities are the anchors plus a tier offset 0, +1 or +2.
    """
    rng = random.Random(seed)
    horizon = max(3600.0, _DAY * n / _REQUESTS_PER_DAY)
    n_batch = n // 5
    n_inter = round(n * 0.45)
    n_normal = n - n_batch - n_inter
    raw: list[tuple[float, str, int, float]] = []  # (arrival, model, priority, service)

    def tier() -> int:
        return rng.choice((0, 0, 0, 1, 2))

    # Batch floods: ceil(n_batch / 200) floods, one caller and one model each.
    floods = math.ceil(n_batch / _FLOOD_SIZE)
    left = n_batch
    for f in range(floods):
        size = min(_FLOOD_SIZE, left)
        left -= size
        start = horizon * (f + rng.uniform(0.05, 0.4)) / floods
        model = rng.choices(("flux", "llama3"), weights=(3, 1))[0]
        offset = tier()
        for _ in range(size):
            service = math.exp(rng.uniform(math.log(60), math.log(900)))
            raw.append((start + rng.uniform(0, _FLOOD_WINDOW), model, -100 + offset, service))

    # Normal: a steady Poisson stream over the whole horizon.
    t = 0.0
    rate = n_normal / horizon if n_normal else 0.0
    for _ in range(n_normal):
        t += rng.expovariate(rate)
        model = rng.choices(("llama3", "qwen3", "flux"), weights=(5, 3, 2))[0]
        raw.append((t % horizon, model, tier(), rng.uniform(5, 60)))

    # Interactive: bursts (chat sessions), mostly between 08:00 and 20:00.
    left = n_inter
    while left > 0:
        size = min(left, rng.randint(3, 12))
        left -= size
        day = rng.randrange(max(1, math.ceil(horizon / _DAY)))
        hour = rng.uniform(8, 20) if rng.random() < 0.85 else rng.uniform(0, 24)
        t = day * _DAY + hour * 3600
        if t >= horizon:  # a short trace (under a day): anywhere in it
            t = rng.uniform(0, horizon)
        model = rng.choices(("qwen3", "llama3"), weights=(7, 3))[0]
        offset = tier()
        for _ in range(size):
            raw.append((t, model, 100 + offset, rng.uniform(1, 10)))
            t += rng.uniform(5, 40)  # read, think, type

    return _finish(raw)


_Raw = tuple[float, str, int, float]
"""(arrival, model, priority, service) of a generated request."""


def _finish(raw: list[_Raw]) -> list[TraceRequest]:
    raw.sort(key=lambda item: item[0])
    return [
        TraceRequest(
            request_id=f"r{k:06d}",
            arrival=round(arrival, 3),
            model=model,
            priority=priority,
            service=round(service, 1),
        )
        for k, (arrival, model, priority, service) in enumerate(raw)
    ]


def _mixed_request(rng: random.Random) -> tuple[str, int, float]:
    """One request of the steady and bursty traces: 45% interactive chat (1-10 s), 35%
    normal (5-60 s), 20% batch (60-900 s log-uniform, flux or llama3); tier offsets."""
    tier = rng.choice((0, 0, 0, 1, 2))
    kind = rng.random()
    if kind < 0.45:
        model = rng.choices(("qwen3", "llama3"), weights=(7, 3))[0]
        return model, 100 + tier, rng.uniform(1, 10)
    if kind < 0.80:
        model = rng.choices(("llama3", "qwen3", "flux"), weights=(5, 3, 2))[0]
        return model, tier, rng.uniform(5, 60)
    model = rng.choices(("flux", "llama3"), weights=(3, 1))[0]
    return model, -100 + tier, math.exp(rng.uniform(math.log(60), math.log(900)))


def _steady_trace(n: int, seed: int, load: float = 0.7) -> list[TraceRequest]:
    """Poisson arrivals of the mixed requests, the GPU ``load`` busy with service alone
    (cold loads come on top)."""
    rng = random.Random(seed)
    jobs = [_mixed_request(rng) for _ in range(n)]
    horizon = sum(job[2] for job in jobs) / load
    rate = n / horizon if horizon else 0.0
    raw: list[_Raw] = []
    t = 0.0
    for model, priority, service in jobs:
        t += rng.expovariate(rate)
        raw.append((t, model, priority, service))
    return _finish(raw)


def _bursty_trace(n: int, seed: int) -> list[TraceRequest]:
    """Bursts of the mixed requests: every burst offers twice what the GPU can do while
    it lasts, then the box is quiet long enough that it is 60% busy overall; batch jobs
    come in bursts too (a script submitting 5-30 at once)."""
    rng = random.Random(seed)
    raw: list[_Raw] = []
    t = 0.0
    made = 0
    while made < n:
        size = min(n - made, rng.randint(20, 80))
        jobs = [_mixed_request(rng) for _ in range(size)]
        work = sum(job[2] for job in jobs)
        window = work / 2.0  # offered at twice the GPU's speed
        batch_at = t + rng.uniform(0, window)
        for model, priority, service in jobs:
            at = batch_at + rng.uniform(0, 60) if priority <= -50 else t + rng.uniform(0, window)
            raw.append((at, model, priority, service))
        made += size
        t += work / 0.6  # the next burst once the box has been 60% busy on average
    return _finish(raw)


TRACE_SHAPES = ("overload", "steady", "bursty")


def generate_trace(n: int = 1000, seed: int = 0, shape: str = "overload") -> list[TraceRequest]:
    """A synthetic trace of ``n`` requests, the same for the same seed and shape.

    ``overload`` (the default): :func:`_overload_trace`, a day with a flood of 200 batch
    jobs; ``steady``: Poisson arrivals keeping the GPU 70% busy; ``bursty``: bursts at
    twice the GPU's speed, 60% busy overall.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if shape == "overload":
        return _overload_trace(n, seed)
    if shape == "steady":
        return _steady_trace(n, seed)
    if shape == "bursty":
        return _bursty_trace(n, seed)
    raise ValueError(f"unknown trace shape {shape!r} (known: {', '.join(TRACE_SHAPES)})")


def load_flags(loads: Mapping[str, float]) -> str:
    """``--load-seconds`` flags for a mapping of model to seconds."""
    return " ".join(f"--load-seconds {model}={seconds:g}" for model, seconds in loads.items())


# -- the targets -----------------------------------------------------------------------

RECOMMENDED = "agingCap=100,swapAffinityBonus=30,bandShare.batch=0.2"
"""The opt-in settings the README recommends for a box that is overloaded at times."""


@dataclass(frozen=True)
class TargetCheck:
    """One trace: fifo, the spec's defaults and a candidate side by side, with the
    ratios the targets bound and what no order could beat."""

    shape: str
    fifo: SimResult
    defaults: SimResult
    candidate: SimResult
    batch_first_max: float
    """Batch maximum wait when batch goes before everything (arrival order): the least
    any order of the same jobs can give the batch band's last job, loads aside."""

    def ratios(self) -> dict[str, float]:
        f, c = self.fifo, self.candidate
        return {
            "interactive_p95": _ratio(
                c.bands[Band.INTERACTIVE].wait_p95, f.bands[Band.INTERACTIVE].wait_p95
            ),
            "batch_max": _ratio(c.bands[Band.BATCH].wait_max, f.bands[Band.BATCH].wait_max),
            "swaps": _ratio(c.swaps, f.swaps),
        }


TARGETS = {"interactive_p95": 1.1, "batch_max": 0.7, "swaps": 0.5}


def _ratio(a: float, b: float) -> float:
    return a / b if b else (1.0 if not a else math.inf)


def batch_first(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    """The same trace with every batch request above every other (for the bound)."""
    return [
        TraceRequest(
            r.request_id, r.arrival, r.model, 10_000 if r.priority <= -50 else r.priority, r.service
        )
        for r in trace
    ]


def check_targets(
    shape: str,
    trace: Sequence[TraceRequest],
    candidate: SchedulerSettings,
    loads: Mapping[str, float],
    label: str | None = None,
) -> TargetCheck:
    fifo_settings = SchedulerSettings.create(use="fifo")
    first = simulate(batch_first(trace), fifo_settings, loads)
    batch_ids = {r.request_id for r in trace if r.priority <= -50}
    bound = max((d.wait for d in first.dispatches if d.request_id in batch_ids), default=0.0)
    return TargetCheck(
        shape=shape,
        fifo=simulate(trace, fifo_settings, loads, label="use=fifo"),
        defaults=simulate(trace, SchedulerSettings(), loads, label="defaults"),
        candidate=simulate(trace, candidate, loads, label=label),
        batch_first_max=bound,
    )


def _show(result: SimResult, key: str) -> str:
    if key == "interactive_p95":
        return format_duration(result.bands[Band.INTERACTIVE].wait_p95)
    if key == "batch_max":
        return format_duration(result.bands[Band.BATCH].wait_max)
    return str(result.swaps)


def format_targets(checks: Sequence[TargetCheck]) -> str:
    """The targets as a Markdown table (README and BENCHMARKS.md)."""
    out = [
        "| trace | measure | fifo | defaults | candidate | candidate / fifo | target | |",
        "| :-- | :-- | --: | --: | --: | --: | --: | :-- |",
    ]
    for check in checks:
        ratios = check.ratios()
        rows = [
            ("interactive wait p95", "interactive_p95"),
            ("batch wait max", "batch_max"),
            ("swaps", "swaps"),
        ]
        for name, key in rows:
            target = TARGETS[key]
            met = "met" if ratios[key] <= target + 1e-9 else "**missed**"
            out.append(
                f"| {check.shape} | {name} | {_show(check.fifo, key)} | "
                f"{_show(check.defaults, key)} | {_show(check.candidate, key)} | "
                f"{ratios[key]:.2f}x | <= {target:g}x | {met} |"
            )
        out.append(
            f"| {check.shape} | batch wait max, batch before everything (bound) | | | "
            f"{format_duration(check.batch_first_max)} | "
            f"{_ratio(check.batch_first_max, check.fifo.bands[Band.BATCH].wait_max):.2f}x | | |"
        )
        out.append(
            f"| {check.shape} | swaps forced (nothing waiting for the loaded model) | "
            f"{check.fifo.forced_swaps} | {check.defaults.forced_swaps} | "
            f"{check.candidate.forced_swaps} | "
            f"{_ratio(check.candidate.forced_swaps, check.fifo.swaps):.2f}x | | |"
        )
        out.append(
            f"| {check.shape} | swaps decided by band (a more urgent band for another model) | "
            f"{check.fifo.band_swaps} | {check.defaults.band_swaps} | "
            f"{check.candidate.band_swaps} | "
            f"{_ratio(check.candidate.band_swaps, check.fifo.swaps):.2f}x | | |"
        )
        free = [r.swaps - r.forced_swaps - r.band_swaps for r in (check.fifo, check.defaults, check.candidate)]
        out.append(
            f"| {check.shape} | swaps left to the policy's choice | {free[0]} | {free[1]} | "
            f"{free[2]} | {_ratio(free[2], check.fifo.swaps):.2f}x | | |"
        )
    return "\n".join(out)
