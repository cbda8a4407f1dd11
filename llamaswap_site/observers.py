"""The dispatcher's observers for a running server: the wiring of the layers above the
scheduler (the activity log and metrics, the dashboard's live updates) into it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.config import Config

if TYPE_CHECKING:
    from activity.journal import Journal
    from scheduler.dispatcher import Observer


def build_observers(config: Config) -> list[Observer]:
    from dashboard.live import LiveObserver  # pushes snapshots to the dashboard's websockets
    from dashboard.model_watch import ModelWatch  # the models page's load times, failures

    observers: list[Observer] = []
    observers.append(LiveObserver())
    from proxy.events import hub  # llama-swap's /api/events stream

    observers.append(hub())
    observers.append(ModelWatch())
    observers.extend(_activity_observers(config))
    return observers


def _activity_observers(config: Config) -> list[Observer]:
    """/metrics counters and the activity log. The recorder only needs the
    database once its task runs; without tables it logs and drops, never blocks."""
    from django.conf import settings

    from activity.metrics import MetricsObserver

    observers: list[Observer] = [MetricsObserver(config)]
    if getattr(settings, "ACTIVITY_RECORDING", True):
        from activity.journal import replay_dead
        from activity.recorder import Recorder

        observers.append(
            Recorder(
                config.scheduler,
                capacity=settings.ACTIVITY_BUFFER_ROWS,
                retention_days=settings.ACTIVITY_RETENTION_DAYS,
                retention_rows=settings.ACTIVITY_RETENTION_ROWS,
                journal=_journal(),
                replay=replay_dead,
            )
        )
    return observers


def _journal() -> Journal | None:
    """This server's activity journal (records survive a killed server); without one
    (an unwritable state directory) records are saved as before, and a warning says so."""
    import logging

    from activity.journal import for_server

    try:
        return for_server()
    except OSError as exc:
        logging.getLogger("llamaswap.recorder").warning(
            "activity log: no journal (%s): the records of the last half second are lost "
            "if the server is killed",
            exc,
            extra={"action": "journal_failed", "cause": str(exc)},
        )
        return None


def replay_activity_journals() -> None:
    """Before serving: save what dead servers' activity journals hold (activity/journal.py).
    A database that fails keeps them; the recorder tries again once it answers."""
    from django.conf import settings

    if getattr(settings, "ACTIVITY_RECORDING", True):
        from activity.journal import replay_dead

        replay_dead()
