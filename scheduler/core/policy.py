"""Scheduler settings, waiting requests and dispatch decisions: the values of the core.

Pure: no Django, asyncio, network or clock reads. Time always comes in as an argument
(seconds on any monotonic scale). See docs/scheduling.md.

The serial score of a waiting request at time ``now`` is::

    score = priority + swap_affinity + aging
    swap_affinity = swapAffinityBonus if request.model == loaded model else 0
    aging = (now - arrival) / agingDivisor      (0 when agingDivisor == 0)

Equal scores keep arrival order. The fifo policy (llama-swap's) orders by
``fifo.priority[model] + header priority``, arrival order among equals, with no aging
and no affinity.

Two opt-in starvation bounds (both off by default, so the spec's order is unchanged):

* ``agingCap`` (points, > 0): ``aging = min((now - arrival) / agingDivisor, agingCap)``.
  Aging then lifts a request by at most ``agingCap`` points, reached after
  ``agingCap * agingDivisor`` seconds: a request at priority ``p`` is never passed by one
  below ``p - agingCap - swapAffinityBonus``. With a cap under 100 no request ever
  crosses a whole band by waiting.
* ``bandShare`` (band -> share of GPU time, each in 0..1, sum <= 1): while a band has work
  waiting, it is owed ``share * (seconds since it last had nothing waiting)`` of GPU time.
  When a band with work waiting has received less than it is owed, its best request goes
  next, whatever the scores (the band furthest behind first). A band with work waiting
  therefore never falls more than about one job's duration behind its share. GPU time is
  counted from one pick to the next (the serial scheduler picks when the GPU frees up).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from scheduler.core.priority import Band, band_of
from scheduler.core.settings import (
    BY_FIELD,
    BY_NAME,
    SETTINGS,
    check_fields,
    fields_from_names,
)
from scheduler.core.settings import SETTINGS_PREFIX as SETTINGS_PREFIX  # re-exported
from scheduler.core.settings import Policy as Policy
from scheduler.core.settings import SettingsError as SettingsError


class Term(StrEnum):
    """A score term that can change which request goes next."""

    AGING = "aging"
    SWAP_AFFINITY = "swap_affinity"
    AGING_CAP = "aging_cap"
    """The cap on aging points (``agingCap``): uncapped aging would have picked another."""
    BAND_SHARE = "band_share"
    """A band's guaranteed share of GPU time (``bandShare``) overrode the score order."""


KEY_USE = BY_NAME["use"].key
KEY_AGING = BY_NAME["agingDivisor"].key
KEY_BONUS = BY_NAME["swapAffinityBonus"].key
KEY_FIFO = BY_NAME["fifoPriority"].key
KEY_AGING_CAP = BY_NAME["agingCap"].key
KEY_BAND_SHARE = BY_NAME["bandShare"].key

DEFAULT_AGING_DIVISOR = BY_NAME["agingDivisor"].default
DEFAULT_SWAP_AFFINITY_BONUS = BY_NAME["swapAffinityBonus"].default
MAX_SWAP_AFFINITY_BONUS = BY_NAME["swapAffinityBonus"].maximum


def _default(name: str) -> Any:
    """A field's default, from the settings table (maps through a factory: a dataclass
    default must be hashable)."""
    row = BY_FIELD[name]
    if row.is_map:
        return field(default_factory=lambda: MappingProxyType(dict(row.default)))
    return field(default=row.default)


@dataclass(frozen=True)
class SchedulerSettings:
    """Validated scheduler settings. Build with :meth:`create` to validate.

    Each field has a row in :data:`scheduler.core.settings.SETTINGS` (YAML name, default,
    range, help); ``tests/test_settings_table.py`` checks that they match."""

    use: Policy = _default("use")
    aging_divisor: float = _default("aging_divisor")
    swap_affinity_bonus: int = _default("swap_affinity_bonus")
    fifo_priority: Mapping[str, int] = _default("fifo_priority")
    aging_cap: float | None = _default("aging_cap")
    """At most this many aging points (None: unbounded, the spec's default)."""
    band_share: Mapping[Band, float] = _default("band_share")
    """Guaranteed share of GPU time per band while it has work waiting (empty: off)."""
    start_failure_cooldown: float = _default("start_failure_cooldown")
    """Seconds after a failed start during which requests for that model fail at once with
    the cause (0: every request retries the start)."""

    @classmethod
    def create(cls, **raw: object) -> SchedulerSettings:
        """Validate raw values (from YAML, a form or the command line) by field name; the
        missing ones take their defaults.

        Raises :class:`SettingsError` naming the key and the value, TypeError for a name
        that is no setting.
        """
        return cls(**check_fields(raw))

    @classmethod
    def from_names(cls, values: Mapping[str, object]) -> SchedulerSettings:
        """Validate raw values by YAML name (``agingDivisor``), as stored or as JSON."""
        return cls.create(**fields_from_names(values))

    def with_changes(self, **changes: object) -> SchedulerSettings:
        """A validated copy with some values replaced (keyword names as in :meth:`create`)."""
        values = self.raw()
        unknown = set(changes) - set(values)
        if unknown:
            raise TypeError(f"unknown settings: {sorted(unknown)}")
        values.update(changes)
        return SchedulerSettings.create(**values)

    def raw(self) -> dict[str, object]:
        """Every value as JSON by field name (what :meth:`create` takes back)."""
        return {s.field: s.plain(getattr(self, s.field)) for s in SETTINGS}

    def as_dict(self) -> dict[str, object]:
        """Every value as JSON by YAML name (``agingDivisor``)."""
        return {s.name: s.plain(getattr(self, s.field)) for s in SETTINGS}

    @property
    def bounded(self) -> bool:
        """Is an opt-in starvation bound on (``agingCap`` or ``bandShare``)?"""
        return self.aging_cap is not None or bool(self.band_share)


def aging_points(wait: float, divisor: float, cap: float | None) -> float:
    """The aging term of a request that has waited ``wait`` seconds (the module's formula)."""
    if not divisor:
        return 0.0
    aging = max(0.0, wait) / divisor
    return min(aging, cap) if cap is not None else aging


def serial_score(priority: int, affinity: float, aging: float) -> float:
    """The serial score: priority + swap affinity + aging."""
    return priority + affinity + aging


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A request waiting for the GPU."""

    request_id: str
    model: str
    priority: int
    arrival: float
    """Seconds on the caller's monotonic clock."""

    @property
    def band(self) -> Band:
        return band_of(self.priority)


@dataclass(frozen=True, slots=True)
class Ranked:
    """A waiting request with its score at some moment, for the dashboard's queue view."""

    request: QueuedRequest
    score: float
    affinity: float
    aging: float
    wait: float


@dataclass(frozen=True, slots=True)
class Decision:
    """Why a request went next: everything needed to explain a wait after the fact."""

    request_id: str
    model: str
    priority: int
    band: Band
    policy: Policy
    score: float
    """The score it won with (under fifo: model priority + header priority)."""
    affinity: float
    """The swap-affinity term (0 under fifo)."""
    aging: float
    """The aging term (0 under fifo)."""
    queue_wait: float
    """Seconds from arrival to this pick."""
    reordered_by: frozenset[Term]
    """Terms whose removal from every score would have picked a different request."""
    runner_up_id: str | None
    runner_up_score: float | None
    needs_swap: bool
    """The picked model was not the loaded one."""
    fifo_priority: int | None = None
    """Under fifo: the queue priority it ran at."""
    waiting_after: int = 0
    """Requests still waiting after this pick."""
