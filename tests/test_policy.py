"""The serial and fifo policies, table by table, as docs/scheduling.md says."""

import math

import pytest

from scheduler.core.policy import Policy, QueuedRequest, SchedulerSettings, SettingsError, Term
from scheduler.core.queue import WaitingQueue


def order(requests, *, loaded=None, now=None, **settings):
    """Dispatch every request (id, model, priority, arrival) and return the ids in order.

    The loaded model stays as given, so affinity applies the same way to every pick.
    """
    queue = WaitingQueue(SchedulerSettings.create(**settings), loaded_model=loaded)
    for request_id, model, priority, arrival in requests:
        queue.add(QueuedRequest(request_id, model, priority, arrival))
    now = now if now is not None else max(r[3] for r in requests)
    picked = []
    while (decision := queue.pick(now)) is not None:
        picked.append(decision.request_id)
    return picked


# -- bands, offsets and the affinity bonus ------------------------------------------


@pytest.mark.parametrize(
    ("requests", "loaded", "settings", "expected"),
    [
        # The tier example: max batch (-98) ahead of pro (-99) and free (-100), all below 0.
        (
            [("free", "m", -100, 0), ("pro", "m", -99, 1), ("max", "m", -98, 2), ("norm", "m", 0, 3)],
            None,
            {},
            ["norm", "max", "pro", "free"],
        ),
        # Offsets break ties inside a band and never cross one: normal free beats batch max.
        (
            [("batch-max", "m", -98, 0), ("normal-free", "m", 0, 1)],
            None,
            {},
            ["normal-free", "batch-max"],
        ),
        # Offset + default bonus (2 + 10) on the loaded model still below the next band up.
        (
            [("normal-max", "a", 2, 0), ("interactive-free", "b", 100, 1)],
            "a",
            {},
            ["interactive-free", "normal-max"],
        ),
        # Batch max on the loaded model with the default bonus stays below normal.
        (
            [("batch-max", "a", -98, 0), ("normal-free", "b", 0, 1)],
            "a",
            {},
            ["normal-free", "batch-max"],
        ),
        # Even the largest bonus (99) never promotes normal over interactive...
        (
            [("normal", "a", 0, 0), ("interactive", "b", 100, 1)],
            "a",
            {"swap_affinity_bonus": 99, "aging_divisor": 0},
            ["interactive", "normal"],
        ),
        # ...nor batch over normal.
        (
            [("batch", "a", -100, 0), ("normal", "b", 0, 1)],
            "a",
            {"swap_affinity_bonus": 99, "aging_divisor": 0},
            ["normal", "batch"],
        ),
        # Affinity breaks a near-tie inside a band: same priority, the loaded model first.
        (
            [("cold", "b", 0, 0), ("warm", "a", 0, 1)],
            "a",
            {},
            ["warm", "cold"],
        ),
        # A small offset loses to the bonus inside a band (2 < 0 + 10).
        (
            [("pro-cold", "b", 2, 0), ("free-warm", "a", 0, 1)],
            "a",
            {},
            ["free-warm", "pro-cold"],
        ),
        # swapAffinityBonus 0 with uniform priorities is exact FIFO, whatever is loaded.
        (
            [("1", "b", 0, 0), ("2", "a", 0, 1), ("3", "b", 0, 2), ("4", "a", 0, 3)],
            "a",
            {"swap_affinity_bonus": 0},
            ["1", "2", "3", "4"],
        ),
        # ...also with aging disabled, and also for batch traffic.
        (
            [("1", "b", -100, 0), ("2", "a", -100, 0), ("3", "c", -100, 0), ("4", "a", -100, 5)],
            "a",
            {"swap_affinity_bonus": 0, "aging_divisor": 0},
            ["1", "2", "3", "4"],
        ),
        # An exact tie between priority + bonus and a higher priority keeps arrival order.
        (
            [("first", "a", 90, 100.005), ("second", "b", 100, 100.005)],
            "a",
            {"aging_divisor": 90},
            ["first", "second"],
        ),
        # Equal scores keep arrival order (same model, same priority, same arrival time).
        (
            [("first", "m", 0, 7), ("second", "m", 0, 7), ("third", "m", 0, 7)],
            "m",
            {},
            ["first", "second", "third"],
        ),
    ],
)
def test_bands_offsets_affinity(requests, loaded, settings, expected):
    assert order(requests, loaded=loaded, **settings) == expected


