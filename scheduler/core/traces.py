"""Traces: requests with their arrival, model, priority and service time.

A JSONL trace file (:func:`load_trace`), the three generated shapes
(:func:`generate_trace`: overload, steady, bursty) and the cold-load times of the
generated models. Replayed by :mod:`scheduler.core.simulate`; recorded history becomes a
trace in :mod:`scheduler.core.replay`.

Pure: no Django, I/O or clock reads.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from scheduler.core.priority import parse_priority

# The generator's models and their cold-load times: a small chat model, a larger one
# and an image model (``--load-seconds`` flags are printed for them).
GENERATED_LOAD_SECONDS: dict[str, float] = {"qwen3": 15.0, "llama3": 30.0, "flux": 45.0}


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
    gone: float | None = None
    """When its client left, if it did (recorded history): a request still waiting then
    leaves the queue undispatched."""

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
