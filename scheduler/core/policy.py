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


SETTINGS_PREFIX = "routing.scheduler"
KEY_USE = f"{SETTINGS_PREFIX}.use"
KEY_AGING = f"{SETTINGS_PREFIX}.settings.serial.agingDivisor"
KEY_BONUS = f"{SETTINGS_PREFIX}.settings.serial.swapAffinityBonus"
KEY_FIFO = f"{SETTINGS_PREFIX}.settings.fifo.priority"

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

    @classmethod
    def create(
        cls,
        use: object = Policy.SERIAL.value,
        aging_divisor: object = DEFAULT_AGING_DIVISOR,
        swap_affinity_bonus: object = DEFAULT_SWAP_AFFINITY_BONUS,
        fifo_priority: Mapping[Any, Any] | None = None,
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
        )

    def with_changes(self, **changes: object) -> SchedulerSettings:
        """A validated copy with some values replaced (keyword names as in :meth:`create`)."""
        values: dict[str, object] = {
            "use": self.use.value,
            "aging_divisor": self.aging_divisor,
            "swap_affinity_bonus": self.swap_affinity_bonus,
            "fifo_priority": dict(self.fifo_priority),
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
        }


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
