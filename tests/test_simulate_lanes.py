"""The simulator with lanes and slots: the same rule as the dispatcher, on a virtual clock."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from scheduler.core.policy import SchedulerSettings
from scheduler.core.simulate import (
    GENERATED_LOAD_SECONDS,
    TraceRequest,
    generate_trace,
    simulate,
    simulate_lanes,
)

SETTINGS = SchedulerSettings()


def req(rid, arrival, model, priority=0, service=10.0):
    return TraceRequest(rid, arrival, model, priority, service)


@pytest.mark.parametrize("shape", ["overload", "steady", "bursty"])
def test_one_lane_without_slots_replays_exactly_like_the_serial_simulator(shape):
    trace = generate_trace(600, 1, shape)
    fast = simulate(trace, SETTINGS, GENERATED_LOAD_SECONDS)
    lanes = simulate_lanes(trace, SETTINGS, GENERATED_LOAD_SECONDS, 20.0, None, {}, {})
    assert [(d.request_id, d.start, d.finish, d.swap) for d in lanes.dispatches] == [
        (d.request_id, d.start, d.finish, d.swap) for d in fast.dispatches
    ]
    assert (lanes.swaps, lanes.forced_swaps) == (fast.swaps, fast.forced_swaps)
    assert lanes.busy == pytest.approx(fast.busy)  # summed as intervals, not as costs


def test_two_lanes_run_at_once_and_each_lane_serialises():
    trace = [req("a1", 0, "a"), req("b1", 0, "b"), req("a2", 1, "a"), req("c1", 2, "c", 100)]
    result = simulate(trace, SETTINGS, {"a": 5, "b": 5, "c": 5}, lanes={"a": "gpu0", "c": "gpu0", "b": "gpu1"})
    by = {d.request_id: d for d in result.dispatches}
    assert by["b1"].start == 0 and by["b1"].lane == "gpu1"  # beside a1, not after it
    assert by["a1"].finish == 15  # load 5 + service 10
    # On gpu0, c1 (interactive) goes as soon as a1 ends, before a2; a2 swaps a back.
    assert by["c1"].start == 15 and by["a2"].start == by["c1"].finish
    assert result.lanes == 2 and result.swaps == 4


def test_slots_admit_the_loaded_models_requests_then_drain_before_a_swap():
    trace = [req("m1", 0, "m"), req("m2", 1, "m"), req("n1", 2, "n", 100), req("m3", 3, "m")]
    result = simulate(trace, SETTINGS, {"m": 0, "n": 0}, slots={"m": 4})
    by = {d.request_id: d for d in result.dispatches}
    assert by["m2"].start == 1  # a free slot, and m2 was the lane's best waiting request
    # n1 outranks m3: m admits no more, drains (m1 ends at 10, m2 at 11), n swaps in.
    assert by["n1"].start == 11
    assert by["m3"].start == by["n1"].finish


def test_requests_joining_a_load_start_when_the_model_is_ready():
    trace = [req("m1", 0, "m"), req("m2", 0, "m")]
    result = simulate(trace, SETTINGS, {"m": 30}, slots={"m": 2})
    assert [(d.request_id, d.start, d.finish) for d in result.dispatches] == [("m1", 0, 40), ("m2", 0, 40)]
    assert result.swaps == 1


def test_the_command_takes_lanes_and_slots(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "\n".join(
            [
                '{"id": "a1", "arrival": 0, "model": "a", "priority": 0, "service": 10}',
                '{"id": "b1", "arrival": 0, "model": "b", "priority": 0, "service": 10}',
            ]
        )
    )
    out = StringIO()
    call_command("simulate", str(trace), "--lanes", "gpu0=a", "--lanes", "gpu1=b", "--slots", "a=2", stdout=out)
    assert "lanes: gpu0: a, gpu1: b" in out.getvalue() and "slots: a=2" in out.getvalue()
    for args, message in [
        (["--lanes", "gpu0"], "expected LANE=MODEL"),
        (["--lanes", "gpu0=a", "--lanes", "gpu1=a"], "on lanes 'gpu0' and 'gpu1'"),
        (["--slots", "a=0"], "expected MODEL=N"),
    ]:
        with pytest.raises(CommandError, match=message):
            call_command("simulate", str(trace), *args, stdout=StringIO())


def test_every_swap_is_classified_forced_by_band_or_the_policys_choice():
    trace = [req("a1", 0, "a"), req("b1", 1, "b", 100), req("a2", 1, "a"), req("c1", 2, "c")]
    result = simulate(trace, SETTINGS, {"a": 1, "b": 1, "c": 1})
    # a1 (nothing loaded: forced), b1 (interactive over a's normal a2: by band), a2 (nothing
    # waits for b: forced), c1 (nothing waits for a: forced).
    assert [d.request_id for d in result.dispatches] == ["a1", "b1", "a2", "c1"]
    assert (result.swaps, result.forced_swaps, result.band_swaps) == (4, 3, 1)
    # A same-band pick of another model while the loaded one has work waiting is the
    # policy's choice: affinity 0 takes b1 (it came first) over a2; the default bonus does not.
    trace = [req("a1", 0, "a"), req("b1", 0.5, "b"), req("a2", 1, "a")]
    plain = simulate(trace, SchedulerSettings.create(swap_affinity_bonus=0), {"a": 1, "b": 1})
    assert [d.request_id for d in plain.dispatches] == ["a1", "b1", "a2"]
    assert plain.swaps - plain.forced_swaps - plain.band_swaps == 1
    default = simulate(trace, SETTINGS, {"a": 1, "b": 1})
    assert [d.request_id for d in default.dispatches] == ["a1", "a2", "b1"]
    assert default.swaps - default.forced_swaps - default.band_swaps == 0


def test_the_config_rules_replay_groups_bounds_and_fifo_limits_as_the_server_runs_them():
    # What the simulator used to leave out (issue 20): the router, maxWait, concurrencyLimit.
    from scheduler.core.admission import ModelRules, Refusal, Rules
    from scheduler.core.swapper import Group, GroupSwapper

    trace = [req("a1", 0, "a"), req("b1", 20, "b"), req("a2", 40, "a"), req("b2", 60, "b")]
    one_at_a_time = simulate(trace, SETTINGS, {"a": 5, "b": 5})
    pair = GroupSwapper([Group("pair", swap=False, members=("a", "b"))])
    together = simulate(trace, SETTINGS, {"a": 5, "b": 5}, rules=Rules(evict=pair.evict))
    assert (one_at_a_time.swaps, together.swaps) == (4, 2)  # a and b stay loaded side by side

    waits = [req("run", 0, "a"), req("batch", 1, "a", -100), req("normal", 2, "a")]
    bounded = simulate(waits, SETTINGS, {"a": 0}, rules=Rules(max_wait={"batch": 5.0}))
    assert [d.request_id for d in bounded.dispatches] == ["run", "normal"]
    assert bounded.refused() == {"expired": 1}

    burst = [req(f"r{i}", 0, "a", 0, 10) for i in range(4)]
    limits = Rules(models={"a": ModelRules(concurrency_limit=2)})
    fifo = simulate(burst, SchedulerSettings.create(use="fifo"), {"a": 0}, rules=limits)
    # The first starts the model, the second joins the load; as llama-swap's admission,
    # the limit counts waiting requests too: the rest of the burst is refused (429).
    assert [d.start for d in fifo.dispatches] == [0, 0]
    assert fifo.refused() == {Refusal.OVERLOADED.value: 2}


def test_a_load_whose_client_left_is_given_up_for_the_next_request_as_the_server_does():
    trace = [
        TraceRequest("a1", 0, "a", 0, 10.0, gone=2.0),  # leaves during its 30 s load
        req("b1", 1, "b"),
        req("b2", 50, "b"),
    ]
    result = simulate(trace, SETTINGS, {"a": 30, "b": 5})
    b1 = next(d for d in result.dispatches if d.request_id == "b1")
    assert b1.start == 2.0 and b1.finish == 17.0  # not 30 s later, behind a's load
    assert [d.request_id for d in result.dispatches] == ["a1", "b1", "b2"]
    b2 = result.dispatches[-1]
    assert (b2.start, b2.swap) == (50, False)  # b stayed loaded: a never was
