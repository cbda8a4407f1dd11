"""What the models page shows beyond the dispatcher's state: when each model last became
ready, how long its last load took, and why its last start failed. A dispatcher observer
(cheap: a dict write per event, never blocks), bounded by the configured models."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from scheduler.lifecycle import ModelState
from scheduler.tickets import Outcome, Ticket

MAX_MODELS = 4096
"""Models remembered at most (ids come from the config; a reload may add new ones)."""


@dataclass
class ModelFacts:
    ready_at: float | None = None
    """Wall-clock time it last became ready."""
    load_seconds: float | None = None
    """How long its last load took (ready or failed)."""
    failed_at: float | None = None
    failure: str = ""
    """The cause of its last failed start ("" none since the server started)."""


class ModelWatch:
    """Dispatcher observer: :class:`ModelFacts` by model id."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self.facts: dict[str, ModelFacts] = {}

    def _of(self, model: str) -> ModelFacts:
        facts = self.facts.get(model)
        if facts is None:
            if len(self.facts) >= MAX_MODELS:
                self.facts.pop(next(iter(self.facts)))
            facts = self.facts[model] = ModelFacts()
        return facts

    def on_enqueue(self, ticket: Ticket) -> None:
        pass

    def on_dispatch(self, ticket: Ticket) -> None:
        pass

    def loaded(self, model: str, seconds: float) -> None:
        self._of(model).load_seconds = seconds

    def failed(self, model: str, cause: str) -> None:
        facts = self._of(model)
        facts.failed_at, facts.failure = self._wall(), cause

    def on_finish(self, ticket: Ticket) -> None:
        # Requests only: a Load (a preload) tells :meth:`loaded` / :meth:`failed` itself.
        if ticket.load_seconds is not None:
            self.loaded(ticket.model.id, ticket.load_seconds)
        # A start failure: failed before the model ever answered it (the dispatcher's
        # _fail_start), with the start's cause as its error.
        if ticket.outcome is Outcome.FAILED and ticket.ready_at is None and ticket.error:
            self.failed(ticket.model.id, ticket.error)

    def on_model_state(self, model: str, state: ModelState) -> None:
        if state is ModelState.READY:
            self._of(model).ready_at = self._wall()

    def on_settings(self, *args: object) -> None:
        pass


def watch_of(observers: Iterable[object]) -> ModelWatch | None:
    return next((o for o in observers if isinstance(o, ModelWatch)), None)
