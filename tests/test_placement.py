"""Placement in a fleet (scheduler/core/placement.py): a request goes where it starts soonest
at its priority; a warm node beats a cold load; ties, small gains and stale or degraded
views keep it here."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler.core.placement import (
    MIN_GAIN_SECONDS,
    MIN_GAIN_SHARE,
    STALE_SECONDS,
    LaneWait,
    NodeView,
    lane_waits,
    place,
)
from scheduler.core.priority import Band, band_of

NOW = 100.0


def node(name, *, loaded=(), wait=0.0, waits=None, load=20.0, heard=NOW, serves=("qwen", "llama")):
    return NodeView(
        node=name,
        url=f"http://{name}:8080",
        serves=frozenset(serves),
        models={m: "ready" for m in loaded},
        lane_of={m: "default" for m in serves},
        lanes={
            "default": LaneWait(wait=waits or {"interactive": wait, "normal": wait, "batch": wait})
        },
        load_seconds={m: load for m in serves},
        service_seconds=2.0,
        heard=heard,
    )


def fleet(*views):
    return {v.node: v for v in views}


def test_a_warm_node_beats_a_cold_load_here():
    here = node("box-a")
    there = node("box-b", loaded=("qwen",), wait=2.0)
    p = place("qwen", 0, here, fleet(here, there), NOW)
    assert p.forward and p.node == "box-b"
    assert p.reason == (
        "sent to box-b: model loaded there, not loaded here, estimated wait 2.0 s against 20 s here"
    )


def test_the_shortest_wait_in_the_requests_band_wins():
    here = node("box-a", loaded=("qwen",), waits={"interactive": 1, "normal": 40, "batch": 90})
    there = node("box-b", loaded=("qwen",), waits={"interactive": 0.5, "normal": 2, "batch": 5})
    assert place("qwen", 0, here, fleet(here, there), NOW).node == "box-b"  # 2 s against 40 s
    assert place("qwen", -100, here, fleet(here, there), NOW).node == "box-b"  # 5 s against 90 s
    # interactive: 1 s here; 0.9 s there saves under a quarter of it: not worth a hop
    close = node("box-b", loaded=("qwen",), wait=0.9)
    assert place("qwen", 100, here, fleet(here, close), NOW).node == "box-a"


def test_no_cold_load_when_a_warm_node_waits_less():
    here = node("box-a")  # idle, cold: 20 s load
    cold = node("box-b")  # idle, cold too
    warm_busy = node("box-c", loaded=("qwen",), wait=8.0)
    p = place("qwen", 0, here, fleet(here, cold, warm_busy), NOW)
    assert p.node == "box-c"


def test_ties_and_small_gains_stay_here():
    here = node("box-a", loaded=("qwen",), wait=4.0)
    assert not place(
        "qwen", 0, here, fleet(here, node("box-b", loaded=("qwen",), wait=4.0)), NOW
    ).forward
    assert not place(
        "qwen", 0, here, fleet(here, node("box-b", loaded=("qwen",), wait=3.5)), NOW
    ).forward
    assert place(
        "qwen", 0, here, fleet(here, node("box-b", loaded=("qwen",), wait=2.0)), NOW
    ).forward


def test_stale_degraded_or_unknown_views_keep_it_here():
    here = node("box-a")
    stale = node("box-b", loaded=("qwen",), heard=NOW - STALE_SECONDS - 0.1)
    assert not place("qwen", 0, here, fleet(here, stale), NOW).forward
    fresh = node("box-b", loaded=("qwen",))
    degraded = place("qwen", 0, here, fleet(here, fresh), NOW, degraded=True)
    assert not degraded.forward and degraded.node == "box-a" and "degraded" in degraded.reason
    assert not place("qwen", 0, None, fleet(fresh), NOW).forward
    # a node that does not serve the model is never chosen
    other = node("box-b", loaded=("llama",), serves=("llama",))
    assert not place("qwen", 0, here, fleet(here, other), NOW).forward


def test_requests_sent_since_a_view_count_against_the_node():
    here = node("box-a", loaded=("qwen",), wait=3.0)
    there = node("box-b", loaded=("qwen",), wait=0.0)
    views = fleet(here, there)
    assert place("qwen", 0, here, views, NOW).node == "box-b"
    # two sent there already (2 s each): 4 s there against 3 s here
    assert place("qwen", 0, here, views, NOW, pending={"box-b": 2}).node == "box-a"


def test_lane_waits_count_the_bands_above_and_its_own():
    service = {Band.INTERACTIVE: 1.0, Band.NORMAL: 10.0, Band.BATCH: 100.0}
    depth = {Band.INTERACTIVE: 2, Band.NORMAL: 3, Band.BATCH: 1}
    assert lane_waits(depth, 5.0, service) == {"interactive": 7.0, "normal": 37.0, "batch": 137.0}


views_st = st.lists(
    st.tuples(
        st.floats(0, 1000, allow_nan=False),
        st.booleans(),
        st.floats(0, 3, allow_nan=False),
    ),
    min_size=1,
    max_size=6,
)


@given(views_st, st.integers(-300, 300))
def test_a_placed_request_starts_sooner_where_it_goes(specs, priority):
    views = [
        node(f"n{i}", loaded=("qwen",) if warm else (), wait=wait, heard=NOW - age)
        for i, (wait, warm, age) in enumerate(specs)
    ]
    here = views[0]
    p = place("qwen", priority, here, fleet(*views), NOW)
    band = band_of(priority)
    here_s = here.start_in("qwen", band)[0]
    if p.forward:
        chosen = fleet(*views)[p.node]
        assert NOW - chosen.heard <= STALE_SECONDS
        assert p.there_seconds == chosen.start_in("qwen", band)[0]
        assert p.there_seconds < here_s
        fresh = [v for v in views[1:] if NOW - v.heard <= STALE_SECONDS]
        assert p.there_seconds == min(v.start_in("qwen", band)[0] for v in fresh)
    else:
        assert p.node == here.node
        fresh = [v for v in views[1:] if NOW - v.heard <= STALE_SECONDS]
        best = min((v.start_in("qwen", band)[0] for v in fresh), default=here_s)
        assert here_s - best <= max(MIN_GAIN_SECONDS, MIN_GAIN_SHARE * here_s)
