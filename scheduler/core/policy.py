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

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from scheduler.core.priority import Band, band_of


class Policy(StrEnum):
    """Which scheduler orders the queue (``routing.scheduler.use``)."""

    SERIAL = "serial"
    """The spec's scheduler: one job at a time, score = priority + affinity + aging."""
    FIFO = "fifo"
    """llama-swap's: model priority + header priority, arrival order among equals."""


class Term(StrEnum):
    """A score term that can change which request goes next."""

    AGING = "aging"
    SWAP_AFFINITY = "swap_affinity"
    AGING_CAP = "aging_cap"
    """The cap on aging points (``agingCap``): uncapped aging would have picked another."""
    BAND_SHARE = "band_share"
    """A band's guaranteed share of GPU time (``bandShare``) overrode the score order."""


SETTINGS_PREFIX = "routing.scheduler"
KEY_USE = f"{SETTINGS_PREFIX}.use"
KEY_AGING = f"{SETTINGS_PREFIX}.settings.serial.agingDivisor"
KEY_BONUS = f"{SETTINGS_PREFIX}.settings.serial.swapAffinityBonus"
KEY_FIFO = f"{SETTINGS_PREFIX}.settings.fifo.priority"
KEY_AGING_CAP = f"{SETTINGS_PREFIX}.settings.serial.agingCap"
KEY_BAND_SHARE = f"{SETTINGS_PREFIX}.settings.serial.bandShare"

DEFAULT_AGING_DIVISOR = 60
DEFAULT_SWAP_AFFINITY_BONUS = 10
MAX_SWAP_AFFINITY_BONUS = 99


class SettingsError(ValueError):
    """An invalid scheduler setting; ``key`` is the config key path."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"{key}: {reason} (got {value!r})")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SchedulerSettings:
    """Validated scheduler settings. Build with :meth:`create` to validate."""

    use: Policy = Policy.SERIAL
    aging_divisor: float = DEFAULT_AGING_DIVISOR
    swap_affinity_bonus: int = DEFAULT_SWAP_AFFINITY_BONUS
    fifo_priority: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    aging_cap: float | None = None
    """At most this many aging points (None: unbounded, the spec's default)."""
    band_share: Mapping[Band, float] = field(default_factory=lambda: MappingProxyType({}))
    """Guaranteed share of GPU time per band while it has work waiting (empty: off)."""

    @classmethod
    def create(
        cls,
        use: object = Policy.SERIAL.value,
        aging_divisor: object = DEFAULT_AGING_DIVISOR,
        swap_affinity_bonus: object = DEFAULT_SWAP_AFFINITY_BONUS,
        fifo_priority: Mapping[Any, Any] | None = None,
        aging_cap: object = None,
        band_share: Mapping[Any, Any] | None = None,
    ) -> SchedulerSettings:
        """Validate raw values (from YAML, a form or the command line).

        Raises :class:`SettingsError` naming the key and the value.
        """
        try:
            policy = Policy(use if isinstance(use, str) else "")
        except ValueError:
            raise SettingsError(KEY_USE, use, "must be 'serial' or 'fifo'") from None
        if isinstance(aging_divisor, bool) or not isinstance(aging_divisor, int | float):
            raise SettingsError(KEY_AGING, aging_divisor, "must be a number >= 0")
        if not math.isfinite(aging_divisor) or aging_divisor < 0:
            raise SettingsError(KEY_AGING, aging_divisor, "must be a finite number >= 0")
        if not _is_int(swap_affinity_bonus):
            raise SettingsError(KEY_BONUS, swap_affinity_bonus, "must be an integer 0..99")
        assert isinstance(swap_affinity_bonus, int)
        if not 0 <= swap_affinity_bonus <= MAX_SWAP_AFFINITY_BONUS:
            raise SettingsError(KEY_BONUS, swap_affinity_bonus, "must be an integer 0..99")
        priorities: dict[str, int] = {}
        if fifo_priority is not None:
            if not isinstance(fifo_priority, Mapping):
                raise SettingsError(KEY_FIFO, fifo_priority, "must be a map of model id to integer")
            for model, value in fifo_priority.items():
                if not isinstance(model, str) or not model:
                    raise SettingsError(KEY_FIFO, model, "model ids must be non-empty strings")
                if not _is_int(value):
                    raise SettingsError(f"{KEY_FIFO}.{model}", value, "must be an integer")
                priorities[model] = value
        return cls(
            use=policy,
            aging_divisor=aging_divisor,
            swap_affinity_bonus=swap_affinity_bonus,
            fifo_priority=MappingProxyType(priorities),
            aging_cap=_aging_cap(aging_cap),
            band_share=MappingProxyType(_band_share(band_share)),
        )

    def with_changes(self, **changes: object) -> SchedulerSettings:
        """A validated copy with some values replaced (keyword names as in :meth:`create`)."""
        values: dict[str, object] = {
            "use": self.use.value,
            "aging_divisor": self.aging_divisor,
            "swap_affinity_bonus": self.swap_affinity_bonus,
            "fifo_priority": dict(self.fifo_priority),
            "aging_cap": self.aging_cap,
            "band_share": {band.value: share for band, share in self.band_share.items()},
        }
        unknown = set(changes) - set(values)
        if unknown:
            raise TypeError(f"unknown settings: {sorted(unknown)}")
        values.update(changes)
        return SchedulerSettings.create(**values)  # type: ignore[arg-type]

    def as_dict(self) -> dict[str, object]:
        return {
            "use": self.use.value,
            "agingDivisor": self.aging_divisor,
            "swapAffinityBonus": self.swap_affinity_bonus,
            "fifoPriority": dict(self.fifo_priority),
            "agingCap": self.aging_cap,
            "bandShare": {band.value: share for band, share in self.band_share.items()},
        }

    @property
    def bounded(self) -> bool:
        """Is an opt-in starvation bound on (``agingCap`` or ``bandShare``)?"""
        return self.aging_cap is not None or bool(self.band_share)


def _aging_cap(value: object) -> float | None:
    """``agingCap``: None (absent: no cap) or a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SettingsError(KEY_AGING_CAP, value, "must be a number > 0 (or absent: no cap)")
    if not math.isfinite(value) or value <= 0:
        raise SettingsError(KEY_AGING_CAP, value, "must be a finite number > 0 (or absent: no cap)")
    return value


def _band_share(value: Mapping[Any, Any] | None) -> dict[Band, float]:
    """``bandShare``: band name -> share in 0..1; the shares sum to at most 1. Zero shares
    are dropped (a band without a share is scheduled by score alone)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SettingsError(
            KEY_BAND_SHARE, value, "must be a map of band (interactive, normal, batch) to share"
        )
    shares: dict[Band, float] = {}
    for name, share in value.items():
        try:
            band = Band(name if isinstance(name, str) else "")
        except ValueError:
            raise SettingsError(
                KEY_BAND_SHARE, name, "bands are interactive, normal and batch"
            ) from None
        key = f"{KEY_BAND_SHARE}.{band.value}"
        if isinstance(share, bool) or not isinstance(share, int | float):
            raise SettingsError(key, share, "must be a number from 0 to 1")
        if not math.isfinite(share) or not 0 <= share <= 1:
            raise SettingsError(key, share, "must be a number from 0 to 1")
        if share:
            shares[band] = float(share)
    total = sum(shares.values())
    if total > 1 + 1e-9:
        raise SettingsError(
            KEY_BAND_SHARE,
            {b.value: s for b, s in shares.items()},
            f"the shares sum to {total:g}, more than 1",
        )
    return {band: shares[band] for band in sorted(shares, key=list(Band).index)}


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
