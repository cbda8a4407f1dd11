"""The what-if page: replay a window of the recorded history under the settings in
effect and up to three candidates, side by side with what happened; and the advisor.

The replay runs in one worker thread (never on the event loop, never two at once, at a
lower OS priority than the server's other threads), and its result is cached per window,
candidates, settings and the rows in the window (their count and last id), so a page
reload is free and a new request recorded in the window computes afresh. While it runs
the page says so and reloads itself. 100,000 records take a few seconds per column
(BENCHMARKS.md).

The work is bounded (docs/dashboard.md, "Bounds"): at most :data:`MAX_PENDING` replays
queued or running in all, at most :data:`MAX_PENDING_PER_CLIENT` of them started by one
client (its login, else its address); identical requests share one computation; a request
over a bound is answered at once with a 429 page and ``Retry-After``. The cache keeps
:data:`CACHE_SIZE` pages and at most :data:`CACHE_DISPATCHES` replayed jobs in all.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time as clock
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any

from django.db.models import Count, Max
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from activity.history import history_rows
from activity.models import RequestRecord
from control.settings_store import stored_settings
from dashboard.access import read_only_page
from dashboard.filters import BadFilter, parse_when, parse_zone
from scheduler.core.advisor import (
    Advice,
    CrossBand,
    advise,
    aging_decides,
    cross_band,
    suggestion,
    too_small,
)
from scheduler.core.policy import SchedulerSettings, SettingsError
from scheduler.core.priority import BANDS, Band
from scheduler.core.replay import ReplayError, from_history, replay_error
from scheduler.core.settings import assignable_names
from scheduler.core.simulate import (
    SimResult,
    describe_settings,
    format_duration,
    parse_overrides,
    simulate,
    table_rows,
)
from scheduler.runtime import Runtime
from web.errors import echo
from web.runtime import maybe_runtime_of

log = logging.getLogger("llamaswap.whatif")

MAX_CANDIDATES = 3
DEFAULT_WINDOW = timedelta(days=1)
CACHE_SIZE = 16
CACHE_DISPATCHES = 500_000
"""Replayed jobs (columns x requests) the cache keeps in all: ~100 MB."""
FAILED_SIZE = 16
MAX_PENDING = 4
"""Replays queued or running at once, from everyone."""
MAX_PENDING_PER_CLIENT = 2
"""Replays queued or running at once that one client started."""
WORKER_NICE = 10
"""How much lower the worker thread's OS priority is (Linux: per thread)."""
REPLAY_SWITCH_INTERVAL = 0.0005
"""The interpreter's thread switch interval while a replay runs (seconds)."""
REFRESH_SECONDS = 2
RETRY_MAX_SECONDS = 60
EXAMPLES = ("agingCap=100,swapAffinityBonus=30,bandShare.batch=0.2", "agingDivisor=600", "use=fifo")


@dataclass(frozen=True)
class WhatIf:
    """One computed page."""

    results: list[SimResult]
    """What happened, the replay of the settings in effect, then each candidate."""
    error: ReplayError
    """The replay of the settings in effect against what happened."""
    advice: Advice | None
    crossing: CrossBand
    requests: int
    skipped: int
    loads: dict[str, float]
    origin: datetime | None
    seconds: float
    """How long the computation took."""


def current_settings(rt: Runtime | None) -> SchedulerSettings:
    """The settings of the server ``rt``'s dispatcher, else (None: none runs in this
    process) the stored ones."""
    if rt is not None:
        return rt.dispatcher.settings
    return stored_settings() or SchedulerSettings()


def running_box(rt: Runtime | None) -> dict[str, Any]:
    """The server ``rt``'s lanes and admission rules (groups or matrix, slots, limits,
    bounds, ttl), so the replay runs the box as the dispatcher does; none outside one."""
    from scheduler.rules import rules_of

    if rt is None:
        return {}
    config = rt.dispatcher.config
    return {"lanes": dict(config.lane_of), "rules": rules_of(config)}


def compute(
    since: datetime | None,
    until: datetime | None,
    candidates: Sequence[tuple[str, SchedulerSettings]],
    current: SchedulerSettings,
    box: dict[str, Any] | None = None,
) -> WhatIf:
    """Read the window and replay it (seconds for 100,000 rows: call it off the loop) on
    ``box`` (:func:`running_box`; None: one lane, no rules)."""
    started = clock.perf_counter()
    rows, origin = history_rows(since, until)
    history = from_history(rows, current)
    loads = history.loads

    box = box or {}

    def run(settings: SchedulerSettings, label: str) -> SimResult:
        return simulate(history.trace, settings, loads, label=label, **box)

    replay = run(current, "replay: " + describe_settings(current))
    results = [history.recorded, replay]
    results += [run(settings, label) for label, settings in candidates]
    suggested = suggestion(current)
    crossing = cross_band(history.recorded)
    advice = None
    if suggested != current and aging_decides(crossing):
        same = next((r for r in results[2:] if r.settings == suggested), None)
        advice = advise(history.recorded, current, replay, same or run(suggested, "suggested"))
    return WhatIf(
        results=results,
        error=replay_error(history.recorded, replay),
        advice=advice,
        crossing=crossing,
        requests=len(history.trace),
        skipped=history.skipped,
        loads=loads,
        origin=origin,
        seconds=clock.perf_counter() - started,
    )


