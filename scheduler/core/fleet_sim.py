"""Replay a trace on a fleet of nodes, each its own scheduler, with placement or without.

Pure: no Django, no I/O, no clock; the virtual clock of :mod:`scheduler.core.simulate`
over several :class:`~scheduler.core.machine.Machine` s (one per node, one lane each, the
dispatcher's own strategies). Requests arrive at the nodes in turn (a round-robin load
balancer in front); with ``placement`` each one then goes where
:func:`scheduler.core.placement.place` says it starts soonest, from views of the nodes at
that instant (as fresh as pub/sub makes them, no lag modelled), exactly as a node places
it. Without it, it runs where it arrived. The same trace both ways says what placement
buys before it is deployed: waits per band, swaps (cold loads), requests placed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.core.admission import Abort, Refuse, Rules, Start
from scheduler.core.admission import Dispatch as AdmitDispatch
from scheduler.core.estimate import RunningMeans
from scheduler.core.machine import Grant, Machine, MachineEffect
from scheduler.core.placement import LaneWait, NodeView, lane_waits, place
from scheduler.core.policy import QueuedRequest, SchedulerSettings
from scheduler.core.priority import BANDS
from scheduler.core.simulate import DEFAULT_LOAD_SECONDS, Dispatch, SimResult, summarize
from scheduler.core.traces import TraceRequest

_FINISH, _READY = range(2)


@dataclass(frozen=True)
class FleetResult:
    """A fleet run: the whole fleet's figures, and where requests ran."""

    result: SimResult
    """Waits per band, swaps, makespan over every node (``lane`` is ``node/lane``)."""
    placed: int
    """Requests run on another node than the one they arrived at."""
    per_node: tuple[int, ...]
    """Requests run on each node."""
    refused: int = 0


