"""``llamaswap check CONFIG`` (``manage.py check_config CONFIG``): is this config.yaml usable?

Loads the file as ``serve`` would (scheduler.config.load_config) and prints one line per
problem on stderr, each with its key path::

    config.yaml: error: models.qwen.ttl: must be >= 0 (or -1 for globalTTL), got -5
    config.yaml: warning: peers: ...; ignored

Exit status 1 when the config cannot be used, 0 otherwise: warnings do not fail. Without
CONFIG it checks the file named by LLAMASWAP_CONFIG. The last line, on stdout, sums up a
usable config (models, scheduler, warnings).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks
from django.core.management.base import BaseCommand, CommandError, CommandParser

from scheduler.checks import inspect_config


class Command(BaseCommand):
    help = (
        "Check a llama-swap config.yaml: print each error and warning with its key path; "
        "exit 1 when the config cannot be used (warnings do not fail)."
    )
    # The system checks would load LLAMASWAP_CONFIG, which need not be this file.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "config", nargs="?", default="", help="the config.yaml (default: LLAMASWAP_CONFIG)"
        )
        parser.add_argument(
            "--config-dir", default="", help="fragments merged into it, as `serve --config-dir`"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        config_dir = options["config_dir"]
        path = options["config"] or (
            "" if config_dir else getattr(settings, "LLAMASWAP_CONFIG", "")
        )
        if not path and not config_dir:
            raise CommandError("no config: give the file (llamaswap check config.yaml)")
        config, messages = inspect_config(path, config_dir=config_dir)
        path = path or config_dir
        for message in messages:
            error = message.level >= checks.ERROR
            kind = "error" if error else "warning"
            self.stderr.write(f"{path}: {kind}: {message.msg}")
            if error:
                self.stderr.write(f"  hint: {message.hint}")
        if config is None:
            raise SystemExit(1)
        warned = f", {len(messages)} warning(s)" if messages else ""
        self.stdout.write(
            self.style.SUCCESS(
                f"{path}: ok: {len(config.models)} model(s), "
                f"scheduler {config.scheduler.use.value}{warned}"
            )
        )
