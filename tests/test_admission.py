"""The admission strategies, driven by hand through the pure machine.

Each test plays events into :class:`scheduler.core.machine.Machine` (the same strategies
the dispatcher runs) and reads the effects it records: who gets a turn, which model starts
and what it evicts, who is refused and why. No asyncio, no clock: milliseconds.
"""

from __future__ import annotations

import pytest

from scheduler.core.admission import (
    Abort,
    Dispatch,
    ModelRules,
    Refusal,
    Refuse,
    Rules,
    Start,
    Stop,
)
from scheduler.core.machine import Grant, Machine, MachineEffect
from scheduler.core.policy import QueuedRequest, SchedulerSettings
from scheduler.core.swapper import Group, GroupSwapper, MatrixSwapper

SERIAL = SchedulerSettings()
FIFO = SchedulerSettings.create(use="fifo")


class Recorder:
    """The effects fake: runs the machine and writes down what it asks for."""

    def __init__(self, machine: Machine) -> None:
        self.m = machine
        self.log: list[MachineEffect] = []

    def take(self, effects: list[MachineEffect]) -> list[MachineEffect]:
        self.log += effects
        return effects

    def arrive(self, now: float, rid: str, model: str, priority: int = 0) -> list[MachineEffect]:
        effects = self.take(self.m.arrive(now, QueuedRequest(rid, model, priority, now)))
        return effects + self.decide(now)

    def decide(self, now: float) -> list[MachineEffect]:
        return self.take(self.m.decide(now))

    def ready(self, now: float, model: str, lane: str = "default") -> list[MachineEffect]:
        return self.take(self.m.ready(now, lane, model)) + self.decide(now)

    def finish(self, now: float, rid: str, completed: bool = True) -> list[MachineEffect]:
        return self.take(self.m.finish(now, rid, completed)) + self.decide(now)

    def tick(self, now: float) -> list[MachineEffect]:
        return self.take(self.m.tick(now)) + self.decide(now)


def machine(settings=SERIAL, lanes=None, **rules) -> Recorder:
    lane_of = lanes or {}
    return Recorder(Machine(settings, Rules(**rules), lane_of, sorted(set(lane_of.values()))))


def turns(effects) -> list[str]:
    return [e.decision.request_id for e in effects if isinstance(e, Dispatch)]


def grants(effects) -> list[str]:
    return [e.request_id for e in effects if isinstance(e, Grant)]


def starts(effects) -> list[tuple[str, tuple[str, ...]]]:
    return [(e.model, e.evict) for e in effects if isinstance(e, Start)]


def refused(effects) -> list[tuple[str, Refusal]]:
    return [(e.request_id, e.kind) for e in effects if isinstance(e, Refuse)]


# -- serial --------------------------------------------------------------------------------


def test_serial_one_at_a_time_the_swap_is_part_of_the_picked_turn():
    r = machine()
    first = r.arrive(0, "a1", "a")
    assert turns(first) == ["a1"] and starts(first) == [("a", ())] and grants(first) == []
    assert turns(r.arrive(1, "b1", "b", 100)) == []  # the lane is busy: it waits
    assert grants(r.ready(2, "a")) == ["a1"]  # granted once its model is ready
    after = r.finish(3, "a1")
    assert turns(after) == ["b1"] and starts(after) == [("b", ("a",))]  # a goes for b


def test_a_swap_false_group_keeps_its_members_loaded_side_by_side():
    # groups: {pair: {swap: false, members: [a, b]}}: a and b may be loaded together.
    router = GroupSwapper(
        [Group("pair", swap=False, members=("a", "b")), Group("solo", members=("c",))]
    )
    r = machine(evict=router.evict)
    r.arrive(0, "a1", "a")
    r.ready(1, "a")
    r.finish(2, "a1")
    assert starts(r.arrive(3, "b1", "b")) == [("b", ())]  # a stays
    r.ready(4, "b")
    r.finish(5, "b1")
    again = r.arrive(6, "a2", "a")
    assert starts(again) == [] and grants(again) == ["a2"]  # no load: a is still there
    r.finish(7, "a2")
    assert starts(r.arrive(8, "c1", "c")) == [("c", ("a", "b"))]  # exclusive: the pair goes


def test_matrix_evicts_the_least_it_can():
    router = MatrixSwapper.compile({"s": "a & b | c"}, ["a", "b", "c"])
    r = machine(evict=router.evict)
    r.arrive(0, "a1", "a")
    r.ready(1, "a")
    r.finish(2, "a1")
    assert starts(r.arrive(3, "b1", "b")) == [("b", ())]  # a & b fit together
    r.ready(4, "b")
    r.finish(5, "b1")
    assert starts(r.arrive(6, "c1", "c")) == [("c", ("a", "b"))]


