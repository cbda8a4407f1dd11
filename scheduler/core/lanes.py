"""Lanes: one serial queue per GPU.

A lane is one size-1 resource (a GPU) with its own :class:`WaitingQueue`: within a lane
one request runs at a time, picked by score; different lanes run at once. Every model
is on exactly one lane (``routing.scheduler.settings.serial.lanes``; a model on no named
lane is on :data:`DEFAULT_LANE`), so a request's lane follows from its model.

:class:`LaneQueues` keeps the lanes' queues side by side and answers the questions the
rest of the product asks of "the queue" (depth, per-band stats, the order of the waiting
requests) across all of them. :func:`fill_slots` is the serial admission rule for a
model served with ``slots: N``.

Pure: no Django, asyncio, network or clock reads; ``now`` is always an argument.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping

from scheduler.core.policy import Decision, QueuedRequest, Ranked, SchedulerSettings
from scheduler.core.priority import BANDS, Band
from scheduler.core.queue import BandStats, WaitingQueue

DEFAULT_LANE = "default"


class LaneQueues:
    """The waiting queues of every lane, addressed by request id or lane name.

    Adding and cancelling cost what they cost in one :class:`WaitingQueue` plus a dict
    lookup; the cross-lane views (:meth:`oldest`, :meth:`band_stats`) cost one lookup per
    lane, and lanes are few (one per GPU).
    """

    def __init__(
        self,
        settings: SchedulerSettings | None = None,
        lane_of: Mapping[str, str] | None = None,
        lanes: Iterable[str] = (),
    ) -> None:
        self._lane_of = dict(lane_of or {})
        names = dict.fromkeys([DEFAULT_LANE, *lanes, *self._lane_of.values()])
        self._queues = {name: WaitingQueue(settings) for name in names}
        self._where: dict[str, str] = {}
        """Waiting request id -> its lane."""

    # -- lookups -------------------------------------------------------------------------

    @property
    def settings(self) -> SchedulerSettings:
        return self._queues[DEFAULT_LANE].settings

    @property
    def names(self) -> list[str]:
        return list(self._queues)

    def lane(self, name: str) -> WaitingQueue:
        """One lane's queue, for reading. Change it only through this object."""
        return self._queues[name]

    def lane_for(self, model: str) -> str:
        return self._lane_of.get(model, DEFAULT_LANE)

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._where

    def get(self, request_id: str) -> QueuedRequest | None:
        lane = self._where.get(request_id)
        return self._queues[lane].get(request_id) if lane is not None else None

    def waiting_for(self, model: str) -> int:
        return self._queues[self.lane_for(model)].waiting_for(model)

    def oldest(self, band: Band) -> QueuedRequest | None:
        """The longest-waiting request of a band across lanes."""
        heads = [r for r in (q.oldest(band) for q in self._queues.values()) if r is not None]
        return min(heads, key=lambda r: r.arrival, default=None)

    def band_stats(self, now: float) -> dict[Band, BandStats]:
        """Depth (summed) and oldest wait (the longest) per band across lanes."""
        per_lane = [q.band_stats(now) for q in self._queues.values()]
        return {
            band: BandStats(
                depth=sum(s[band].depth for s in per_lane),
                oldest_wait=max(s[band].oldest_wait for s in per_lane),
            )
            for band in BANDS
        }

    def peek(self, now: float, limit: int | None = None) -> list[Ranked]:
        """Waiting requests of every lane, each lane in its dispatch order, merged by
        score (lanes dispatch independently, so this is an order of urgency, not of
        dispatch; :meth:`Dispatcher.waiting` gives each request's place in its own lane)."""
        if len(self._queues) == 1:
            return self._queues[DEFAULT_LANE].peek(now, limit)
        merged = heapq.merge(
            *(q.peek(now, limit) for q in self._queues.values() if len(q)),
            key=lambda r: -r.score,
        )
        return list(itertools.islice(merged, limit))

    # -- changes -------------------------------------------------------------------------

    def add(self, request: QueuedRequest) -> str:
        """Queue a request on its model's lane; returns the lane's name."""
        lane = self.lane_for(request.model)
        self._queues[lane].add(request)
        self._where[request.request_id] = lane
        return lane

    def cancel(self, request_id: str) -> QueuedRequest | None:
        lane = self._where.pop(request_id, None)
        return self._queues[lane].cancel(request_id) if lane is not None else None

    def pick(self, now: float, lane: str, model: str | None = None) -> Decision | None:
        """The next request of one lane (see :meth:`WaitingQueue.pick`), removed."""
        decision = self._queues[lane].pick(now, model)
        if decision is not None:
            del self._where[decision.request_id]
        return decision

    def set_settings(self, settings: SchedulerSettings) -> None:
        for queue in self._queues.values():
            queue.set_settings(settings)


def fill_slots(
    queues: LaneQueues, lane: str, now: float, model: str, busy: int, slots: int
) -> list[Decision]:
    """Serial admission with slots: while the lane runs fewer than ``slots`` requests of
    ``model`` and the best waiting request of the lane is for ``model``, it goes too.
    As soon as the best waiting request needs another model the lane admits nothing
    more: it drains, and the next pick (once ``busy`` is 0) swaps. Scores, aging and
    affinity are the queue's own, so this never lets a model's requests pass a better
    request of another model."""
    queue = queues.lane(lane)
    admitted: list[Decision] = []
    while busy < slots and queue.next_model() == model:
        decision = queues.pick(now, lane)
        assert decision is not None
        admitted.append(decision)
        busy += 1
    return admitted