class _Fleet:
    def __init__(
        self,
        trace: Sequence[TraceRequest],
        settings: SchedulerSettings,
        nodes: int,
        loads: Mapping[str, float],
        default_load: float,
        placement: bool,
    ) -> None:
        self.trace = trace
        self.nodes = nodes
        self.machines = [
            Machine(settings, Rules(models={}, fifo_limits=False), {}, []) for _ in range(nodes)
        ]
        self.means = [RunningMeans() for _ in range(nodes)]
        self.loads = loads
        self.default_load = default_load
        self.placement = placement
        self.models = frozenset(r.model for r in trace)
        self.events: list[tuple[float, int, int, int, str, str]] = []
        self.seq = 0
        self.by_id: dict[str, TraceRequest] = {}
        self.started: list[Dispatch] = []
        self.finishes: dict[str, float] = {}
        self.running: dict[tuple[int, str], set[str]] = {}
        self.ready_at: dict[tuple[int, str], float] = {}
        self.placed = 0
        self.refused = 0
        self.per_node = [0] * nodes

    def push(self, at: float, kind: int, node: int, a: str, b: str = "") -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, kind, self.seq, node, a, b))

    def view(self, k: int, now: float) -> NodeView:
        """Node ``k`` as it would publish itself now (fleet.view.local_view's figures)."""
        machine, means = self.machines[k], self.means[k]
        times = means.times(self.default_load)
        models: dict[str, str] = {}
        lanes: dict[str, LaneWait] = {}
        for name, lane in machine.lanes.items():
            for model in lane.models:
                models[model] = "ready"
            if lane.swapping is not None:
                models[lane.swapping] = "starting"
            left = 0.0
            for rid in self.running.get((k, name), ()):
                finish = self.finishes.get(rid)
                if finish is None:  # waiting for its load
                    finish = self.ready_at.get((k, name), now) + self.by_id[rid].service
                left = max(left, finish - now)
            stats = machine.queues.lane(name).band_stats(now)
            depth = {band: stats[band].depth for band in BANDS if band in stats}
            service = {band: means.band_mean(band) or times.default_service for band in BANDS}
            lanes[name] = LaneWait(
                depth={band.value: n for band, n in depth.items()},
                wait=lane_waits(depth, left, service),
                running=len(self.running.get((k, name), ())),
            )
        return NodeView(
            node=str(k),
            url="sim",
            serves=self.models,
            models=models,
            lane_of={m: machine.queues.lane_for(m) for m in self.models},
            lanes=lanes,
            load_seconds={m: self.loads.get(m, self.default_load) for m in self.models},
            default_load=self.default_load,
            service_seconds=times.default_service,
            heard=now,
        )

    def target(self, entry: int, r: TraceRequest, now: float) -> int:
        if not self.placement or self.nodes == 1:
            return entry
        views = {str(k): self.view(k, now) for k in range(self.nodes)}
        chosen = place(r.model, r.priority, views[str(entry)], views, now)
        return int(chosen.node) if chosen.forward else entry

    def run(self) -> None:
        trace, events, machines = self.trace, self.events, self.machines
        n, i = len(trace), 0
        while i < n or events:
            now = events[0][0] if events else math.inf
            if i < n and trace[i].arrival < now:
                now = trace[i].arrival
            while events and events[0][0] <= now:
                _, kind, _, k, a, b = heapq.heappop(events)
                if kind == _FINISH:
                    lane = machines[k].queues.lane_for(self.by_id[a].model)
                    self.running.get((k, lane), set()).discard(a)
                    self.apply(k, now, machines[k].finish(now, a))
                else:
                    self.apply(k, now, machines[k].ready(now, a, b))
            while i < n and trace[i].arrival <= now:
                r = trace[i]
                entry = i % self.nodes
                i += 1
                self.by_id[r.request_id] = r
                k = self.target(entry, r, now)
                self.placed += k != entry
                request = QueuedRequest(r.request_id, r.model, r.priority, r.arrival)
                self.apply(k, now, machines[k].arrive(now, request))
            for k, machine in enumerate(machines):
                self.apply(k, now, machine.decide(now))

    def apply(self, k: int, now: float, effects: list[MachineEffect]) -> None:
        for effect in effects:
            if isinstance(effect, Grant):
                rid = effect.request_id
                self.finishes[rid] = now + self.by_id[rid].service
                self.push(self.finishes[rid], _FINISH, k, rid)
            elif isinstance(effect, AdmitDispatch):
                d = effect.decision
                job = self.by_id[d.request_id]
                self.running.setdefault((k, effect.lane), set()).add(job.request_id)
                self.means[k].add_service(job.model, job.service, d.band)
                self.per_node[k] += 1
                self.started.append(
                    Dispatch(
                        job.request_id,
                        job.model,
                        d.band,
                        job.arrival,
                        now,
                        math.nan,
                        effect.starts_load,
                        d.reordered_by,
                        f"{k}/{effect.lane}",
                    )
                )
            elif isinstance(effect, Start):
                load = self.loads.get(effect.model, self.default_load)
                self.ready_at[(k, effect.lane)] = now + load
                self.push(now + load, _READY, k, effect.lane, effect.model)
            elif isinstance(effect, Abort):
                self.machines[k].aborted(now, effect.lane, effect.model)
            elif isinstance(effect, Refuse):
                self.refused += 1


def simulate_fleet(
    trace: Sequence[TraceRequest],
    settings: SchedulerSettings,
    nodes: int,
    *,
    placement: bool = True,
    load_seconds: Mapping[str, float] | None = None,
    default_load: float = DEFAULT_LOAD_SECONDS,
    label: str | None = None,
) -> FleetResult:
    """Replay ``trace`` (sorted by arrival) on ``nodes`` nodes of one GPU each."""
    if nodes < 1:
        raise ValueError("a fleet has at least one node")
    fleet = _Fleet(trace, settings, nodes, dict(load_seconds or {}), default_load, placement)
    fleet.run()
    dispatches = [
        Dispatch(
            d.request_id,
            d.model,
            d.band,
            d.arrival,
            d.start,
            fleet.finishes.get(d.request_id, math.nan),
            d.swap,
            d.reordered_by,
            d.lane,
        )
        for d in fleet.started
    ]
    what = label or f"{nodes} nodes, {'placement' if placement else 'where it arrives'}"
    result = summarize(trace, dispatches, settings, label=what, busy=0.0)
    return FleetResult(result, fleet.placed, tuple(fleet.per_node), fleet.refused)
