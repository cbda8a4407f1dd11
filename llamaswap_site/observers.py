"""The dispatcher's observers for a running server: the wiring of the layers above the
scheduler (the activity log and metrics, the dashboard's live updates) into it."""

from __future__ import annotations

from scheduler.config import Config


def build_observers(config: Config) -> list:
    from dashboard.live import LiveObserver  # pushes snapshots to the dashboard's websockets

    observers: list = []
    observers.append(LiveObserver())
    observers.extend(_activity_observers(config))
    return observers


def _activity_observers(config: Config) -> list:
    """/metrics counters and the activity log. The recorder only needs the
    database once its task runs; without tables it logs and drops, never blocks."""
    from django.conf import settings

    from activity.metrics import MetricsObserver

    observers: list = [MetricsObserver(config)]
    if getattr(settings, "ACTIVITY_RECORDING", True):
        from activity.recorder import Recorder

        observers.append(
            Recorder(
                config.scheduler,
                capacity=settings.ACTIVITY_BUFFER_ROWS,
                retention_days=settings.ACTIVITY_RETENTION_DAYS,
                retention_rows=settings.ACTIVITY_RETENTION_ROWS,
            )
        )
    return observers
