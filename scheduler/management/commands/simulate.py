"""``llamaswap simulate`` (``manage.py simulate``): replay a JSONL trace through the scheduler on a virtual clock.

Parses arguments and files, then loops over settings variants; the work is in
scheduler/core/simulate.py (pure).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from scheduler.core.policy import SchedulerSettings, SettingsError
from scheduler.core.simulate import (
    DEFAULT_LOAD_SECONDS,
    GENERATED_LOAD_SECONDS,
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


def settings_for(overrides: list[str], base: SchedulerSettings) -> SchedulerSettings:
    try:
        return parse_overrides(overrides, base)
    except SettingsError as exc:
        raise CommandError(f"bad setting {exc.key}: {exc.reason} (got {exc.value!r})") from None


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
            help="override a setting: use, agingDivisor, swapAffinityBonus (repeatable)",
        )
        parser.add_argument(
            "--compare",
            nargs="+",
            default=[],
            metavar="VARIANT",
            help='settings variants side by side, e.g. "defaults" "agingDivisor=0" '
            '"agingDivisor=60,swapAffinityBonus=0" (each on top of --set)',
        )
        parser.add_argument("--json", action="store_true", help="print machine-readable results")
        parser.add_argument("--generate", metavar="OUT.jsonl", help="write a synthetic trace")
        parser.add_argument(
            "--requests", type=int, default=1000, help="--generate: requests (default 1000)"
        )
        parser.add_argument(
            "--seed", type=int, default=0, help="--generate: random seed (default 0)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["generate"]:
            self.generate(Path(options["generate"]), options["requests"], options["seed"])
            return
        if not options["trace"]:
            raise CommandError("give a trace to replay, or --generate OUT.jsonl")
        default_load = options["default_load_seconds"]
        if not math.isfinite(default_load) or default_load < 0:
            raise CommandError("--default-load-seconds must be a number >= 0")
        loads = dict(parse_load(text) for text in options["load_seconds"])
        base = settings_for(options["set"], SchedulerSettings())
        variants = [settings_for([v], base) for v in options["compare"]] or [base]
        labels = options["compare"] or [None]
        trace = self.read_trace(Path(options["trace"]))
        results = [
            simulate(trace, settings, loads, default_load, label=label)
            for settings, label in zip(variants, labels, strict=True)
        ]
        if options["json"]:
            self.stdout.write(json.dumps([r.as_dict() for r in results], indent=2))
            return
        models = sorted({r.model for r in trace})
        load_text = " ".join(f"{m}={format_duration(loads.get(m, default_load))}" for m in models)
        self.stdout.write(f"{options['trace']}: {len(trace)} requests; cold load {load_text}")
        if options["compare"] and options["set"]:
            self.stdout.write(f"every variant on top of: {describe_settings(base)}")
        self.stdout.write(format_table(results))

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

    def generate(self, path: Path, requests: int, seed: int) -> None:
        if requests < 0:
            raise CommandError("--requests must be >= 0")
        trace = generate_trace(requests, seed)
        try:
            with path.open("w", encoding="utf-8") as f:
                f.writelines(r.as_json() + "\n" for r in trace)
        except OSError as exc:
            raise CommandError(f"cannot write {path}: {exc.strerror}") from None
        self.stdout.write(f"wrote {len(trace)} requests to {path} (seed {seed})")
        self.stdout.write(f"replay with: {load_flags(GENERATED_LOAD_SECONDS)}")
