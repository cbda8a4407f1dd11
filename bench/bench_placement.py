"""What placement costs on the request path: ``python -m bench.bench_placement``.

A fleet node places each request for a local model by reading the fleet's view in memory
(kept current by pub/sub, fleet/node.py) and calling :func:`scheduler.core.placement.place`
(O(nodes)); nothing goes to Redis per request. Timed here per call, for fleets of 3, 10
and 50 nodes with two lanes and a dozen models each, half of them warm: ``place`` alone,
and ``fleet.placing.decide`` (the same with the view's bookkeeping: the pending count).
The target: well under a millisecond.
"""

from __future__ import annotations

import gc
import time

from fleet.view import FleetView
from scheduler.core.placement import LaneWait, NodeView, place

CALLS = 20_000
MODELS = tuple(f"model-{i}" for i in range(12))


def _view(name: str, warm: bool, now: float) -> NodeView:
    lanes = {
        lane: LaneWait(
            depth={"interactive": 1, "normal": 4, "batch": 9},
            wait={"interactive": 2.0, "normal": 9.0, "batch": 40.0},
            running=1,
        )
        for lane in ("gpu0", "gpu1")
    }
    return NodeView(
        node=name,
        url=f"http://{name}:8080",
        serves=frozenset(MODELS),
        models={m: "ready" for m in MODELS[: 6 if warm else 0]},
        lane_of={m: ("gpu0", "gpu1")[i % 2] for i, m in enumerate(MODELS)},
        lanes=lanes,
        load_seconds={m: 12.0 for m in MODELS},
        service_seconds=3.0,
        heard=now,
    )


def _timed(call, calls: int = CALLS) -> list[float]:
    gc.collect()
    gc.disable()
    try:
        samples = []
        for _ in range(calls):
            start = time.perf_counter_ns()
            call()
            samples.append((time.perf_counter_ns() - start) / 1000.0)
        return sorted(samples)
    finally:
        gc.enable()


def _q(samples: list[float], p: float) -> float:
    return samples[min(len(samples) - 1, int(p * len(samples)))]


def _measure(size: int, now: float = 1000.0) -> tuple[list[float], list[float]]:
    fleet = FleetView(here="node-0", degraded=False)
    for i in range(size):
        fleet.update(_view(f"node-{i}", warm=i % 2 == 1, now=now), token="t", seq=1)
    views = fleet.views
    here = views["node-0"]
    place_only = _timed(lambda: place("model-3", 0, here, views, now))

    def decide() -> None:
        placement = place(
            "model-3", 0, here, views, now, degraded=fleet.degraded, pending=fleet.pending
        )
        fleet.sent(placement.node)
        fleet.pending.clear()  # as when the node's next view arrives: the same call each time

    return place_only, _timed(decide)


def main() -> None:
    print("| nodes | place p50 µs | p99 µs | with the view's bookkeeping p50 µs | p99 µs |")
    print("| --: | --: | --: | --: | --: |")
    for size in (3, 10, 50):
        a, b = _measure(size)
        print(
            f"| {size} | {_q(a, 0.5):.1f} | {_q(a, 0.99):.1f} | {_q(b, 0.5):.1f} | {_q(b, 0.99):.1f} |"
        )


if __name__ == "__main__":
    main()