def test_slots_admit_the_running_models_best_requests_then_drain_before_a_swap():
    r = machine(models={"m": ModelRules(slots=3)})
    r.arrive(0, "m1", "m")
    assert turns(r.arrive(0.5, "m2", "m")) == ["m2"]  # joins the load
    assert grants(r.ready(1, "m")) == ["m1", "m2"]
    assert turns(r.arrive(2, "n1", "n", 100)) == []  # the lane's best is n1: m admits no more
    assert turns(r.arrive(3, "m3", "m")) == []
    r.finish(4, "m1")
    assert turns(r.finish(5, "m2")) == ["n1"]  # drained, then the swap


def test_two_lanes_run_at_once_and_each_serialises():
    r = machine(lanes={"a": "gpu0", "c": "gpu0", "b": "gpu1"})
    assert turns(r.arrive(0, "a1", "a")) == ["a1"]
    assert turns(r.arrive(0, "b1", "b")) == ["b1"]  # beside a1, on its own GPU
    assert turns(r.arrive(1, "c1", "c")) == []  # behind a1 on gpu0
    assert [e.lane for e in r.log if isinstance(e, Start)] == ["gpu0", "gpu1"]


def test_a_load_nobody_waits_for_settles_before_the_next_pick():
    r = machine()
    r.arrive(0, "a1", "a")
    r.m.finish(0.5, "a1")  # its client left during the load
    assert turns(r.arrive(1, "b1", "b")) == []  # the load in progress settles first
    assert turns(r.ready(2, "a")) == ["b1"]


def test_a_load_whose_waiters_all_left_is_given_up_when_other_work_waits():
    r = machine()
    r.arrive(0, "a1", "a")
    r.arrive(1, "b1", "b")  # waits behind a's load
    left = r.finish(2, "a1", completed=False)
    assert [e for e in left if isinstance(e, Abort)] == [Abort("default", "a")]
    assert turns(left) == []  # the lane is free once the stopped load is gone
    r.m.aborted(2.5, "default", "a")
    after = r.decide(2.5)
    assert turns(after) == ["b1"] and starts(after) == [("b", ())]  # a never became loaded


def test_a_load_is_kept_while_a_request_still_waits_for_it():
    r = machine()
    r.arrive(0, "a1", "a")
    r.arrive(0.5, "a2", "a")
    r.arrive(1, "b1", "b")
    assert not any(isinstance(e, Abort) for e in r.finish(2, "a1", completed=False))
    ready = r.ready(3, "a")  # the load completed: a2 is picked for it (affinity)
    assert turns(ready) == ["a2"] and grants(ready) == ["a2"] and starts(ready) == []


def test_a_resent_turn_restarts_its_dead_model_and_is_granted_again():
    r = machine()
    r.arrive(0, "a1", "a")
    assert grants(r.ready(1, "a")) == ["a1"]
    r.arrive(1.5, "b1", "b")
    resent = r.take(r.m.resend(2, "a1"))
    assert starts(resent) == [("a", ("a",))]  # its dead process among the stopped
    assert r.m.lanes["default"].swapping == "a"
    assert turns(r.decide(2)) == []  # still a1's turn: b1 waits
    assert grants(r.ready(3, "a")) == ["a1"]
    assert r.m.resend(3.5, "b1") == []  # not granted: nothing to resend


def test_a_resent_turn_joins_its_models_load_in_progress():
    r = machine(SchedulerSettings(), models={"a": ModelRules(slots=2)})
    r.arrive(0, "a1", "a")
    r.ready(1, "a")
    r.arrive(1.5, "a2", "a")  # a second slot
    starts_a = r.take(r.m.resend(2, "a1"))
    assert starts(starts_a) == [("a", ("a",))]
    assert r.take(r.m.resend(2.1, "a2")) == []  # joins the restart
    assert sorted(grants(r.ready(3, "a"))) == ["a1", "a2"]


def test_a_reloaded_model_takes_no_new_turn_and_stops_when_its_turns_end():
    r = machine(models={"a": ModelRules(slots=2)})
    r.arrive(0, "a1", "a")
    r.ready(1, "a")
    assert r.take(r.m.reload(2, ["a"])) == []  # a1 still runs on it
    assert turns(r.arrive(3, "a2", "a")) == []  # no second slot on a changed model
    ended = r.finish(4, "a1")
    assert [e for e in ended if isinstance(e, Stop)] == [Stop("default", "a", "reload")]
    assert turns(ended) == ["a2"] and starts(ended) == [("a", ())]  # a fresh start
    assert grants(r.ready(5, "a")) == ["a2"]


