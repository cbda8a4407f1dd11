"""fifo's ``concurrencyLimit`` counts a model's waiting requests with its served ones, as
llama-swap's admission does: a burst over the limit is refused at once, also while the
model loads (scheduler/core/admission.py, ``FifoStrategy.refuse``)."""

from __future__ import annotations

from scheduler.core.admission import ModelRules, Refusal
from tests.test_admission import FIFO, grants, machine, refused, starts


def test_a_burst_while_the_model_loads_is_cut_at_its_limit():
    r = machine(FIFO, models={"a": ModelRules(concurrency_limit=2)})
    first = r.arrive(0, "1", "a")
    assert starts(first) == [("a", ())]
    assert refused(r.arrive(0.1, "2", "a")) == []  # waits with the first: 2 of 2
    assert refused(r.arrive(0.2, "3", "a")) == [("3", Refusal.OVERLOADED)]  # 429
    assert refused(r.arrive(0.3, "b1", "b")) == []  # another model's own count
    assert sorted(grants(r.ready(1, "a"))) == ["1", "2"]
    # One served ends: room for one more.
    r.finish(2, "1")
    assert refused(r.arrive(3, "4", "a")) == []
    assert refused(r.arrive(3.1, "5", "a")) == [("5", Refusal.OVERLOADED)]


def test_waiting_requests_count_while_the_model_serves():
    r = machine(FIFO, models={"a": ModelRules(concurrency_limit=3)})
    r.arrive(0, "1", "a")
    r.ready(1, "a")
    assert grants(r.arrive(2, "2", "a")) == ["2"]
    assert refused(r.arrive(3, "3", "a")) == []  # 3 of 3
    assert refused(r.arrive(4, "4", "a")) == [("4", Refusal.OVERLOADED)]
