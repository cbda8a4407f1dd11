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
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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

# The generator's models and their cold-load times: a small chat model, a larger one
# and an image model (``--load-seconds`` flags are printed for them).
GENERATED_LOAD_SECONDS: dict[str, float] = {"qwen3": 15.0, "llama3": 30.0, "flux": 45.0}

# Settings names accepted by --set / --compare, as in the YAML (routing.scheduler...).
SETTING_NAMES: dict[str, str] = {
    "use": "use",
    "agingDivisor": "aging_divisor",
    "swapAffinityBonus": "swap_affinity_bonus",
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

    Each pair may hold several comma-separated overrides. Raises :class:`SettingsError`
    naming the key for an unknown name, a missing ``=`` or an invalid value.
    """
    settings = base or SchedulerSettings()
    changes: dict[str, object] = {}
    for pair in pairs:
        for item in pair.split(","):
            item = item.strip()
            if not item or item in ("default", "defaults"):
                continue
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep:
                raise SettingsError(name, item, "expected name=value")
            if name not in SETTING_NAMES:
                known = ", ".join(SETTING_NAMES)
                raise SettingsError(name, value, f"unknown setting (known: {known})")
            changes[SETTING_NAMES[name]] = _setting_value(value.strip())
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

    @property
    def busy_share(self) -> float:
        return self.busy / self.makespan if self.makespan > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "label": self.label,
            "settings": self.settings.as_dict(),
            "requests": self.requests,
            "swaps": self.swaps,
            "busy_seconds": self.busy,
            "busy_share": self.busy_share,
            "makespan_seconds": self.makespan,
            "reordered": {
                Term.AGING.value: self.reordered_aging,
                Term.SWAP_AFFINITY.value: self.reordered_affinity,
            },
            "bands": {
                band.value: {
                    "requests": r.requests,
                    "wait_p50_seconds": r.wait_p50,
                    "wait_p95_seconds": r.wait_p95,
                    "wait_max_seconds": r.wait_max,
                }
                for band, r in self.bands.items()
            },
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
) -> SimResult:
    """Replay ``trace`` (sorted by arrival, as :func:`load_trace` returns it)."""
    loads = dict(load_seconds or {})
    queue = WaitingQueue(settings)
    pick, add = queue.pick, queue.add  # the hot loop: bind once
    n = len(trace)
    i = 0
    free_at = -math.inf
    loaded: str | None = None
    busy = 0.0
    swaps = aging = affinity = 0
    dispatches: list[Dispatch] = []
    waits: dict[Band, list[float]] = {band: [] for band in BANDS}
    by_id: dict[str, TraceRequest] = {}
    while i < n or len(queue):
        # The next dispatch instant: the running job's end, or the next arrival if idle.
        now = free_at if len(queue) else max(free_at, trace[i].arrival)
        while i < n and trace[i].arrival <= now:
            r = trace[i]
            by_id[r.request_id] = r
            add(QueuedRequest(r.request_id, r.model, r.priority, r.arrival))
            i += 1
        decision = pick(now)
        assert decision is not None
        job = by_id.pop(decision.request_id)
        cost = job.service
        swap = decision.model != loaded
        if swap:
            cost += loads.get(decision.model, default_load)
            loaded = decision.model
            queue.set_loaded_model(loaded)
            swaps += 1
        reordered = decision.reordered_by
        if reordered:
            aging += Term.AGING in reordered
            affinity += Term.SWAP_AFFINITY in reordered
        free_at = now + cost
        busy += cost
        waits[decision.band].append(now - job.arrival)
        dispatches.append(
            Dispatch(
                job.request_id, job.model, decision.band, job.arrival, now, free_at, swap, reordered
            )
        )
    bands = {}
    for band, values in waits.items():
        values.sort()
        bands[band] = BandResult(
            requests=len(values),
            wait_p50=percentile(values, 50),
            wait_p95=percentile(values, 95),
            wait_max=values[-1] if values else 0.0,
        )
    makespan = free_at - trace[0].arrival if trace else 0.0
    return SimResult(
        label=label or describe_settings(settings),
        settings=settings,
        requests=n,
        swaps=swaps,
        busy=busy,
        makespan=makespan,
        reordered_aging=aging,
        reordered_affinity=affinity,
        bands=bands,
        dispatches=tuple(dispatches),
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


def _rows(result: SimResult) -> list[tuple[str, str]]:
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
    return rows


def format_table(results: Sequence[SimResult]) -> str:
    """Metrics as rows, one column per result (settings variant)."""
    if not results:
        return ""
    columns = [_rows(r) for r in results]
    names = [name for name, _ in columns[0]]
    header = ["", *(r.label for r in results)]
    body = [[name, *(col[k][1] for col in columns)] for k, name in enumerate(names)]
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


def generate_trace(n: int = 1000, seed: int = 0) -> list[TraceRequest]:
    """A synthetic trace of ``n`` requests, the same for the same seed.

    One simulated day per 1000 requests. In it: interactive chat in bursts (a person
    sending 3-12 messages a few seconds apart, service 1-10 s, mostly during the
    working day), a steady normal stream (service 5-60 s), and a flood of batch jobs
    submitted at once by one caller (200 a day, arriving within 5 minutes, service
    60-900 s log-uniform). Roughly 20% batch, 45% interactive, 35% normal. Models:
    qwen3 and llama3 for chat, flux for renders; see :data:`GENERATED_LOAD_SECONDS`.
    Priorities are the anchors plus a tier offset 0, +1 or +2.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
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


def load_flags(loads: Mapping[str, float]) -> str:
    """``--load-seconds`` flags for a mapping of model to seconds."""
    return " ".join(f"--load-seconds {model}={seconds:g}" for model, seconds in loads.items())