# -- the worker and the cache ------------------------------------------------------------


@dataclass(frozen=True)
class Busy:
    """A replay refused because a bound is reached: say why, and when to come back."""

    reason: str
    retry_after: int


_lock = threading.Lock()
_cache: OrderedDict[tuple[Any, ...], WhatIf] = OrderedDict()
_running: dict[tuple[Any, ...], Future[WhatIf] | None] = {}
"""Replays queued or running (None: being handed to the worker)."""
_owners: dict[tuple[Any, ...], str] = {}
"""Who started each replay in ``_running``."""
_failed: OrderedDict[tuple[Any, ...], str] = OrderedDict()
_executor: ThreadPoolExecutor | None = None
_last_seconds = 0.0
"""How long the last replay took (for ``Retry-After``)."""


def _submit(fn: Callable[[], WhatIf]) -> Future[WhatIf]:
    """Run ``fn`` on the one worker thread (tests replace this to run it inline)."""
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="whatif")
    return _executor.submit(_in_worker, fn)


def _in_worker(fn: Callable[[], WhatIf]) -> WhatIf:
    """The worker thread's database connection is its own: closed after each job (as a
    request's is), never the caller's."""
    from django.db import close_old_connections

    _lower_priority()
    # The replay is pure Python and holds the GIL: the event loop thread waits up to the
    # switch interval (5 ms) each time it wakes. A shorter interval while a replay runs
    # bounds that wait (chat p50 through the server: see docs/dashboard.md, "Bounds").
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, REPLAY_SWITCH_INTERVAL))
    try:
        return fn()
    finally:
        sys.setswitchinterval(switch)
        close_old_connections()


def _lower_priority() -> None:
    """Run this thread at nice +:data:`WORKER_NICE` (Linux sets niceness per thread), so
    that model servers and the other processes on a busy box come first. Once per thread;
    where it is not possible, the replay runs at the server's priority."""
    if getattr(_worker_state, "niced", False):
        return
    _worker_state.niced = True
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE)
    except (AttributeError, OSError) as error:
        log.info("what-if worker keeps the server's priority: %s", error)


_worker_state = threading.local()


def _weight(result: WhatIf) -> int:
    return max(1, result.requests) * len(result.results)


def _done(key: tuple[Any, ...], future: Future[WhatIf]) -> None:
    global _last_seconds
    with _lock:
        _running.pop(key, None)
        _owners.pop(key, None)
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            log.warning("what-if replay failed", exc_info=error)
            _failed[key] = str(error) or type(error).__name__
            while len(_failed) > FAILED_SIZE:
                _failed.popitem(last=False)
            return
        result = future.result()
        _last_seconds = result.seconds
        _cache[key] = result
        _cache.move_to_end(key)
        # The newest page stays, whatever its size: it is the one being looked at.
        weight = sum(_weight(r) for r in _cache.values())
        while len(_cache) > 1 and (len(_cache) > CACHE_SIZE or weight > CACHE_DISPATCHES):
            weight -= _weight(_cache.popitem(last=False)[1])
    log.info(
        "what-if replay done",
        extra={
            "action": "whatif",
            "requests": result.requests,
            "seconds": round(result.seconds, 3),
        },
    )


def _retry_after(pending: int) -> int:
    """Seconds until a slot is likely free: the last replay's time for each pending one."""
    return max(REFRESH_SECONDS, min(RETRY_MAX_SECONDS, math.ceil(_last_seconds * pending)))


def lookup_or_start(
    key: tuple[Any, ...], fn: Callable[[], WhatIf], client: str = ""
) -> WhatIf | str | Busy | None:
    """The cached result; or an error message; or None after starting (or while
    running: identical requests share it) the computation; or :class:`Busy` when
    ``client`` (or everyone) has as many replays pending as allowed."""
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
        if key in _failed:
            return _failed.pop(key)
        if key in _running:
            return None
        if len(_running) >= MAX_PENDING:
            return Busy(
                f"{len(_running)} replays are waiting for the what-if worker "
                f"(at most {MAX_PENDING} at once)",
                _retry_after(len(_running)),
            )
        mine = sum(1 for owner in _owners.values() if owner == client)
        if mine >= MAX_PENDING_PER_CLIENT:
            return Busy(
                f"{mine} replays you asked for are still running "
                f"(at most {MAX_PENDING_PER_CLIENT} per client)",
                _retry_after(len(_running)),
            )
        _running[key] = None  # the slot is taken before the worker is asked
        _owners[key] = client

    try:
        future = _submit(fn)
    except BaseException:
        with _lock:
            _running.pop(key, None)
            _owners.pop(key, None)
        raise
    with _lock:
        if key in _running:
            _running[key] = future
    future.add_done_callback(lambda f: _done(key, f))
    with _lock:
        return _cache.get(key)


