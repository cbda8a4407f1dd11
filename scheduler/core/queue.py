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

The opt-in bounds keep that. **agingCap** ``C``: a request's aging stops growing once it
has waited ``C * D``; since arrivals never decrease, the requests whose aging is capped
at ``now`` are exactly those that arrived by ``now - C * D``, a prefix of the arrival
order. They move (once each, in arrival order, as ``now`` passes their cap time) from
the *unsaturated* lists (aging key) to the *saturated* lists (plain key ``p + a + C``),
and the best request is the better of the two heads, compared on one scale (score times
``D``, minus ``now``). So ``now`` must not go backwards between picks and peeks (it comes
from one monotonic clock); if it does, the lists are rebuilt (O(n log n)).
**bandShare**: each band keeps its own copy of the lists (three bands: a constant), and
the accounting of GPU time per band is three numbers; a pick compares three deficits and
then takes one band's head.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum

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

_Item = tuple[float, int, "_Entry"]


class _Order(Enum):
    """One way of ranking the waiting requests (the score, or a counterfactual)."""

    PLAIN = "plain"
    """Priority (+ affinity) only: aging removed."""
    AGED = "aged"
    """Unbounded aging: the spec's score."""
    CAPPED = "capped"
    """Aging capped at ``agingCap``."""


@dataclass(slots=True)
class _Entry:
    request: QueuedRequest
    seq: int
    effective: int
    """Header priority, plus the model's fifo priority under fifo."""
    plain: _Item
    aged: _Item | None
    saturated: bool = False
    """Its aging has reached ``agingCap`` (it sits in the saturated lists)."""
    live: bool = True


class _Lists:
    """One ordering of a set of entries: one SortedList for all, one per model."""

    __slots__ = ("all", "by_model")

    def __init__(self) -> None:
        self.all: SortedList = SortedList()
        self.by_model: dict[str, SortedList] = {}

    def add(self, model: str, item: _Item) -> None:
        self.all.add(item)
        lst = self.by_model.get(model)
        if lst is None:
            lst = self.by_model[model] = SortedList()
        lst.add(item)

    def remove(self, model: str, item: _Item) -> None:
        self.all.remove(item)
        lst = self.by_model[model]
        lst.remove(item)
        if not lst:
            del self.by_model[model]


class _Family:
    """The lists of one set of waiting requests: all of them, or one band's."""

    __slots__ = ("plain", "aged", "unsat", "sat")

    def __init__(self) -> None:
        self.plain = _Lists()
        """Every entry by its plain key (priority only)."""
        self.aged = _Lists()
        """Every entry by its aging key (when aging is on)."""
        self.unsat = _Lists()
        """agingCap on: the entries still aging, by their aging key."""
        self.sat = _Lists()
        """agingCap on: the entries whose aging is capped, by their plain key."""


@dataclass(frozen=True, slots=True)
class BandStats:
    depth: int
    oldest_wait: float


