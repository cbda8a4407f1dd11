"""The dispatcher's observers for a running server (metrics, records, dashboard)."""

from __future__ import annotations

from scheduler.config import Config


def build_observers(config: Config) -> list:
    from dashboard.live import LiveObserver  # the dashboard's live updates (issue 5)

    observers: list = []
    observers.append(LiveObserver())
    observers.extend(_activity_observers(config))
    return observers


def _activity_observers(config: Config) -> list:
    """/metrics counters and the activity log (issue 4). The recorder only needs the
    database once its task runs; without tables it logs and drops, never blocks."""
    from django.conf import settings

    from scheduler.metrics import MetricsObserver

    observers: list = [MetricsObserver(config)]
    if getattr(settings, "ACTIVITY_RECORDING", True):
        from scheduler.recorder import Recorder

        observers.append(
            Recorder(
                config.scheduler,
                capacity=settings.ACTIVITY_BUFFER_ROWS,
                retention_days=settings.ACTIVITY_RETENTION_DAYS,
                retention_rows=settings.ACTIVITY_RETENTION_ROWS,
            )
        )
    return observers
