"""The waiting queue: which waiting request goes next, without scanning the queue.

Pure: no Django, asyncio, network or clock reads; ``now`` is always an argument.

Why no scan is needed. With aging divisor ``D > 0`` the serial score of request ``i``
at time ``now`` is ``p_i + a_i + (now - t_i) / D``. Multiplying by ``D`` and dropping
``now`` (the same for everyone) orders requests exactly like the static key
``(p_i + a_i) * D - t_i``: the order of two waiting requests never changes as they
age. Only the affinity ``a_i`` moves, and it is the same ``bonus`` for every request of
the loaded model and 0 for all others. So the best request is the better of two
candidates: the head of the loaded model's list with the bonus added, and the head of
the global list without it (if that head is of the loaded model, the first candidate
already beats it). Each list is a ``SortedList`` keyed by ``(key, arrival seq)``, so
add and cancel are O(log n) and a pick is a handful of head lookups.

Attribution ("which terms changed the pick") needs the counterfactual picks with a term
removed from every score; keeping the same lists for the plain priority order makes
each counterfactual another couple of head lookups.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sortedcontainers import SortedList

from scheduler.core.policy import (
    Decision,
    Policy,
    QueuedRequest,
    Ranked,
    SchedulerSettings,
    Term,
)
from scheduler.core.priority import BANDS, Band

_Key = tuple[float, int]


@dataclass(slots=True)
class _Entry:
    request: QueuedRequest
    seq: int
    effective: int
    """Header priority, plus the model's fifo priority under fifo."""
    aged: tuple[float, int, _Entry] | None
    plain: tuple[float, int, _Entry]


@dataclass(frozen=True, slots=True)
class BandStats:
    depth: int
    oldest_wait: float