# -- aging -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("normal_arrives_at", "expected"),
    [
        (0, ["normal", "batch"]),  # both fresh: normal first
        (3600, ["normal", "batch"]),  # an hour of waiting is not enough at divisor 60
        (5999, ["normal", "batch"]),  # batch has waited 5999 s: still behind
        (6000, ["batch", "normal"]),  # 6000 s: -100 + 100 ties 0, and the batch job came first
        (6001, ["batch", "normal"]),  # past 6000 s: batch overtakes normal traffic
    ],
)
def test_batch_overtakes_normal_after_6000_seconds_at_divisor_60(normal_arrives_at, expected):
    requests = [("batch", "m", -100, 0), ("normal", "m", 0, normal_arrives_at)]
    assert order(requests, loaded="m", aging_divisor=60) == expected


@pytest.mark.parametrize(
    ("requests", "loaded", "settings", "expected"),
    [
        # Aging crosses bands on purpose: batch waited 12001 s > interactive's 200-point lead.
        (
            [("batch", "m", -100, 0), ("interactive", "m", 100, 12001)],
            None,
            {"aging_divisor": 60},
            ["batch", "interactive"],
        ),
        # ...and not before.
        (
            [("batch", "m", -100, 0), ("interactive", "m", 100, 11999)],
            None,
            {"aging_divisor": 60},
            ["interactive", "batch"],
        ),
        # A fractional divisor speeds aging up: 0.05 s per point, 100 points in 5 s.
        (
            [("batch", "m", -100, 0), ("normal", "m", 0, 6)],
            None,
            {"aging_divisor": 0.05},
            ["batch", "normal"],
        ),
        (
            [("batch", "m", -100, 0), ("normal", "m", 0, 4)],
            None,
            {"aging_divisor": 0.05},
            ["normal", "batch"],
        ),
        # Divisor 0 disables aging: a day of waiting changes nothing.
        (
            [("batch", "m", -100, 0), ("normal", "m", 0, 86400)],
            None,
            {"aging_divisor": 0},
            ["normal", "batch"],
        ),
        # Aging and affinity add up: the bonus is worth 10 minutes of waiting at divisor 60.
        (
            [("cold-old", "b", 0, 0), ("warm-new", "a", 0, 599)],
            "a",
            {"aging_divisor": 60, "swap_affinity_bonus": 10},
            ["warm-new", "cold-old"],
        ),
        (
            [("cold-old", "b", 0, 0), ("warm-new", "a", 0, 601)],
            "a",
            {"aging_divisor": 60, "swap_affinity_bonus": 10},
            ["cold-old", "warm-new"],
        ),
    ],
)
def test_aging(requests, loaded, settings, expected):
    assert order(requests, loaded=loaded, **settings) == expected


# -- fifo --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requests", "fifo_priority", "expected"),
    [
        # A model at 10 with a batch header queues at -90: behind a plain normal request.
        ([("a-batch", "a", -100, 0), ("b-normal", "b", 0, 1)], {"a": 10}, ["b-normal", "a-batch"]),
        # The model priority lifts its requests: a=10 ahead of b=0 at equal headers.
        ([("b", "b", 0, 0), ("a", "a", 0, 1)], {"a": 10}, ["a", "b"]),
        # Header and model priority add: b (0+50) ahead of a (10+0).
        ([("a", "a", 0, 0), ("b", "b", 50, 1)], {"a": 10}, ["b", "a"]),
        # Arrival order among equals; no aging however long they waited.
        ([("1", "a", 0, 0), ("2", "b", 0, 1), ("3", "a", 0, 99999)], {}, ["1", "2", "3"]),
        # A negative model priority.
        ([("a", "a", 0, 0), ("b", "b", 0, 1)], {"a": -5}, ["b", "a"]),
    ],
)
def test_fifo_order(requests, fifo_priority, expected):
    assert order(requests, loaded="a", use="fifo", fifo_priority=fifo_priority) == expected


