"""When the cyclic garbage collector runs in the serving process: while a model works.

The interpreter collects wherever an allocation crosses its threshold, with the event loop
stopped. With 1,000 requests waiting that used to land between two jobs, the GPU idle
meanwhile (BENCHMARKS.md, "Dispatch gap at the model"):

* a young collection took 0.1-0.3 ms, every tenth one (the middle generation) about 2 ms;
* a full collection walked every object of every waiting request (about 150 each: their
  coroutines, daphne's and Django's request objects; 150,000 at 1,000 waiting) for
  30-80 ms, every ~350 jobs, because the interpreter's rule (collect the oldest generation
  once it grew by a quarter) fires as waiting requests are replaced, while it found next
  to nothing: 11-92 objects per full collection in the measured run.

:class:`Collector` moves both to better moments. Young collections run just after a request
went to its model (:meth:`Collector.model_started`), when enough young objects are
pending, so they overlap the model's work. The middle generation takes every third
collection (two young ones, then the middle one: :data:`MIDDLE_AT`) instead of every
twelfth (the interpreter's threshold of 10), so each of its collections is small enough
to overlap a short job: with 5 ms jobs and 1,000 waiting, every twelfth took 3-4 ms of CPU
(4-10 ms on a loaded machine), outlasted the job and was 21-49% of the time of the slowest
1% of gaps; every third takes ~1 ms and is ~1% of it, for less collector time in all
(each object still passes one middle collection before it is promoted; 0.36 against
0.43 s of young and middle collections per run; BENCHMARKS.md). Full collections are no
longer the interpreter's to start (:meth:`Collector.install` sets its oldest threshold out
of reach): one runs after a request went to its model once ``full_every`` seconds passed
since the last, and a timer (:meth:`Collector.pace`) runs one when none ran for twice that
(an idle server, or one serving only the dashboard). What cyclic garbage reaches the oldest
generation waits at most that long; the interpreter's own rule would have let it wait
until the oldest generation grew by a quarter, which an idle server may never do.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("llamaswap.gc")

YOUNG_AT = 350
"""Young objects pending (half the interpreter's default threshold of 700) from which a
collection is run while a model works rather than wherever the threshold happens to
be crossed."""

MIDDLE_AT = 1
"""The middle generation's threshold once :meth:`Collector.install` ran: it is collected
once more than this many young collections ran since its last (every third collection;
the interpreter's default of 10: every twelfth), so each is short enough to overlap a job."""

FULL_EVERY_S = 60.0
"""Seconds between full collections under load (one runs while a model works)."""

NEVER = 1 << 30
"""The oldest generation's threshold once :meth:`Collector.install` ran: out of reach."""


class GC(Protocol):
    """The part of the :mod:`gc` module the collector uses (tests pass a fake)."""

    def isenabled(self) -> bool: ...
    def get_count(self) -> tuple[int, int, int]: ...
    def get_threshold(self) -> tuple[int, int, int]: ...
    def set_threshold(
        self, threshold0: int, threshold1: int = ..., threshold2: int = ..., /
    ) -> None: ...
    def collect(self, generation: int = ...) -> int: ...


class Collector:
    """Paces the cyclic garbage collector; one per serving process (:data:`collector`)."""

    def __init__(
        self,
        gc_module: Any = gc,
        clock: Callable[[], float] = time.monotonic,
        full_every: float = FULL_EVERY_S,
    ) -> None:
        self._gc: GC = gc_module
        self._clock = clock
        self.full_every = full_every
        self.installed = False
        self.last_full = clock()
        self.full_collections = 0

    def install(self) -> None:
        """Take full collections over from the interpreter and collect the middle
        generation more often (``manage.py serve`` does)."""
        young, _, _ = self._gc.get_threshold()
        self._gc.set_threshold(young, MIDDLE_AT, NEVER)
        self.installed = True
        self.last_full = self._clock()

    def uninstall(self) -> None:
        young, _, _ = self._gc.get_threshold()
        self._gc.set_threshold(young, 10, 10)  # the interpreter's defaults
        self.installed = False

    def model_started(self) -> None:
        """A request was just sent to its model: collect now if a collection is due.

        A full one once ``full_every`` seconds passed since the last. Otherwise the young
        generation once ``YOUNG_AT`` objects are pending, or the middle one where the
        interpreter would take it instead (by its count: every third time once
        :meth:`install` set :data:`MIDDLE_AT`)."""
        if not self._gc.isenabled():
            return
        if self.installed and self._clock() - self.last_full >= self.full_every:
            self.collect_full()
            return
        young, middle, _ = self._gc.get_count()
        if young < YOUNG_AT:
            return
        self._gc.collect(1 if middle > self._gc.get_threshold()[1] else 0)

    def collect_full(self) -> int:
        found = self._gc.collect(2)
        self.last_full = self._clock()
        self.full_collections += 1
        return found

    def tick(self) -> bool:
        """The timer's check: a full collection if none ran for twice ``full_every``."""
        if (
            self.installed
            and self._gc.isenabled()
            and self._clock() - self.last_full >= 2 * self.full_every
        ):
            self.collect_full()
            return True
        return False

    async def pace(self) -> None:
        """Run :meth:`tick` every ``full_every`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.full_every)
            try:
                self.tick()
            except Exception:  # never let the timer die: full collections would stop
                log.exception("full garbage collection failed")


collector = Collector()