def test_reloading_an_idle_model_stops_it_at_once():
    r = machine()
    r.arrive(0, "a1", "a")
    r.ready(1, "a")
    r.finish(2, "a1")
    assert r.take(r.m.reload(3, ["a", "zzz"])) == [Stop("default", "a", "reload")]
    assert r.m.lanes["default"].loaded() == []


# -- fifo ----------------------------------------------------------------------------------


def test_fifo_serves_a_ready_model_at_once_up_to_its_concurrency_limit():
    r = machine(FIFO, models={"a": ModelRules(concurrency_limit=2)})
    r.arrive(0, "1", "a")
    r.ready(1, "a")
    assert grants(r.arrive(2, "2", "a")) == ["2"]  # no waiting for the first
    assert refused(r.arrive(3, "3", "a")) == [("3", Refusal.OVERLOADED)]  # 429
    # A request needing a swap waits; a busy model is never stopped to make room.
    assert turns(r.arrive(4, "b1", "b", 100)) == []
    assert turns(r.finish(5, "1")) == []
    after = r.finish(6, "2")
    assert turns(after) == ["b1"] and starts(after) == [("b", ("a",))]


def test_fifo_without_limits_is_the_queue_order_on_one_gpu():
    # The simulator given no config: fifo is an order, one request at a time.
    r = machine(FIFO, fifo_limits=False)
    r.arrive(0, "1", "a")
    r.ready(1, "a")
    second = r.arrive(2, "2", "a")
    assert refused(second) == [] and turns(second) == []  # it waits for the first
    assert grants(r.finish(3, "1")) == ["2"]


# -- bounds --------------------------------------------------------------------------------


def test_max_queue_depth_refuses_on_arrival():
    r = machine(max_queue_depth=1)
    r.arrive(0, "run", "a")
    assert refused(r.arrive(1, "w1", "a")) == []
    effects = r.arrive(2, "w2", "a")
    assert refused(effects) == [("w2", Refusal.QUEUE_FULL)]
    assert effects[0].retry_after == 1  # nothing measured yet: 1 s per request ahead


def test_max_wait_refuses_the_oldest_of_a_band_at_its_deadline():
    r = machine(max_wait={"batch": 10.0})
    r.arrive(0, "run", "a")
    r.arrive(1, "b1", "a", -100)
    r.arrive(2, "n1", "a", 0)  # normal: unbounded
    assert r.m.deadline() == 11.0
    assert refused(r.tick(10.9)) == []
    assert refused(r.tick(11.0)) == [("b1", Refusal.EXPIRED)]
    assert r.m.deadline() is None


# -- ttl and failed starts ------------------------------------------------------------------


def test_an_idle_model_is_stopped_when_its_ttl_runs_out():
    r = machine(models={"a": ModelRules(ttl=60)})
    r.arrive(0, "a1", "a")
    r.ready(1, "a")
    r.finish(5, "a1")
    assert r.m.deadline() == 65
    assert r.tick(64) == []
    assert r.tick(65) == [Stop("default", "a", "ttl")]
    assert r.m.lanes["default"].loaded() == []


@pytest.mark.parametrize(
    ("cooldown", "at", "refused_at_once"),
    [
        (5.0, 104.9, True),  # within the cool-down: the start's cause, no new start
        (5.0, 105.0, False),  # over: the next request tries the start again
        (0.0, 100.1, False),  # 0 is off: every request tries
    ],
)
def test_a_failed_start_fails_its_waiters_together_then_cools_down(cooldown, at, refused_at_once):
    r = machine(SchedulerSettings().with_changes(start_failure_cooldown=cooldown))
    r.arrive(99, "a1", "a")
    r.arrive(99.5, "a2", "a")
    failed = r.take(r.m.failed(100, "default", "a", "exit code 1"))
    assert refused(failed) == [("a1", Refusal.START_FAILED), ("a2", Refusal.START_FAILED)]
    assert {e.message for e in failed} == {"exit code 1"}
    later = r.arrive(at, "a3", "a")
    if refused_at_once:
        assert refused(later) == [("a3", Refusal.START_FAILED)] and starts(later) == []
    else:
        assert refused(later) == [] and starts(later) == [("a", ())]


def test_an_explicit_load_retries_during_the_cool_down():
    r = machine()
    r.arrive(0, "a1", "a")
    r.take(r.m.failed(1, "default", "a", "boom"))
    preload = r.take(r.m.arrive(2, QueuedRequest("preload-a", "a", 0, 2), preload=True))
    assert preload == [] and starts(r.decide(2)) == [("a", ())]
    r.ready(3, "a")  # it worked: the cool-down is over
    assert refused(r.arrive(4, "a2", "a")) == []
