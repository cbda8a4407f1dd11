"""``llamaswap simulate`` (``manage.py simulate``): replay a JSONL trace through the scheduler on a virtual clock.

Parses arguments and files, then loops over settings variants; the work is in
scheduler/core/simulate.py (pure). Modes:

* ``simulate TRACE``: replay a trace file (``--compare`` variants side by side).
* ``simulate --from-history [--since T] [--until T]``: the activity log as the trace;
  the first columns are what happened and the replay of the settings in effect, with
  the replay's error against the recorded waits.
* ``simulate --targets``: the three generated traces (overload, steady, bursty), fifo
  against the defaults and a candidate (``--set``, default the recommended settings).
* ``simulate --generate OUT``: write a synthetic trace (``--shape``).
* ``simulate TRACE --nodes box-a,box-b`` (or ``--nodes 3``): the trace on a fleet of
  one-GPU nodes behind a round robin, where each request arrives, and then placed as a
  fleet node places it (scheduler/core/fleet_sim.py): waits per band, requests per node,
  requests placed.

Here in ``llamaswap_site``, the composition: ``--from-history`` reads the activity log
(``activity``) and the settings in effect (``control``), two sibling apps neither of
which may import the other.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, time
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from activity.history import history_rows
from control.settings_store import stored_settings
from scheduler.core.fleet_sim import FleetResult, simulate_fleet
from scheduler.core.policy import SchedulerSettings, SettingsError
from scheduler.core.replay import from_history, lane_orders, replay_error
from scheduler.core.settings import assignable_names
from scheduler.core.simulate import (
    DEFAULT_LOAD_SECONDS,
    GENERATED_LOAD_SECONDS,
    RECOMMENDED,
    TRACE_SHAPES,
    SimResult,
    TraceError,
    TraceRequest,
    describe_settings,
    format_duration,
    format_table,
    generate_trace,
    load_flags,
    load_trace,
    parse_overrides,
    simulate,
)
from scheduler.core.targets import check_targets, format_targets


def parse_load(text: str) -> tuple[str, float]:
    """``MODEL=SECONDS`` into a pair; CommandError when malformed."""
    model, sep, value = text.partition("=")
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not sep or not model or not math.isfinite(seconds) or seconds < 0:
        raise CommandError(f"--load-seconds {text!r}: expected MODEL=SECONDS with SECONDS >= 0")
    return model, seconds


def parse_lanes(values: list[str]) -> dict[str, str]:
    """``--lanes gpu0=a,b --lanes gpu1=c`` into model -> lane; CommandError when malformed
    or when a model is on two lanes."""
    lane_of: dict[str, str] = {}
    for text in values:
        lane, sep, members = text.partition("=")
        models = [m.strip() for m in members.split(",") if m.strip()]
        if not sep or not lane.strip() or not models:
            raise CommandError(f"--lanes {text!r}: expected LANE=MODEL[,MODEL...]")
        for model in models:
            if model in lane_of and lane_of[model] != lane.strip():
                raise CommandError(
                    f"--lanes: model {model!r} is on lanes {lane_of[model]!r} and {lane.strip()!r}"
                )
            lane_of[model] = lane.strip()
    return lane_of


def parse_slots(values: list[str]) -> dict[str, int]:
    """``--slots a=4`` into model -> N (N >= 1); CommandError when malformed."""
    slots: dict[str, int] = {}
    for text in values:
        model, sep, value = text.partition("=")
        if not sep or not model or not value.isdigit() or int(value) < 1:
            raise CommandError(f"--slots {text!r}: expected MODEL=N with N >= 1")
        slots[model] = int(value)
    return slots


MAX_NODES = 64


def parse_nodes(text: str) -> list[str]:
    """``--nodes 3`` (node-1..node-3) or ``--nodes box-a,box-b``; CommandError when
    malformed, repeated or over :data:`MAX_NODES`."""
    if text.strip().isdigit():
        count = int(text)
        names = [f"node-{k}" for k in range(1, count + 1)]
    else:
        names = [n.strip() for n in text.split(",")]
        if not all(names) or len(set(names)) != len(names):
            raise CommandError(f"--nodes {text!r}: expected N or distinct names NAME,NAME,...")
    if not 1 <= len(names) <= MAX_NODES:
        raise CommandError(f"--nodes {text!r}: a fleet of 1 to {MAX_NODES} nodes")
    return names


def parse_when(text: str | None, flag: str) -> datetime | None:
    """An ISO date or date-time (naive: the server's time zone); CommandError if not."""
    if not text:
        return None
    when = parse_datetime(text)
    if when is None:
        day = parse_date(text)
        if day is not None:
            when = datetime.combine(day, time())
    if when is None:
        raise CommandError(f"{flag} {text!r}: expected a date (2026-12-01) or date-time")
    if timezone.is_naive(when):
        when = timezone.make_aware(when)
    return when


def settings_for(overrides: list[str], base: SchedulerSettings) -> SchedulerSettings:
    try:
        return parse_overrides(overrides, base)
    except SettingsError as exc:
        raise CommandError(f"bad setting {exc}") from None


class Command(BaseCommand):
    help = (
        "Replay a JSONL trace (arrival, model, priority, service) through the scheduler's "
        "waiting queue on a virtual clock and report waits per band, swaps and reorders. "
        "With --generate OUT.jsonl, write a synthetic trace instead."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("trace", nargs="?", help="the JSONL trace to replay")
        parser.add_argument(
            "--load-seconds",
            action="append",
            default=[],
            metavar="MODEL=S",
            help="cold-load time of a model (repeatable)",
        )
        parser.add_argument(
            "--default-load-seconds",
            type=float,
            default=DEFAULT_LOAD_SECONDS,
            metavar="S",
            help=f"cold-load time of models not named by --load-seconds (default {DEFAULT_LOAD_SECONDS:g})",
        )
        parser.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="NAME=VALUE",
            help=f"override a setting (repeatable): {', '.join(assignable_names())}",
        )
        parser.add_argument(
            "--compare",
            nargs="+",
            default=[],
            metavar="VARIANT",
            help='settings variants side by side, e.g. "defaults" "agingDivisor=0" '
            '"agingDivisor=60,swapAffinityBonus=0" (each on top of --set)',
        )
        parser.add_argument(
            "--lanes",
            action="append",
            default=[],
            metavar="LANE=MODEL,...",
            help="models on a lane (one GPU, one serial queue); repeat per lane; others on "
            "the default lane (config.yaml's routing.scheduler.settings.serial.lanes)",
        )
        parser.add_argument(
            "--slots",
            action="append",
            default=[],
            metavar="MODEL=N",
            help="serve up to N requests of MODEL at once (config.yaml's slots)",
        )
        parser.add_argument(
            "--nodes",
            metavar="N|NAME,...",
            help="replay on a fleet of one-GPU nodes (requests arrive at each in turn), "
            "where they arrive and then placed as fleet mode places them",
        )
        parser.add_argument("--json", action="store_true", help="print machine-readable results")
        parser.add_argument(
            "--estimate",
            action="store_true",
            help="also measure the estimated wait of every waiting request against the wait "
            "that followed",
        )
        parser.add_argument(
            "--from-history",
            action="store_true",
            help="replay the activity log (the stored requests) instead of a trace file",
        )
        parser.add_argument(
            "--since", metavar="TIME", help="--from-history: first arrival (ISO date or time)"
        )
        parser.add_argument(
            "--config",
            metavar="FILE",
            help="--from-history: the config the server ran (its lanes, slots, groups or "
            "matrix, concurrencyLimit, maxWait, maxQueueDepth, ttl); default LLAMASWAP_CONFIG",
        )
        parser.add_argument(
            "--until", metavar="TIME", help="--from-history: arrivals before (ISO date or time)"
        )
        parser.add_argument(
            "--targets",
            action="store_true",
            help="check the overload targets on the generated traces: fifo, defaults and "
            f"--set (default: {RECOMMENDED})",
        )
        parser.add_argument("--generate", metavar="OUT.jsonl", help="write a synthetic trace")
        parser.add_argument(
            "--shape",
            choices=TRACE_SHAPES,
            default="overload",
            help="--generate: overload (a day with a flood of batch jobs; the default), "
            "steady (70%% busy), bursty",
        )
        parser.add_argument(
            "--requests", type=int, default=1000, help="--generate: requests (default 1000)"
        )
        parser.add_argument(
            "--seed", type=int, default=0, help="--generate: random seed (default 0)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["generate"]:
            self.generate(
                Path(options["generate"]), options["requests"], options["seed"], options["shape"]
            )
            return
        default_load = options["default_load_seconds"]
        if not math.isfinite(default_load) or default_load < 0:
            raise CommandError("--default-load-seconds must be a number >= 0")
        loads = dict(parse_load(text) for text in options["load_seconds"])
        if options["targets"]:
            self.targets(options)
            return
        if options["from_history"]:
            self.from_history(options, loads, default_load)
            return
        if not options["trace"]:
            raise CommandError("give a trace to replay, --from-history, or --generate OUT.jsonl")
        base = settings_for(options["set"], SchedulerSettings())
        variants = [settings_for([v], base) for v in options["compare"]] or [base]
        labels = options["compare"] or [None]
        trace = self.read_trace(Path(options["trace"]))
        lanes, slots = parse_lanes(options["lanes"]), parse_slots(options["slots"])
        if options["nodes"]:
            if lanes or slots or options["compare"] or options["estimate"]:
                raise CommandError("--nodes: one lane per node (no --lanes, --slots, --compare)")
            self.fleet(trace, base, loads, default_load, options)
            return
        results = [
            simulate(
                trace,
                settings,
                loads,
                default_load,
                label=label,
                estimate=options["estimate"],
                lanes=lanes,
                slots=slots,
            )
            for settings, label in zip(variants, labels, strict=True)
        ]
        if options["json"]:
            self.stdout.write(json.dumps([r.as_dict() for r in results], indent=2))
            return
        models = sorted({r.model for r in trace})
        load_text = " ".join(f"{m}={format_duration(loads.get(m, default_load))}" for m in models)
        self.stdout.write(f"{options['trace']}: {len(trace)} requests; cold load {load_text}")
        if lanes or slots:
            shown = ", ".join(
                f"{lane}: {'+'.join(m for m, lane_ in lanes.items() if lane_ == lane)}"
                for lane in dict.fromkeys(lanes.values())
            )
            self.stdout.write(
                f"lanes: {shown or 'one'} (other models on the default lane); "
                f"slots: {', '.join(f'{m}={n}' for m, n in slots.items()) or 'none'}"
            )
        if options["compare"] and options["set"]:
            self.stdout.write(f"every variant on top of: {describe_settings(base)}")
        self.stdout.write(format_table(results))
        self.write_estimates(results)

    def fleet(
        self,
        trace: list[TraceRequest],
        settings: SchedulerSettings,
        loads: dict[str, float],
        default_load: float,
        options: dict[str, Any],
    ) -> None:
        """The trace on ``--nodes``, where it arrives and then with placement."""
        names = parse_nodes(options["nodes"])
        runs = [
            simulate_fleet(
                trace,
                settings,
                len(names),
                placement=placed,
                load_seconds=loads,
                default_load=default_load,
                label="placement" if placed else "where it arrives",
            )
            for placed in (False, True)
        ]
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "nodes": names,
                        "runs": [
                            {
                                "placement": placed,
                                "placed": run.placed,
                                "per_node": dict(zip(names, run.per_node, strict=True)),
                                "refused": run.refused,
                                "result": run.result.as_dict(),
                            }
                            for placed, run in zip((False, True), runs, strict=True)
                        ],
                    },
                    indent=2,
                )
            )
            return
        models = sorted({r.model for r in trace})
        load_text = " ".join(f"{m}={format_duration(loads.get(m, default_load))}" for m in models)
        self.stdout.write(
            f"{options['trace']}: {len(trace)} requests on {len(names)} nodes "
            f"({', '.join(names)}; one GPU each, requests arrive at each in turn); "
            f"cold load {load_text}"
        )
        self.stdout.write(format_table([run.result for run in runs]))
        for run in runs:
            self.stdout.write(self.fleet_line(run, names))

    @staticmethod
    def fleet_line(run: FleetResult, names: list[str]) -> str:
        loads = ", ".join(f"{n} {k}" for n, k in zip(names, run.per_node, strict=True))
        return (
            f"{run.result.label}: requests run per node: {loads}; placed on another node "
            f"than they arrived at: {run.placed}"
            + (f"; refused {run.refused}" if run.refused else "")
        )

    def write_estimates(self, results: list[SimResult]) -> None:
        for result in results:
            if result.estimate_errors is None:
                continue
            self.stdout.write(f"estimated wait, {result.label}: error (actual - estimate)")
            for band, e in result.estimate_errors.items():
                self.stdout.write(
                    f"  {band.value:<12} {e.samples:>7} estimates  |error| p50 "
                    f"{format_duration(e.abs_p50)}, p90 {format_duration(e.abs_p90)}; "
                    f"{e.within_factor_2:.0%} within 2x"
                )

    def targets(self, options: dict[str, Any]) -> None:
        candidate_text = ",".join(options["set"]) or RECOMMENDED
        candidate = settings_for([candidate_text], SchedulerSettings())
        checks = [
            check_targets(
                shape,
                generate_trace(options["requests"], options["seed"], shape),
                candidate,
                GENERATED_LOAD_SECONDS,
                label=candidate_text,
            )
            for shape in TRACE_SHAPES
        ]
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    [
                        {
                            "shape": c.shape,
                            "ratios": c.ratios(),
                            "batch_first_max_seconds": c.batch_first_max,
                            "fifo": c.fifo.as_dict(),
                            "defaults": c.defaults.as_dict(),
                            "candidate": c.candidate.as_dict(),
                        }
                        for c in checks
                    ],
                    indent=2,
                )
            )
            return
        self.stdout.write(
            f"candidate: {candidate_text}; {options['requests']} requests per trace, seed "
            f"{options['seed']}; {load_flags(GENERATED_LOAD_SECONDS)}"
        )
        self.stdout.write(format_targets(checks))

    def from_history(
        self, options: dict[str, Any], loads: dict[str, float], default_load: float
    ) -> None:
        since, until = (
            parse_when(options["since"], "--since"),
            parse_when(options["until"], "--until"),
        )
        rows, origin = history_rows(since, until)
        if not rows:
            raise CommandError("no recorded requests in that window")
        current = stored_settings() or SchedulerSettings()
        current = settings_for(options["set"], current)
        history = from_history(rows, current, default_load)
        measured = {**history.loads, **loads}
        box = self.box(options["config"])
        replay = simulate(
            history.trace,
            current,
            measured,
            default_load,
            label="replay: " + describe_settings(current),
            estimate=options["estimate"],
            **box,
        )
        results = [history.recorded, replay]
        results += [
            simulate(
                history.trace,
                settings_for([v], current),
                measured,
                default_load,
                label=v,
                estimate=options["estimate"],
                **box,
            )
            for v in options["compare"]
        ]
        error = replay_error(history.recorded, replay)
        if options["json"]:
            self.stdout.write(
                json.dumps(
                    {
                        "requests": len(history.trace),
                        "skipped_never_dispatched": history.skipped,
                        "loads": measured,
                        "replay_error": error.as_dict(),
                        "refused": {
                            "recorded": history.recorded.refused(),
                            "replayed": replay.refused(),
                        },
                        "orders": {
                            "recorded": lane_orders(history.recorded),
                            "replayed": lane_orders(replay),
                        },
                        "results": [r.as_dict() for r in results],
                    },
                    indent=2,
                )
            )
            return
        load_text = " ".join(f"{m}={format_duration(s)}" for m, s in sorted(measured.items()))
        self.stdout.write(
            f"history from {origin:%Y-%m-%d %H:%M:%S %Z}: {len(history.trace)} dispatched requests "
            f"({history.skipped} never dispatched, left out); measured cold load {load_text}"
        )
        self.stdout.write(format_table(results))
        self.stdout.write(
            f"replay error of the settings in effect ({describe_settings(current)}), per request "
            f"|replayed wait - recorded wait|: p50 {format_duration(error.abs_p50)}, "
            f"p90 {format_duration(error.abs_p90)}, max {format_duration(error.abs_max)}; "
            f"{error.same_order:.0%} of picks in the same order"
        )
        self.write_estimates(results)

    def box(self, path: str | None) -> dict[str, Any]:
        """``simulate``'s ``lanes`` and ``rules`` from the config the server ran (none:
        one lane, the simulator's defaults)."""
        from django.conf import settings

        from scheduler.config import ConfigError, load_config
        from scheduler.rules import rules_of

        path = path or getattr(settings, "LLAMASWAP_CONFIG", "")
        if not path:
            return {}
        try:
            config = load_config(path)
        except (ConfigError, OSError) as exc:
            raise CommandError(f"--config {path}: {exc}") from None
        return {"lanes": dict(config.lane_of), "rules": rules_of(config)}

    def read_trace(self, path: Path) -> list[TraceRequest]:
        try:
            with path.open(encoding="utf-8") as f:
                return load_trace(f)
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise CommandError(f"{path}: not UTF-8 text") from None
        except TraceError as exc:
            raise CommandError(f"{path}: {exc}") from None

    def generate(self, path: Path, requests: int, seed: int, shape: str = "overload") -> None:
        if requests < 0:
            raise CommandError("--requests must be >= 0")
        trace = generate_trace(requests, seed, shape)
        try:
            with path.open("w", encoding="utf-8") as f:
                f.writelines(r.as_json() + "\n" for r in trace)
        except OSError as exc:
            raise CommandError(f"cannot write {path}: {exc.strerror}") from None
        self.stdout.write(f"wrote {len(trace)} requests to {path} ({shape}, seed {seed})")
        self.stdout.write(f"replay with: {load_flags(GENERATED_LOAD_SECONDS)}")