def test_fifo_decision_reports_its_queue_priority_and_no_terms():
    queue = WaitingQueue(SchedulerSettings.create(use="fifo", fifo_priority={"a": 10}), "b")
    queue.add(QueuedRequest("r1", "a", -100, 0.0))
    decision = queue.pick(now=30.0)
    assert decision.policy is Policy.FIFO
    assert decision.fifo_priority == -90
    assert (decision.score, decision.aging, decision.affinity) == (-90, 0, 0)
    assert decision.reordered_by == frozenset()
    assert decision.queue_wait == 30.0
    assert decision.needs_swap


# -- the decision record and attribution ---------------------------------------------


def test_decision_explains_the_pick():
    queue = WaitingQueue(SchedulerSettings.create(aging_divisor=60, swap_affinity_bonus=10), "a")
    queue.add(QueuedRequest("cold", "b", 0, 0.0))
    queue.add(QueuedRequest("warm", "a", 0, 60.0))
    decision = queue.pick(now=120.0)
    assert decision.request_id == "warm"
    assert decision.model == "a"
    assert decision.band == "normal"
    assert decision.affinity == 10
    assert math.isclose(decision.aging, 1.0)
    assert math.isclose(decision.score, 11.0)
    assert decision.queue_wait == 60.0
    assert decision.reordered_by == {Term.SWAP_AFFINITY}
    assert decision.runner_up_id == "cold"
    assert math.isclose(decision.runner_up_score, 2.0)
    assert not decision.needs_swap
    assert decision.waiting_after == 1


@pytest.mark.parametrize(
    ("requests", "loaded", "expected_first", "expected_terms"),
    [
        # Plain priority decides: no term changed the pick.
        ([("n", "a", 0, 0), ("i", "b", 100, 1)], "a", "i", set()),
        # Aging alone: the old batch job would lose without aging.
        ([("old", "b", -100, 0), ("new", "b", 0, 7000)], "b", "old", {Term.AGING}),
        # Affinity alone: same priority, the loaded model's later request goes first.
        ([("cold", "b", 0, 0), ("warm", "a", 0, 1)], "a", "warm", {Term.SWAP_AFFINITY}),
        # warm = 5 + 10 + 600/60 = 25 beats cold-old = 0 + 1200/60 = 20 only with its bonus;
        # without aging warm (15) still beats new (5) and cold-old (0): affinity alone.
        (
            [("cold-old", "b", 0, 0), ("warm", "a", 5, 600), ("new", "c", 5, 1200)],
            "a",
            "warm",
            {Term.SWAP_AFFINITY},
        ),
        # Aging changes the pick from 'new' (priority 5) to 'old' (0 + 1200/60 = 20); nothing
        # of the loaded model waits, so affinity changes nothing.
        ([("old", "b", 0, 0), ("new", "b", 5, 1200)], "a", "old", {Term.AGING}),
        # Both terms needed: warm-old wins only with its bonus and its age.
        (
            [("warm-old", "a", 0, 0), ("cold-new", "b", 15, 600)],
            "a",
            "warm-old",
            {Term.AGING, Term.SWAP_AFFINITY},
        ),
    ],
)
def test_reorder_attribution(requests, loaded, expected_first, expected_terms):
    queue = WaitingQueue(SchedulerSettings.create(aging_divisor=60, swap_affinity_bonus=10), loaded)
    for request_id, model, priority, arrival in requests:
        queue.add(QueuedRequest(request_id, model, priority, arrival))
    decision = queue.pick(now=max(r[3] for r in requests))
    assert decision.request_id == expected_first
    assert decision.reordered_by == expected_terms


