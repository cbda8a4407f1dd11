"""``llamaswap prune-activity`` (``manage.py prune_activity``): apply the activity log's retention now.

The server prunes in the background (hourly); this does the same on demand, for
instance from cron when the server is stopped, or with other limits.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from activity.rows import prune


class Command(BaseCommand):
    help = "Delete activity-log rows older than the retention days or beyond the retention rows."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--days",
            type=int,
            default=None,
            help="keep this many days (default ACTIVITY_RETENTION_DAYS; 0 keeps all)",
        )
        parser.add_argument(
            "--rows",
            type=int,
            default=None,
            help="keep this many newest rows (default ACTIVITY_RETENTION_ROWS; 0 keeps all)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        days = options["days"] if options["days"] is not None else settings.ACTIVITY_RETENTION_DAYS
        rows = options["rows"] if options["rows"] is not None else settings.ACTIVITY_RETENTION_ROWS
        deleted = prune(days, rows)
        self.stdout.write(f"pruned {deleted} activity rows (keeping {days} days, {rows} rows)")