class WaitingQueue:
    """Requests waiting for the GPU, ordered by the configured policy.

    ``arrival`` times must not decrease from one :meth:`add` to the next (they come
    from one monotonic clock); that keeps "oldest waiting" per band O(1), and lets the
    aging cap move requests to their capped score in arrival order.
    """

    def __init__(self, settings: SchedulerSettings | None = None, loaded_model: str | None = None):
        self._settings = settings or SchedulerSettings()
        self._loaded: frozenset[str] = frozenset((loaded_model,)) if loaded_model else frozenset()
        self._entries: dict[str, _Entry] = {}
        self._by_band: dict[Band, OrderedDict[str, QueuedRequest]] = {
            b: OrderedDict() for b in BANDS
        }
        self._seq = itertools.count()
        self._last_arrival = float("-inf")
        self._now_seen = float("-inf")
        # bandShare accounting (kept whether or not a share is set, so turning one on
        # starts from the true state): when each band last went from empty to waiting,
        # the GPU seconds its picks got since, and the last pick (time, band).
        self._busy_since: dict[Band, float | None] = dict.fromkeys(BANDS)
        self._served: dict[Band, float] = dict.fromkeys(BANDS, 0.0)
        self._last_pick: tuple[float, Band] | None = None
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
        lst = self._all.plain.by_model.get(model)
        return len(lst) if lst else 0

    def most_urgent_for(self, model: str) -> QueuedRequest | None:
        """The waiting request of ``model`` with the highest (effective) priority. O(1)."""
        lst = self._all.plain.by_model.get(model)
        if not lst:
            return None
        entry: _Entry = lst[0][2]
        return entry.request

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

    def share_deficits(self, now: float) -> dict[Band, float]:
        """Per band with a ``bandShare`` and work waiting: the GPU seconds it is owed now
        (its share of the time since it last had nothing waiting, minus what its picks
        got since); > 0 means it is behind its share and its best request goes next."""
        out = {}
        for band, share in self._shares.items():
            since = self._busy_since[band]
            if since is not None and self._by_band[band]:
                out[band] = share * max(0.0, now - since) - self._served_now(band, now)
        return out

    # -- changes -----------------------------------------------------------------------

    def add(self, request: QueuedRequest) -> None:
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already waiting")
        if request.arrival < self._last_arrival:
            raise ValueError("arrival times must not decrease")
        self._last_arrival = request.arrival
        band = request.band
        if not self._by_band[band]:
            self._busy_since[band] = request.arrival
            self._served[band] = 0.0
        entry = self._make_entry(request, next(self._seq))
        self._entries[request.request_id] = entry
        self._by_band[band][request.request_id] = request
        self._insert(entry)

    def cancel(self, request_id: str) -> QueuedRequest | None:
        """Remove a waiting request (its client went away). None if it is not waiting."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        self._remove_entry(entry)
        return entry.request

    def set_loaded_model(self, model: str | None) -> None:
        """The model now on the GPU (None: nothing loaded). Affinity follows it."""
        self._loaded = frozenset((model,)) if model else frozenset()

    def set_loaded_models(self, models: Iterable[str]) -> None:
        """The models now on the GPU; affinity applies to the requests of each of them."""
        self._loaded = frozenset(models)

    def next_model(self, now: float | None = None) -> str | None:
        """The model of the request :meth:`pick` would choose at ``now`` (default: the
        latest time a pick or peek saw), without removing it."""
        when = self._now_seen if now is None else now
        if when != float("-inf"):
            self._saturate(when, exact=False)
        best = self._choose(self._score_order, True, self._owed_band(when))
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
            or old.aging_cap != settings.aging_cap
            or bool(old.band_share) != bool(settings.band_share)
        ):
            self._rebuild()

    # -- the pick ----------------------------------------------------------------------

    def pick(self, now: float, model: str | None = None) -> Decision | None:
        """Remove and return the decision for the request that goes next.

        With ``model``, only that model's requests are considered (fifo serves a ready
        model's waiting requests at once). None when nothing (eligible) is waiting.
        """
        self._saturate(now)
        order = self._score_order
        if len(self._entries) == 1:
            # Alone in the queue (the common case with a free slot): it is the pick under
            # every ordering, so no term reordered it and there is no runner-up. The same
            # decision the lookups below reach, without them.
            winner = next(iter(self._entries.values()))
            if model is not None and winner.request.model != model:
                return None
            self._charge(now)
            self._last_pick = (now, winner.request.band)
            self._remove_entry(winner)
            return self._decision(winner, now, frozenset(), None)
        if model is not None:
            if model not in self._all.plain.by_model:
                return None
            only = self._best_in(self._all, order, True, only=model)
            assert only is not None
            winner = only
            reordered: frozenset[Term] = frozenset()
        else:
            band = self._owed_band(now)
            best = self._choose(order, True, band)
            if best is None:
                return None
            winner = best
            reordered = self._attribution(winner, band)
        self._charge(now)
        self._last_pick = (now, winner.request.band)
        self._remove_entry(winner)
        runner = self._choose(order, True, None)
        return self._decision(winner, now, reordered, runner)

    def peek(self, now: float, limit: int | None = None) -> list[Ranked]:
        """The waiting requests in the order they would go next, with their scores now.

        With ``bandShare``, the request of a band behind its share comes first (it goes
        next); the rest follow in score order (later picks depend on the GPU time the
        jobs will take, which the queue cannot know)."""
        self._saturate(now, exact=False)
        out = []
        for entry in itertools.islice(self._order(now), limit):
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

    # -- internals: settings and lists --------------------------------------------------

    def _cache_settings(self) -> None:
        """Derived settings, read on every pick."""
        settings = self._settings
        self._serial = settings.use is Policy.SERIAL
        self._divisor = settings.aging_divisor if self._serial else 0
        self._aging_on = self._divisor > 0
        self._bonus = settings.swap_affinity_bonus if self._serial else 0
        self._cap = settings.aging_cap if self._aging_on else None
        self._capped = self._cap is not None
        self._cap_seconds = (self._cap or 0.0) * self._divisor
        self._shares: dict[Band, float] = dict(settings.band_share) if self._serial else {}
        self._shared = bool(self._shares)
        if self._capped:
            self._score_order = _Order.CAPPED
        elif self._aging_on:
            self._score_order = _Order.AGED
        else:
            self._score_order = _Order.PLAIN

    def _reset_lists(self) -> None:
        self._all = _Family()
        self._band_lists: dict[Band, _Family] = (
            {b: _Family() for b in BANDS} if self._shared else {}
        )
        self._unsat_fifo: deque[_Entry] = deque()
        """agingCap on: entries in arrival order, to saturate as ``now`` passes them."""
        self._sat_now = float("-inf")

    def _rebuild(self) -> None:
        entries = sorted(self._entries.values(), key=lambda e: e.seq)
        for e in entries:
            e.live = False
        self._reset_lists()
        for e in entries:
            new = self._make_entry(e.request, e.seq)
            self._entries[e.request.request_id] = new
            self._insert(new)

    def _make_entry(self, request: QueuedRequest, seq: int) -> _Entry:
        effective = request.priority
        if not self._serial:
            effective += self._settings.fifo_priority.get(request.model, 0)
        entry = _Entry(request, seq, effective, plain=None, aged=None)  # type: ignore[arg-type]
        entry.plain = (-effective, seq, entry)
        if self._aging_on:
            entry.aged = (request.arrival - effective * self._divisor, seq, entry)
        return entry

    def _families(self, entry: _Entry) -> tuple[_Family, ...]:
        if self._shared:
            return (self._all, self._band_lists[entry.request.band])
        return (self._all,)

    def _insert(self, entry: _Entry) -> None:
        model = entry.request.model
        for family in self._families(entry):
            family.plain.add(model, entry.plain)
            if entry.aged is not None:
                family.aged.add(model, entry.aged)
                if self._capped:
                    family.unsat.add(model, entry.aged)
        if self._capped:
            self._unsat_fifo.append(entry)

    def _remove_entry(self, entry: _Entry) -> None:
        request = entry.request
        band = request.band
        del self._entries[request.request_id]
        band_queue = self._by_band[band]
        del band_queue[request.request_id]
        if not band_queue:
            self._busy_since[band] = None
            self._served[band] = 0.0
        entry.live = False
        model = request.model
        for family in self._families(entry):
            family.plain.remove(model, entry.plain)
            if entry.aged is not None:
                family.aged.remove(model, entry.aged)
                if self._capped:
                    if entry.saturated:
                        family.sat.remove(model, entry.plain)
                    else:
                        family.unsat.remove(model, entry.aged)

    def _saturate(self, now: float, exact: bool = True) -> None:
        """Move every entry whose aging has reached the cap at ``now`` to the saturated
        lists: a prefix of the arrival order, each entry once. O(log n) per entry moved.

        ``now`` earlier than a previous call: a pick starts over (O(n log n), never with
        one monotonic clock); a peek (``exact=False``) keeps the order as of the later
        time, which differs only for requests within that much of their cap."""
        if now > self._now_seen:
            self._now_seen = now
        if not self._capped:
            return
        if now < self._sat_now:
            if not exact:
                return
            self._rebuild()
        self._sat_now = now
        limit = now - self._cap_seconds
        pending = self._unsat_fifo
        while pending and pending[0].request.arrival <= limit:
            entry = pending.popleft()
            if not entry.live or entry.saturated:
                continue
            model = entry.request.model
            assert entry.aged is not None
            for family in self._families(entry):
                family.unsat.remove(model, entry.aged)
                family.sat.add(model, entry.plain)
            entry.saturated = True

    # -- internals: ranking -------------------------------------------------------------

    def _sources(self, family: _Family, order: _Order) -> tuple[_Lists, ...]:
        if order is _Order.CAPPED:
            return (family.unsat, family.sat)
        if order is _Order.AGED and self._aging_on:
            return (family.aged,)
        return (family.plain,)

    def _key(self, entry: _Entry, order: _Order, boosted: bool) -> float:
        """An entry's sort key under ``order`` (lower goes first), computed in one step
        exactly like the stored keys so that exact ties stay exact. Under CAPPED a
        saturated entry's key is on the aging scale at the last saturation time."""
        effective = entry.effective + self._bonus if boosted else entry.effective
        if order is _Order.PLAIN or not self._aging_on:
            return float(-effective)
        if order is _Order.AGED or not entry.saturated:
            return entry.request.arrival - effective * self._divisor
        assert self._cap is not None
        return self._sat_now - (effective + self._cap) * self._divisor

    def _best_in(
        self, family: _Family, order: _Order, affinity: bool, only: str | None = None
    ) -> _Entry | None:
        """The best waiting request of a family under one ordering; O(log n) at worst:
        one head per source list, plus one per loaded model for the affinity bonus."""
        best: tuple[float, int] | None = None
        winner: _Entry | None = None
        boost = affinity and bool(self._bonus)
        for lists in self._sources(family, order):
            if only is not None:
                lst = lists.by_model.get(only)
                if lst:
                    entry = lst[0][2]
                    key = (self._key(entry, order, boost and only in self._loaded), entry.seq)
                    if best is None or key < best:
                        best, winner = key, entry
                continue
            if lists.all:
                entry = lists.all[0][2]
                key = (self._key(entry, order, False), entry.seq)
                if best is None or key < best:
                    best, winner = key, entry
            if boost:
                # One head lookup per loaded model (one, or a handful with groups).
                for loaded in self._loaded:
                    lst = lists.by_model.get(loaded)
                    if lst:
                        entry = lst[0][2]
                        key = (self._key(entry, order, True), entry.seq)
                        if best is None or key < best:
                            best, winner = key, entry
        return winner

    def _choose(self, order: _Order, affinity: bool, band: Band | None) -> _Entry | None:
        """The pick under one ordering: the best of ``band`` when a band is owed its
        share, else the best of all."""
        if band is not None:
            return self._best_in(self._band_lists[band], order, affinity)
        return self._best_in(self._all, order, affinity)

    def _served_now(self, band: Band, now: float) -> float:
        """GPU seconds the band's picks got since it last had nothing waiting, counting
        the running job (the last pick) up to ``now``."""
        served = self._served[band]
        since = self._busy_since[band]
        if self._last_pick is not None and since is not None:
            at, last_band = self._last_pick
            if last_band is band:
                served += max(0.0, now - max(at, since))
        return served

    def _charge(self, now: float) -> None:
        """The last pick's job ran until this pick: book its GPU time to its band."""
        if self._last_pick is None:
            return
        band = self._last_pick[1]
        if self._busy_since[band] is not None:
            self._served[band] = self._served_now(band, now)
        self._last_pick = None

    def _owed_band(self, now: float) -> Band | None:
        """The band furthest behind its ``bandShare`` (deficit > 0), if any. O(1)."""
        if not self._shared:
            return None
        owed: Band | None = None
        most = 0.0
        for band, deficit in self.share_deficits(now).items():
            if deficit > most:
                owed, most = band, deficit
        return owed

    def _attribution(self, winner: _Entry, band: Band | None) -> frozenset[Term]:
        """The terms whose removal (from every score, or the rule itself) would have
        picked a different request."""
        terms = set()
        order = self._score_order
        if self._aging_on and self._choose(_Order.PLAIN, True, band) is not winner:
            terms.add(Term.AGING)
        if self._bonus and self._loaded and self._choose(order, False, band) is not winner:
            terms.add(Term.SWAP_AFFINITY)
        if self._capped and self._choose(_Order.AGED, True, band) is not winner:
            terms.add(Term.AGING_CAP)
        if band is not None and self._choose(order, True, None) is not winner:
            terms.add(Term.BAND_SHARE)
        return frozenset(terms)

    def _terms(self, entry: _Entry, now: float) -> tuple[float, float, float]:
        """(affinity, aging, score) of one entry at ``now``."""
        affinity = float(self._bonus) if entry.request.model in self._loaded else 0.0
        aging = 0.0
        if self._aging_on:
            aging = max(0.0, now - entry.request.arrival) / self._divisor
            if self._cap is not None and aging > self._cap:
                aging = float(self._cap)
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

    def _order(self, now: float) -> Iterator[_Entry]:
        """All waiting entries in dispatch order (lazy): the owed band's best first when
        a band is behind its share, then score order."""
        first = self._choose(self._score_order, True, self._owed_band(now))
        rest = self._score_ranking()
        if first is None:
            return rest
        return itertools.chain((first,), (e for e in rest if e is not first))

    def _score_ranking(self) -> Iterator[_Entry]:
        order = self._score_order
        sources = self._sources(self._all, order)
        loaded = self._loaded
        boost = bool(self._bonus) and any(loaded.intersection(s.by_model) for s in sources)
        if len(sources) == 1 and not boost:
            return (item[2] for item in sources[0].all)

        def keyed(lst: SortedList, boosted: bool) -> Iterator[_Item]:
            return ((self._key(e, order, boosted), seq, e) for _, seq, e in lst)

        # Merge per-model lists (few) rather than filter the global one, so the first k
        # entries cost O(k log models) however many wait for a loaded model.
        lists: list[Iterator[_Item]] = []
        for source in sources:
            if boost:
                lists += [keyed(lst, model in loaded) for model, lst in source.by_model.items()]
            else:
                lists.append(keyed(source.all, False))
        return (item[2] for item in heapq.merge(*lists, key=lambda i: i[:2]))