# -- settings validation ------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"swap_affinity_bonus": -1}, "routing.scheduler.settings.serial.swapAffinityBonus"),
        ({"swap_affinity_bonus": 100}, "routing.scheduler.settings.serial.swapAffinityBonus"),
        ({"swap_affinity_bonus": 10.5}, "routing.scheduler.settings.serial.swapAffinityBonus"),
        ({"swap_affinity_bonus": "10"}, "routing.scheduler.settings.serial.swapAffinityBonus"),
        ({"swap_affinity_bonus": True}, "routing.scheduler.settings.serial.swapAffinityBonus"),
        ({"aging_divisor": -0.5}, "routing.scheduler.settings.serial.agingDivisor"),
        ({"aging_divisor": "60"}, "routing.scheduler.settings.serial.agingDivisor"),
        ({"aging_divisor": float("nan")}, "routing.scheduler.settings.serial.agingDivisor"),
        ({"aging_divisor": float("inf")}, "routing.scheduler.settings.serial.agingDivisor"),
        ({"aging_divisor": None}, "routing.scheduler.settings.serial.agingDivisor"),
        ({"use": "lifo"}, "routing.scheduler.use"),
        ({"fifo_priority": {"a": "high"}}, "routing.scheduler.settings.fifo.priority.a"),
        ({"fifo_priority": {"a": 1.5}}, "routing.scheduler.settings.fifo.priority.a"),
        ({"fifo_priority": ["a"]}, "routing.scheduler.settings.fifo.priority"),
    ],
)
def test_invalid_settings_name_the_key_and_value(changes, key):
    with pytest.raises(SettingsError) as error:
        SchedulerSettings.create(**changes)
    assert error.value.key == key
    value = next(iter(changes.values()))
    if isinstance(value, dict):
        value = value["a"]
    assert repr(value) in str(error.value)


@pytest.mark.parametrize(
    "changes",
    [
        {"swap_affinity_bonus": 0},  # disables affinity
        {"swap_affinity_bonus": 99},  # the largest bonus
        {"aging_divisor": 0},  # disables aging
        {"aging_divisor": 0.05},  # fractional divisors for short test setups
        {"aging_divisor": 600},
        {"use": "fifo", "fifo_priority": {"a": 10, "b": -3}},
    ],
)
def test_valid_settings(changes):
    settings = SchedulerSettings.create(**changes)
    assert settings.with_changes() == settings


def test_settings_change_applies_to_the_next_pick():
    queue = WaitingQueue(SchedulerSettings.create(aging_divisor=60, swap_affinity_bonus=10), "a")
    queue.add(QueuedRequest("cold", "b", 0, 0.0))
    queue.add(QueuedRequest("warm", "a", 0, 1.0))
    queue.add(QueuedRequest("warm2", "a", 0, 2.0))
    assert queue.pick(3.0).request_id == "warm"
    queue.set_settings(queue.settings.with_changes(swap_affinity_bonus=0))
    assert queue.pick(3.0).request_id == "cold"


def test_cancelled_request_is_never_picked():
    queue = WaitingQueue(SchedulerSettings.create(), None)
    queue.add(QueuedRequest("gone", "a", 100, 0.0))
    queue.add(QueuedRequest("stays", "a", 0, 1.0))
    assert queue.cancel("gone").request_id == "gone"
    assert queue.cancel("gone") is None
    assert queue.pick(2.0).request_id == "stays"
    assert queue.pick(2.0) is None


def test_band_stats_always_report_three_bands():
    queue = WaitingQueue(SchedulerSettings.create(), None)
    queue.add(QueuedRequest("b1", "a", -100, 10.0))
    queue.add(QueuedRequest("b2", "a", -100, 20.0))
    stats = queue.band_stats(now=25.0)
    assert {b.value: (s.depth, s.oldest_wait) for b, s in stats.items()} == {
        "interactive": (0, 0.0),
        "normal": (0, 0.0),
        "batch": (2, 15.0),
    }
    queue.cancel("b1")
    assert queue.band_stats(now=25.0)[next(iter(stats))].depth == 0
    assert queue.band_stats(now=25.0)["batch"].oldest_wait == 5.0


def test_peek_shows_the_dispatch_order_with_score_parts():
    queue = WaitingQueue(SchedulerSettings.create(aging_divisor=60, swap_affinity_bonus=10), "a")
    queue.add(QueuedRequest("cold", "b", 0, 0.0))
    queue.add(QueuedRequest("warm", "a", 0, 60.0))
    queue.add(QueuedRequest("vip", "b", 100, 60.0))
    ranked = queue.peek(now=120.0)
    assert [r.request.request_id for r in ranked] == ["vip", "warm", "cold"]
    assert [(r.affinity, r.aging) for r in ranked] == [(0, 1.0), (10, 1.0), (0, 2.0)]
    assert [r.request.request_id for r in queue.peek(now=120.0, limit=2)] == ["vip", "warm"]
