"""The overload targets: fifo, the spec's defaults and a candidate on the generated
traces (``llamaswap simulate --targets``, ``python -m bench overload``), with the ratios
the targets bound and what no order could beat.

Pure: no Django, I/O or clock reads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.core.policy import SchedulerSettings
from scheduler.core.priority import Band
from scheduler.core.simulate import SimResult, format_duration, simulate
from scheduler.core.traces import TraceRequest


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
        free = [
            r.swaps - r.forced_swaps - r.band_swaps
            for r in (check.fifo, check.defaults, check.candidate)
        ]
        out.append(
            f"| {check.shape} | swaps left to the policy's choice | {free[0]} | {free[1]} | "
            f"{free[2]} | {_ratio(free[2], check.fifo.swaps):.2f}x | | |"
        )
    return "\n".join(out)
