"""The dispatcher's observers for a running server (metrics, records, dashboard)."""

from __future__ import annotations

from scheduler.config import Config


def build_observers(config: Config) -> list:
    return []