class WaitingQueue:
    """Requests waiting for the GPU, ordered by the configured policy.

    ``arrival`` times must not decrease from one :meth:`add` to the next (they come
    from one monotonic clock); that keeps "oldest waiting" per band O(1).
    """

    def __init__(self, settings: SchedulerSettings | None = None, loaded_model: str | None = None):
        self._settings = settings or SchedulerSettings()
        self._loaded: frozenset[str] = frozenset((loaded_model,)) if loaded_model else frozenset()
        self._entries: dict[str, _Entry] = {}
        self._by_band: dict[Band, OrderedDict[str, QueuedRequest]] = {b: OrderedDict() for b in BANDS}
        self._seq = itertools.count()
        self._last_arrival = float("-inf")
        self._cache_settings()
        self._reset_lists()

    # -- state -------------------------------------------------------------------------

    @property
    def settings(self) -> SchedulerSettings:
        return self._settings

    @property
    def loaded_model(self) -> str | None:
        """The loaded model when exactly one is (the classic one-model GPU), else None."""
        return next(iter(self._loaded)) if len(self._loaded) == 1 else None

    @property
    def loaded_models(self) -> frozenset[str]:
        """Every model loaded on this queue's GPU (groups let several stay resident)."""
        return self._loaded

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> QueuedRequest | None:
        entry = self._entries.get(request_id)
        return entry.request if entry else None

    def waiting_for(self, model: str) -> int:
        lst = self._model_plain.get(model)
        return len(lst) if lst else 0

    def oldest(self, band: Band) -> QueuedRequest | None:
        """The longest-waiting request of a band, or None. O(1)."""
        return next(iter(self._by_band[band].values()), None)

    def band_stats(self, now: float) -> dict[Band, BandStats]:
        """Depth and oldest wait per band, all three bands always present. O(1) per band."""
        stats = {}
        for band, requests in self._by_band.items():
            oldest = next(iter(requests.values()), None)
            wait = max(0.0, now - oldest.arrival) if oldest else 0.0
            stats[band] = BandStats(depth=len(requests), oldest_wait=wait)
        return stats

    # -- changes -----------------------------------------------------------------------

    def add(self, request: QueuedRequest) -> None:
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        if request.arrival < self._last_arrival:
            raise ValueError("arrival times must not decrease")
        self._last_arrival = request.arrival
        entry = self._make_entry(request, next(self._seq))
        self._entries[request.request_id] = entry
        self._by_band[request.band][request.request_id] = request
        self._insert(entry)

    def cancel(self, request_id: str) -> QueuedRequest | None:
        """Remove a waiting request (its client went away). None if it is not waiting."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        del self._by_band[entry.request.band][request_id]
        self._discard(entry)
        return entry.request

    def set_loaded_model(self, model: str | None) -> None:
        """The model now on the GPU (None: nothing loaded). Affinity follows it."""
        self._loaded = frozenset((model,)) if model else frozenset()

    def set_loaded_models(self, models: Iterable[str]) -> None:
        """The models now on the GPU; affinity applies to the requests of each of them."""
        self._loaded = frozenset(models)

    def next_model(self) -> str | None:
        """The model of the request :meth:`pick` would choose now, without removing it."""
        best = self._best(aged=True, affinity=True)
        return best.request.model if best is not None else None

    def set_settings(self, settings: SchedulerSettings) -> None:
        """Apply new settings from the next pick on. Re-keys the lists (O(n log n)) only
        when the order itself depends on what changed."""
        old = self._settings
        self._settings = settings
        self._cache_settings()
        if (
            old.use != settings.use
            or old.aging_divisor != settings.aging_divisor
            or dict(old.fifo_priority) != dict(settings.fifo_priority)
        ):
            entries = sorted(self._entries.values(), key=lambda e: e.seq)
            self._reset_lists()
            for e in entries:
                new = self._make_entry(e.request, e.seq)
                self._entries[e.request.request_id] = new
                self._insert(new)

    # -- the pick ----------------------------------------------------------------------

    def pick(self, now: float, model: str | None = None) -> Decision | None:
        """Remove and return the decision for the request that goes next.

        With ``model``, only that model's requests are considered (fifo serves a ready
        model's waiting requests at once). None when nothing (eligible) is waiting.
        """
        if model is not None:
            lst = self._model_plain.get(model)
            if not lst:
                return None
            winner = lst[0][2]
            reordered: frozenset[Term] = frozenset()
            if self._serial:
                best = self._best(aged=True, affinity=True, only=model)
                assert best is not None
                winner = best
        else:
            best = self._best(aged=True, affinity=True)
            if best is None:
                return None
            winner = best
            reordered = self._attribution(winner)
        self._remove_entry(winner)
        runner = self._best(aged=True, affinity=True)
        return self._decision(winner, now, reordered, runner)

    def peek(self, now: float, limit: int | None = None) -> list[Ranked]:
        """The waiting requests in the order they would go next, with their scores now."""
        out = []
        for entry in itertools.islice(self._order(), limit):
            affinity, aging, score = self._terms(entry, now)
            out.append(
                Ranked(
                    request=entry.request,
                    score=score,
                    affinity=affinity,
                    aging=aging,
                    wait=max(0.0, now - entry.request.arrival),
                )
            )
        return out

    # -- internals ---------------------------------------------------------------------

    def _cache_settings(self) -> None:
        """Derived settings, read on every pick."""
        settings = self._settings
        self._serial = settings.use is Policy.SERIAL
        self._divisor = settings.aging_divisor if self._serial else 0
        self._aging_on = self._divisor > 0
        self._bonus = settings.swap_affinity_bonus if self._serial else 0

    def _reset_lists(self) -> None:
        self._global_plain: SortedList = SortedList()
        self._global_aged: SortedList = SortedList()
        self._model_plain: dict[str, SortedList] = {}
        self._model_aged: dict[str, SortedList] = {}

    def _make_entry(self, request: QueuedRequest, seq: int) -> _Entry:
        effective = request.priority
        if not self._serial:
            effective += self._settings.fifo_priority.get(request.model, 0)
        entry = _Entry(request=request, seq=seq, effective=effective, aged=None, plain=None)  # type: ignore[arg-type]
        entry.plain = (-effective, seq, entry)
        if self._aging_on:
            entry.aged = (request.arrival - effective * self._divisor, seq, entry)
        return entry

    def _insert(self, entry: _Entry) -> None:
        model = entry.request.model
        self._global_plain.add(entry.plain)
        self._model_plain.setdefault(model, SortedList()).add(entry.plain)
        if entry.aged is not None:
            self._global_aged.add(entry.aged)
            self._model_aged.setdefault(model, SortedList()).add(entry.aged)

    def _discard(self, entry: _Entry) -> None:
        model = entry.request.model
        self._global_plain.remove(entry.plain)
        lst = self._model_plain[model]
        lst.remove(entry.plain)
        if not lst:
            del self._model_plain[model]
        if entry.aged is not None:
            self._global_aged.remove(entry.aged)
            lst = self._model_aged[model]
            lst.remove(entry.aged)
            if not lst:
                del self._model_aged[model]

    def _remove_entry(self, entry: _Entry) -> None:
        del self._entries[entry.request.request_id]
        del self._by_band[entry.request.band][entry.request.request_id]
        self._discard(entry)

    def _lists(self, aged: bool) -> tuple[SortedList, dict[str, SortedList], bool]:
        """The lists for one ordering, and whether that ordering uses the aging key."""
        if aged and self._aging_on:
            return self._global_aged, self._model_aged, True
        return self._global_plain, self._model_plain, False

    def _boosted(self, entry: _Entry, aged: bool) -> float:
        """The key of a loaded-model entry with its affinity bonus, computed in one step
        exactly like the plain keys so that exact ties stay exact."""
        if aged:
            return entry.request.arrival - (entry.effective + self._bonus) * self._divisor
        return float(-(entry.effective + self._bonus))

    def _best(self, aged: bool, affinity: bool, only: str | None = None) -> _Entry | None:
        """The best waiting request under one ordering; O(log n) at worst."""
        global_list, model_lists, aged = self._lists(aged)
        if only is not None:
            lst = model_lists.get(only)
            head: _Entry | None = lst[0][2] if lst else None
            return head
        best: tuple[float, int, _Entry] | None = global_list[0] if global_list else None
        if affinity and self._bonus:
            # One head lookup per loaded model (one, or a handful with groups).
            for loaded in self._loaded:
                lst = model_lists.get(loaded)
                if lst:
                    _, seq, boosted = lst[0]
                    key = (self._boosted(boosted, aged), seq, boosted)
                    if best is None or key[:2] < best[:2]:
                        best = key
        return best[2] if best is not None else None

    def _attribution(self, winner: _Entry) -> frozenset[Term]:
        terms = set()
        if self._aging_on and self._best(aged=False, affinity=True) is not winner:
            terms.add(Term.AGING)
        if (
            self._bonus
            and self._loaded
            and self._best(aged=True, affinity=False) is not winner
        ):
            terms.add(Term.SWAP_AFFINITY)
        return frozenset(terms)

    def _terms(self, entry: _Entry, now: float) -> tuple[float, float, float]:
        """(affinity, aging, score) of one entry at ``now``."""
        affinity = float(self._bonus) if entry.request.model in self._loaded else 0.0
        aging = 0.0
        if self._aging_on:
            aging = max(0.0, now - entry.request.arrival) / self._divisor
        return affinity, aging, entry.effective + affinity + aging

    def _decision(
        self, winner: _Entry, now: float, reordered: frozenset[Term], runner: _Entry | None
    ) -> Decision:
        request = winner.request
        affinity, aging, score = self._terms(winner, now)
        runner_score = self._terms(runner, now)[2] if runner is not None else None
        return Decision(
            request_id=request.request_id,
            model=request.model,
            priority=request.priority,
            band=request.band,
            policy=self._settings.use,
            score=score,
            affinity=affinity,
            aging=aging,
            queue_wait=max(0.0, now - request.arrival),
            reordered_by=reordered,
            runner_up_id=runner.request.request_id if runner is not None else None,
            runner_up_score=runner_score,
            needs_swap=request.model not in self._loaded,
            fifo_priority=None if self._serial else winner.effective,
            waiting_after=len(self._entries),
        )

    def _order(self) -> Iterator[_Entry]:
        """All waiting entries in dispatch order (lazy)."""
        global_list, model_lists, aged = self._lists(aged=True)
        loaded = self._loaded
        if not self._bonus or not loaded.intersection(model_lists):
            return (item[2] for item in global_list)
        # Merge per-model lists (few) rather than filter the global one, so the first k
        # entries cost O(k log models) however many wait for a loaded model.
        lists: list[Iterator[tuple[float, int, _Entry]]] = [
            ((self._boosted(e, aged), seq, e) for _, seq, e in lst)
            if model in loaded
            else iter(lst)
            for model, lst in model_lists.items()
        ]
        return (item[2] for item in heapq.merge(*lists, key=lambda i: i[:2]))
