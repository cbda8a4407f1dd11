"""The dashboard's live path: dispatcher events -> coalesced snapshots -> a channel group.

:class:`LiveObserver` is one of the dispatcher's observers. Its callbacks run inside the
dispatcher task, so they only count, remember the decision, and mark the state dirty. Its
own task (``start()``) wakes when something changed, sends at most one snapshot per
``interval`` (10 a second by default, however many requests arrive), and sends one every
``sample_every`` seconds anyway so that waits, aging and elapsed times move, taking a chart
sample each time. Snapshots go to the ``dashboard`` group of the channel layer, which every
:class:`dashboard.consumers.DashboardConsumer` joins.

While no dashboard is open (:func:`watcher_joined` / :func:`watcher_left`, counted by the
consumers of this process) no snapshot is built or sent: the task only takes its chart
sample every ``sample_every`` seconds. Building one walks the first ``waiting_cap`` waiting
requests and their estimates; under load that work used to land between jobs, the GPU idle
meanwhile (BENCHMARKS.md, "Dispatch gap at the model"). A dashboard that opens gets a full
snapshot at once (:func:`current_snapshot`) and updates from then on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from channels.layers import get_channel_layer

from dashboard.snapshot import (
    TERMS,
    WAITING_CAP,
    Sample,
    access_block,
    build_snapshot,
    decision_record,
    empty_snapshot,
    lane_rows,
    sample,
)
from scheduler.core.policy import SchedulerSettings
from scheduler.core.priority import BANDS, Band
from scheduler.process import ModelState

if TYPE_CHECKING:
    from scheduler.dispatcher import Dispatcher, Ticket
    from scheduler.runtime import Runtime

log = logging.getLogger("llamaswap.dashboard")

GROUP = "dashboard"
EVENT_TYPE = "dashboard.update"

_current: LiveObserver | None = None
_watchers = 0
"""Open dashboards (websockets in the group) in this process."""


def watcher_joined() -> None:
    """A dashboard joined the group: updates are built and sent from now on."""
    global _watchers
    _watchers += 1
    live = _current
    if live is not None:
        live._touch()


def watcher_left() -> None:
    global _watchers
    _watchers = max(0, _watchers - 1)


def current() -> LiveObserver | None:
    """The live observer of the scheduler running in this process, if any."""
    return _current


def current_snapshot() -> dict[str, Any]:
    live = _current
    if live is None or live.dispatcher is None:
        return empty_snapshot(time.time())
    return live.snapshot(full=True)


class LiveObserver:
    def __init__(
        self,
        *,
        interval: float = 0.1,
        sample_every: float = 1.0,
        history: int = 600,
        decisions: int = 50,
        waiting_cap: int = WAITING_CAP,
        group: str = GROUP,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.interval = interval
        self.sample_every = sample_every
        self.waiting_cap = waiting_cap
        self.group = group
        self.dispatcher: Dispatcher | None = None
        self.runtime: Runtime | None = None
        """The server watched (its reloads and keys), when started for one."""
        self.decisions: deque[dict[str, Any]] = deque(maxlen=decisions)
        self.dispatched: dict[Band, int] = dict.fromkeys(BANDS, 0)
        self.reorders = {band: dict.fromkeys(TERMS, 0) for band in BANDS}
        self.samples: deque[Sample] = deque(maxlen=history)
        self.settings_since: float | None = None
        self.started_at: float | None = None
        """When the counters started (Unix seconds): they count since the server started."""
        self.model: tuple[str | None, ModelState] = (None, ModelState.STOPPED)
        self.sent = 0
        """Snapshots sent to the group (tests use it to check coalescing)."""
        self._wall = wall_clock
        self._dirty = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    # -- the dispatcher's side: cheap, synchronous ------------------------------------------

    def on_enqueue(self, ticket: Ticket) -> None:
        self._touch()

    def on_dispatch(self, ticket: Ticket) -> None:
        d = ticket.decision
        if d is not None:
            self.dispatched[d.band] += 1
            for term in d.reordered_by:
                self.reorders[d.band][term] += 1
            self.decisions.append(decision_record(ticket))
        self._touch()

    def on_finish(self, ticket: Ticket) -> None:
        self._touch()

    def on_model_state(self, model: str, state: ModelState) -> None:
        # The dispatcher has no process object while a swap runs; the events say
        # which model is starting or stopping.
        self.model = (model, state)
        self._touch()

    def on_settings(self, settings: SchedulerSettings, source: str) -> None:
        self.settings_since = self._wall()
        self._touch()

    def _touch(self) -> None:
        self._dirty = True
        if self._wake is not None and _watchers:
            self._wake.set()

    # -- the snapshot ------------------------------------------------------------------

    def snapshot(self, full: bool = True) -> dict[str, Any]:
        """The state now. ``full``: every chart sample (on connect); else the newest."""
        dispatcher = self.dispatcher
        assert dispatcher is not None, "start() first"
        now = dispatcher.now()
        queue = dispatcher.queue
        model, state = self.model
        samples = list(self.samples) if full else list(self.samples)[-1:]
        return build_snapshot(
            now=now,
            wall=self._wall(),
            bands=queue.band_stats(now),
            waiting=queue.peek(now, self.waiting_cap),
            depth=len(queue),
            running=dispatcher.in_flight(),
            model=model,
            model_state=state.value,
            decisions=self.decisions,
            dispatched=self.dispatched,
            reorders=self.reorders,
            settings=dispatcher.settings,
            settings_source=dispatcher.settings_source,
            settings_since=self.settings_since,
            samples=samples,
            waiting_cap=self.waiting_cap,
            kind="snapshot" if full else "update",
            lanes=lane_rows(dispatcher.lanes()),
            lane_of=queue.lane_for,
            config_status=_config_status(self.runtime),
            estimates={
                rid: eta for rid, (_, _, eta) in dispatcher.waiting(self.waiting_cap).items()
            },
            advice=_advice(),
            started_at=self.started_at,
            access=access_now(self.runtime),
        )

    def take_sample(self) -> None:
        dispatcher = self.dispatcher
        assert dispatcher is not None
        self.samples.append(sample(self._wall(), dispatcher.queue.band_stats(dispatcher.now())))

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, dispatcher: Dispatcher | None = None, rt: Runtime | None = None) -> None:
        """Watch ``dispatcher`` (``rt``'s; the server's installed in this process when
        both are None: ``serve`` starts its observers so) and start sending; the snapshot
        tells ``rt``'s config reloads and API keys."""
        global _current
        if dispatcher is None:
            if rt is None:
                from scheduler import runtime

                rt = runtime.current()  # the composition's start: no request at hand
            dispatcher = rt.dispatcher
        self.runtime = rt
        self.dispatcher = dispatcher
        self.started_at = self._wall()
        self.model = dispatcher.model_state()
        if self.settings_since is None:
            self.settings_since = self._wall()
        self._wake = asyncio.Event()
        self.take_sample()
        _current = self
        self._task = asyncio.get_running_loop().create_task(self._run(), name="dashboard-live")

    async def stop(self) -> None:
        global _current
        if _current is self:
            _current = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        assert self._wake is not None
        wake = self._wake
        layer = get_channel_layer()
        loop = asyncio.get_running_loop()
        last_send = float("-inf")
        last_sample = loop.time()
        while True:
            try:
                async with asyncio.timeout(max(0.0, last_sample + self.sample_every - loop.time())):
                    await wake.wait()
            except TimeoutError:
                pass
            if not _watchers:  # nobody to send to: keep the charts' history only
                wake.clear()
                if loop.time() - last_sample >= self.sample_every:
                    last_sample = loop.time()
                    try:
                        self.take_sample()
                    except Exception:
                        log.exception("dashboard sample failed")
                continue
            # Coalesce: whatever happens during the pause goes out in one snapshot.
            pause = last_send + self.interval - loop.time()
            if pause > 0:
                await asyncio.sleep(pause)
            wake.clear()
            self._dirty = False
            try:
                if loop.time() - last_sample >= self.sample_every:
                    self.take_sample()
                    last_sample = loop.time()
                snapshot = self.snapshot(full=False)
                if layer is not None:
                    await layer.group_send(self.group, {"type": EVENT_TYPE, "snapshot": snapshot})
                self.sent += 1
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("dashboard update failed")
            last_send = loop.time()


def _config_status(rt: Runtime | None) -> dict[str, Any] | None:
    """The last config reload's outcome (``llamaswap_site.reload``), when serving."""
    if rt is None:
        return None
    reloader = rt.reloader
    return reloader.status.as_dict() if reloader is not None else None


def access_now(rt: Runtime | None) -> dict[str, Any] | None:
    """Open or keyed, from the key ring of the server ``rt`` (memory only, no query; None
    when no server runs in this process)."""
    if rt is None:
        return None
    ring = rt.keys
    return access_block(keyed=ring.enabled, keys=len(ring.names()))


def _advice() -> dict[str, Any] | None:
    """The advisor's last word (``dashboard.whatif``), if it has one: cached, no query."""
    from dashboard.whatif import latest_advice

    advice = latest_advice()
    if advice is None:
        return None
    return {"message": advice.message, "changes": advice.changes}
