"""The waiting request's estimate as the request page reads it: a range while the running
job is within its usual time, "at least" once it overruns (issue 21: position 1 showed
"est. wait 0.0 s" 39 s into a 150 s render)."""

from __future__ import annotations

import math

import pytest

from scheduler.core.estimate import RunningMeans, WaitEstimator, spreads, wait_range
from scheduler.core.priority import Band


def test_within_usual_time_a_range_around_the_estimate():
    r = wait_range(40.0, spread=10.0, running_usual=20.0, running_elapsed=5.0)
    assert (r.seconds, r.low, r.high, r.at_least, r.overrun) == (40.0, 30.0, 50.0, False, 0.0)


def test_the_range_never_goes_below_zero():
    r = wait_range(3.0, spread=10.0, running_usual=None, running_elapsed=0.0)
    assert (r.low, r.high, r.at_least) == (0.0, 13.0, False)


def test_an_overrunning_job_makes_the_estimate_a_floor():
    # The case: 39 s into a job whose usual time is 20 s, position 1.
    r = wait_range(0.0, spread=5.0, running_usual=20.0, running_elapsed=39.0)
    assert r.at_least and r.high is None
    assert r.low == r.seconds == 0.0
    assert r.overrun == pytest.approx(19.0)


def test_the_estimator_counts_nothing_left_of_an_overrun_and_wait_range_says_so():
    est = WaitEstimator()
    for seconds in (18.0, 20.0, 22.0):
        est.finished("render", Band.BATCH, seconds)
    usual = est.usual("render", Band.BATCH)
    assert usual == pytest.approx(20.0)
    left = est.running_left("render", Band.BATCH, started=0.0, now=39.0)
    assert left == 0.0  # what made the page say 0.0 s
    r = wait_range(left, spread=2.0, running_usual=usual, running_elapsed=39.0)
    assert r.at_least


def test_spread_is_the_sample_standard_deviation():
    means = RunningMeans()
    assert means.spread("m") is None
    means.add_service("m", 10.0)
    assert means.spread("m") is None  # one sample says nothing about the spread
    means.add_service("m", 20.0)
    assert means.spread("m") == pytest.approx(math.sqrt(50.0))
    assert means.samples("m") == 2


def test_spreads_add_variances_in_dispatch_order_and_guess_for_unmeasured_models():
    means = RunningMeans()
    for seconds in (8.0, 12.0):
        means.add_service("a", seconds)
    sd_a = means.spread("a")
    assert sd_a is not None
    assert spreads(["a", "a", "a"], [], means) == pytest.approx([0.0, sd_a, math.sqrt(2) * sd_a])
    # "b" is unmeasured: half the mean over every model (10 s) is its spread.
    assert spreads(["b", "a"], ["a"], means) == pytest.approx([sd_a, math.sqrt(sd_a**2 + 25.0)])
    assert spreads([], ["a"], means) == []