def latest_advice() -> Advice | None:
    """The advice of the what-if page computed or viewed last (from the cache: no
    database, no replay), for a banner on the live dashboard; None when there is none."""
    with _lock:
        latest = next(reversed(_cache.values()), None)
    return latest.advice if latest is not None else None


def clear() -> None:
    with _lock:
        _cache.clear()
        _failed.clear()


def client_of(request: HttpRequest) -> str:
    """Whose replay this is, for :data:`MAX_PENDING_PER_CLIENT`: the login, else the
    address (behind a reverse proxy every anonymous user shares the proxy's)."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated:
        return f"user:{user.pk}"
    return f"address:{request.META.get('REMOTE_ADDR', '')}"


# -- charts --------------------------------------------------------------------------------

CHART_W, CHART_H = 520, 220
"""The plot area; the SVG adds margins for the axes' labels (the template's viewBox)."""
QUANTILES = (0, 10, 25, 50, 75, 90, 95, 99, 100)
X_TICKS = (0, 25, 50, 75, 90, 100)
"""Percentiles labelled on the x axis (95 and 99 would overlap 100)."""
COLORS = ("#444", "#1f77b4", "#d62728", "#2ca02c", "#9467bd")


def _y(seconds: float, top: float) -> float:
    """Log scale from 1 s (bottom) to ``top`` seconds (top of the chart)."""
    span = math.log10(max(top, 10.0))
    value = math.log10(max(seconds, 1.0))
    return round(CHART_H - CHART_H * value / span, 1)


def charts(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """Per band: one polyline per column, the wait at each percentile (log scale)."""
    out = []
    for band in BANDS:
        series = []
        top = 10.0
        for result in results:
            waits = sorted(d.wait for d in result.dispatches if d.band is band)
            if waits:
                top = max(top, waits[-1])
            series.append(waits)
        lines = []
        drawn: dict[str, str] = {}  # points -> the label of the line drawn with them
        for k, (result, waits) in enumerate(zip(results, series, strict=True)):
            if not waits:
                continue
            points = []
            for q in QUANTILES:
                value = waits[min(len(waits) - 1, max(0, math.ceil(q / 100 * len(waits)) - 1))]
                points.append(f"{round(q / 100 * CHART_W, 1)},{_y(value, top)}")
            joined = " ".join(points)
            same_as = drawn.setdefault(joined, result.label)
            lines.append(
                {
                    "label": result.label
                    + ("" if same_as == result.label else f" (same as {same_as})"),
                    "color": COLORS[k % len(COLORS)],
                    "points": joined,
                    "dashed": k == 0,
                    # A line on top of an earlier one is drawn dotted, so both show.
                    "dotted": same_as != result.label,
                }
            )
        ticks = [
            {"y": _y(s, top), "label": format_duration(s)}
            for s in (1, 10, 60, 600, 3600, 86400)
            if s <= top
        ]
        x_ticks = [{"x": round(q / 100 * CHART_W, 1), "label": f"p{q}"} for q in X_TICKS]
        out.append(
            {
                "band": band.value,
                "lines": lines,
                "ticks": ticks,
                "x_ticks": x_ticks,
                "top": format_duration(top),
            }
        )
    return out


def verdicts(results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """Each candidate against the replay of the settings in effect (the same model of the
    box, so the difference is the settings'), per band at p95: lower wait is better."""
    if len(results) < 3:
        return []
    base = results[1]
    out = []
    for result in results[2:]:
        cells = []
        for band in BANDS:
            was, now = base.bands.get(band), result.bands.get(band)
            if not was or not now or not was.requests or not now.requests:
                cells.append({"band": band.value, "text": "–", "kind": "none"})
                continue
            a, b = was.wait_p95, now.wait_p95
            if abs(a - b) <= max(1.0, 0.05 * max(a, b)):
                kind, arrow, word = "same", "=", "about the same"
            elif b < a:
                kind, arrow, word = "better", "▼", "better"
            else:
                kind, arrow, word = "worse", "▲", "worse"
            text = f"{arrow} {format_duration(a)} → {format_duration(b)} ({word})"
            cells.append({"band": band.value, "text": text, "kind": kind})
        out.append({"label": result.label, "cells": cells})
    return out


# -- the page ------------------------------------------------------------------------------


def _stamp(since: datetime | None, until: datetime | None) -> tuple[int, int]:
    rows = RequestRecord.objects.all()
    if since is not None:
        rows = rows.filter(arrived_at__gte=since)
    if until is not None:
        rows = rows.filter(arrived_at__lt=until)
    agg = rows.aggregate(n=Count("id"), last=Max("id"))
    return int(agg["n"] or 0), int(agg["last"] or 0)


@read_only_page
def whatif(request: HttpRequest) -> HttpResponse:
    params = request.GET
    problems: list[str] = []
    zone: tzinfo = UTC
    try:
        zone = parse_zone(params.get("tz", "").strip())
    except BadFilter as exc:
        problems.append(str(exc))
    given = {name: params.get(name, "").strip() for name in ("since", "until")}
    form = {
        **given,
        "candidates": [params.get(f"c{k}", "").strip() for k in range(1, MAX_CANDIDATES + 1)],
    }
    bounds: dict[str, datetime | None] = {"since": None, "until": None}
    for name in ("since", "until"):
        try:
            bounds[name] = parse_when(name, given[name], end=name == "until", zone=zone)
        except BadFilter as exc:
            problems.append(str(exc))
    if not form["since"] and not form["until"] and not problems:
        # The last day of the history (from its newest row: the same key while it runs).
        latest = RequestRecord.objects.aggregate(last=Max("arrived_at"))["last"]
        bounds["since"] = (latest or timezone.now()) - DEFAULT_WINDOW
    rt = maybe_runtime_of(request)
    current = current_settings(rt)
    box = running_box(rt)  # on the request's thread: compute runs on another
    candidates: list[tuple[str, SchedulerSettings]] = []
    merged: list[str] = []  # identical candidates are replayed and drawn once
    for number, text in enumerate(form["candidates"], start=1):
        if not text:
            continue
        try:
            settings = parse_overrides([text], current)
        except SettingsError as exc:
            problems.append(f"{echo(text)}: {exc.key}: {exc.reason} (got {echo(repr(exc.value))})")
            continue
        twin = next((label for label, other in candidates if other == settings), None)
        if settings == current:
            merged.append(f"candidate {number} ({text}) is the settings in effect: see the replay")
        elif twin is not None:
            merged.append(f"candidate {number} ({text}) is the same as {twin}: shown once")
        else:
            candidates.append((text, settings))
    context: dict[str, Any] = {
        "nav": "whatif",
        "form": form,
        "tz": params.get("tz", ""),
        "problems": problems,
        "current": describe_settings(current),
        "names": assignable_names(),  # every setting of the table
        "examples": EXAMPLES,
        "default_window": not form["since"] and not form["until"],
        "merged": merged,
    }
    if problems:
        return render(request, "dashboard/whatif.html", context, status=400)
    since, until = bounds["since"], bounds["until"]
    stamp = _stamp(since, until)
    if stamp[0] == 0:
        context["empty"] = True
        return render(request, "dashboard/whatif.html", context)
    key = (since, until, tuple(text for text, _ in candidates), repr(current.as_dict()), stamp)
    outcome = lookup_or_start(
        key, lambda: compute(since, until, candidates, current, box), client_of(request)
    )
    if outcome is None:
        context.update(computing=True, refresh=REFRESH_SECONDS, records=stamp[0])
        return render(request, "dashboard/whatif.html", context)
    if isinstance(outcome, Busy):
        context.update(busy=outcome.reason, refresh=outcome.retry_after)
        response = render(request, "dashboard/whatif.html", context, status=429)
        response["Retry-After"] = str(outcome.retry_after)
        return response
    if isinstance(outcome, str):
        context["failed"] = outcome
        return render(request, "dashboard/whatif.html", context, status=500)
    header, body = table_rows(outcome.results)
    context.update(
        result=outcome,
        header=header,
        body=body,
        charts=charts(outcome.results),
        colors=COLORS,
        legend=[(r.label, COLORS[k % len(COLORS)]) for k, r in enumerate(outcome.results)],
        loads=", ".join(f"{m} {format_duration(s)}" for m, s in sorted(outcome.loads.items())),
        error_p50=format_duration(outcome.error.abs_p50),
        error_p90=format_duration(outcome.error.abs_p90),
        same_order=f"{outcome.error.same_order:.0%}",
        verdicts=verdicts(outcome.results),
        bands=[b.value for b in BANDS],
        too_small=too_small(outcome.results[0]),
        interactive=Band.INTERACTIVE.value,
    )
    return render(request, "dashboard/whatif.html", context)
