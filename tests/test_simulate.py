"""The trace simulator: hand-made traces whose outcome the spec fixes, and the command."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from scheduler.core.policy import SchedulerSettings, Term
from scheduler.core.priority import Band, band_of
from scheduler.core.simulate import (
    TraceError,
    TraceRequest,
    format_duration,
    format_table,
    generate_trace,
    load_trace,
    parse_overrides,
    simulate,
)

DEFAULTS = SchedulerSettings()
NO_LOAD = {"A": 0.0, "B": 0.0}


def req(rid: str, arrival: float, model: str, priority: int, service: float) -> TraceRequest:
    return TraceRequest(rid, arrival, model, priority, service)


def order(result) -> list[str]:
    return [d.request_id for d in result.dispatches]


def waits(result) -> dict[str, float]:
    return {d.request_id: d.wait for d in result.dispatches}


# -- dispatch order on hand-made traces ------------------------------------------------


def test_interactive_waits_out_the_running_job_then_goes_first():
    # Non-preemptive: a long job holds the GPU; batch, normal and interactive arrive
    # while it runs and go in priority order when it ends. The interactive request
    # still waited (almost) one full job duration, as the spec warns.
    trace = [
        req("long", 0, "A", 0, 1000),
        req("batch", 1, "A", -100, 10),
        req("normal", 2, "A", 0, 10),
        req("inter", 3, "A", 100, 10),
    ]
    result = simulate(trace, DEFAULTS, {"A": 10.0})
    assert order(result) == ["long", "inter", "normal", "batch"]
    # long: cold load 10 + 1000 -> ends 1010; then 10 s each.
    assert waits(result) == {"long": 0, "inter": 1007, "normal": 1018, "batch": 1029}
    assert result.swaps == 1  # the first cold load counts; the rest run on model A
    assert result.makespan == 1040
    assert result.busy == 1040
    assert result.busy_share == 1.0
    assert result.reordered_aging == result.reordered_affinity == 0
    assert result.bands[Band.INTERACTIVE].wait_max == 1007
    assert result.bands[Band.BATCH].requests == 1


def test_arrival_at_the_completion_instant_competes_for_that_dispatch():
    trace = [
        req("first", 0, "A", 0, 10),
        req("normal", 5, "A", 0, 10),
        req("inter", 10, "A", 100, 10),  # arrives exactly when "first" ends
    ]
    result = simulate(trace, DEFAULTS, NO_LOAD)
    assert order(result) == ["first", "inter", "normal"]
    assert waits(result)["inter"] == 0


def test_idle_gpu_dispatches_at_arrival_and_counts_idle_time():
    trace = [req("a", 0, "A", 0, 10), req("b", 100, "A", 0, 10)]
    result = simulate(trace, DEFAULTS, {"A": 5.0})
    assert [d.start for d in result.dispatches] == [0, 100]
    assert result.swaps == 1  # b finds A still loaded
    assert result.makespan == 110
    assert result.busy == 25
    assert result.busy_share == pytest.approx(25 / 110)


@pytest.mark.parametrize(
    ("bonus", "expected_order", "swaps", "affinity_reorders"),
    [
        # Bonus 10: z needs no swap and jumps y (same priority, arrived earlier);
        # the two B requests then run together.
        (10, ["x", "z", "y", "w"], 2, 1),
        # Bonus 0: strict arrival order; A and B alternate, a swap each time.
        (0, ["x", "y", "z", "w"], 4, 0),
    ],
)
def test_swap_affinity_keeps_same_model_jobs_together(
    bonus, expected_order, swaps, affinity_reorders
):
    trace = [
        req("x", 0, "A", 0, 100),
        req("y", 1, "B", 0, 10),
        req("z", 2, "A", 0, 10),
        req("w", 3, "B", 0, 10),
    ]
    settings = SchedulerSettings.create(swap_affinity_bonus=bonus)
    result = simulate(trace, settings, {"A": 5.0, "B": 5.0})
    assert order(result) == expected_order
    assert result.swaps == swaps
    assert result.reordered_affinity == affinity_reorders
    assert [d.swap for d in result.dispatches].count(True) == swaps


@pytest.mark.parametrize(
    ("divisor", "normal_arrival", "first"),
    [
        # Default divisor 60: batch (-100) overtakes normal after 100 minutes of
        # waiting longer than it: 6001 s is past the crossover, 5999 s is not.
        (60, 6002, "batch"),
        (60, 6000, "normal"),
        # A small divisor makes the crossover come after 100 s.
        (1, 102, "batch"),
        (1, 100, "normal"),
        # 0 disables aging: strict priority, batch never overtakes.
        (0, 9000, "normal"),
    ],
)
def test_aging_lets_batch_overtake_normal(divisor, normal_arrival, first):
    trace = [
        req("long", 0, "A", 0, 10_000),
        req("batch", 1, "A", -100, 10),
        req("normal", normal_arrival, "A", 0, 10),
    ]
    settings = SchedulerSettings.create(aging_divisor=divisor)
    result = simulate(trace, settings, NO_LOAD)
    assert order(result)[1] == first
    batch_first = first == "batch"
    assert result.dispatches[1].reordered_by == (
        frozenset({Term.AGING}) if batch_first else frozenset()
    )
    assert result.reordered_aging == int(batch_first)


def test_fifo_policy_ignores_aging_and_affinity():
    trace = [
        req("long", 0, "A", 0, 10_000),
        req("batch", 1, "A", -100, 10),
        req("y", 2, "B", 0, 10),
        req("z", 3, "A", 0, 10),
    ]
    result = simulate(trace, parse_overrides(["use=fifo"]), NO_LOAD)
    assert order(result) == ["long", "y", "z", "batch"]
    assert result.reordered_aging == result.reordered_affinity == 0


def test_default_load_applies_to_unnamed_models():
    trace = [req("a", 0, "A", 0, 10), req("b", 0, "B", 0, 10)]
    result = simulate(trace, DEFAULTS, {"A": 1.0}, default_load=7.0)
    assert [d.finish for d in result.dispatches] == [11, 28]


def test_empty_trace():
    result = simulate([], DEFAULTS)
    assert result.requests == result.swaps == 0
    assert result.makespan == result.busy_share == 0
    assert "all requests" in format_table([result])


# -- traces ----------------------------------------------------------------------------


def test_load_trace_parses_aliases_ints_and_sorts_by_arrival():
    lines = [
        '{"arrival": 5, "model": "A", "priority": "interactive", "service": 1, "id": "x"}',
        "",
        '{"arrival": 1.5, "model": "B", "priority": -98, "service": 2}',
        '{"arrival": 3, "model": "A", "priority": " Batch ", "service": 0}',
        '{"arrival": 3, "model": "A", "priority": "+7", "service": 0, "id": 9}',
        '{"arrival": 4, "model": "A", "priority": "soon", "service": 0}',  # header rules: 0
        '{"arrival": 4, "model": "A", "service": 0}',  # absent: 0
    ]
    trace = load_trace(lines)
    assert [(r.request_id, r.arrival, r.priority) for r in trace] == [
        ("line3", 1.5, -98),
        ("line4", 3.0, -100),
        ("9", 3.0, 7),
        ("line6", 4.0, 0),
        ("line7", 4.0, 0),
        ("x", 5.0, 100),
    ]


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"arrival": 1, "priority": 0, "service": 1}', "'model'"),
        ('{"arrival": 1, "model": "", "priority": 0, "service": 1}', "'model'"),
        ('{"model": "A", "priority": 0, "service": 1}', "missing 'arrival'"),
        ('{"arrival": "soon", "model": "A", "service": 1}', "'arrival'"),
        ('{"arrival": true, "model": "A", "service": 1}', "'arrival'"),
        ('{"arrival": 1, "model": "A", "service": -1}', "'service'"),
        ('{"arrival": 1, "model": "A", "service": 1e999}', "'service'"),
        ('{"arrival": 1, "model": "A", "priority": 1.5, "service": 1}', "'priority'"),
        ('{"arrival": 1, "model": "A", "priority": null, "service": 1, "id": "ok"}', None),
        ('{"arrival": 1, "model": "A", "service": 1, "id": "a"}', "duplicate id 'a'"),
    ],
)
def test_bad_trace_line_names_the_line(bad, problem):
    lines = ['{"arrival": 0, "model": "A", "priority": 0, "service": 1, "id": "a"}', "", bad]
    if problem is None:
        assert len(load_trace(lines)) == 2
        return
    with pytest.raises(TraceError) as exc:
        load_trace(lines)
    assert exc.value.line == 3
    assert str(exc.value).startswith("line 3: ")
    assert problem in str(exc.value)


def test_generator_is_deterministic_for_a_seed():
    assert generate_trace(500, seed=7) == generate_trace(500, seed=7)
    assert generate_trace(500, seed=7) != generate_trace(500, seed=8)


def test_generator_has_all_bands_several_models_and_a_batch_flood():
    trace = generate_trace(1000, seed=3)
    assert len(trace) == 1000
    assert trace == sorted(trace, key=lambda r: r.arrival)
    assert len({r.request_id for r in trace}) == 1000
    bands = {band: [r for r in trace if band_of(r.priority) is band] for band in Band}
    assert all(bands.values())
    batch = bands[Band.BATCH]
    assert len(batch) == 200  # one flood of 200 ...
    assert max(r.arrival for r in batch) - min(r.arrival for r in batch) <= 300  # ... at once
    assert all(60 <= r.service <= 900 for r in batch)
    assert all(1 <= r.service <= 10 for r in bands[Band.INTERACTIVE])
    assert all(5 <= r.service <= 60 for r in bands[Band.NORMAL])
    assert {r.model for r in trace} == {"qwen3", "llama3", "flux"}


def test_generator_scales_the_flood_for_large_traces():
    trace = generate_trace(3000, seed=1)
    assert sum(band_of(r.priority) is Band.BATCH for r in trace) == 600  # three floods of 200


def test_ten_thousand_requests_replay_serially():
    trace = generate_trace(10_000, seed=5)
    result = simulate(trace, DEFAULTS, {"qwen3": 15, "llama3": 30, "flux": 45})
    assert result.requests == len(result.dispatches) == 10_000
    assert len({d.request_id for d in result.dispatches}) == 10_000
    previous_finish = float("-inf")
    for d in result.dispatches:  # one job at a time, never before it arrived
        assert d.start >= d.arrival
        assert d.start >= previous_finish
        previous_finish = d.finish
    assert sum(b.requests for b in result.bands.values()) == 10_000
    assert 0 < result.busy_share <= 1


# -- settings, formatting --------------------------------------------------------------


def test_parse_overrides():
    s = parse_overrides(["agingDivisor=600", "swapAffinityBonus=0"])
    assert (s.aging_divisor, s.swap_affinity_bonus) == (600, 0)
    assert parse_overrides(["agingDivisor=0.5,use=fifo"]).use.value == "fifo"
    assert parse_overrides(["defaults"]) == DEFAULTS


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (4.21, "4.2s"), (187, "3m07s"), (7500, "2h05m"), (97200, "1d03h")],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


# -- the command -----------------------------------------------------------------------


def run(*args: str) -> str:
    out = StringIO()
    call_command("simulate", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "trace.jsonl"
    out = run("--generate", str(path), "--requests", "300", "--seed", "1")
    assert "wrote 300 requests" in out
    assert "--load-seconds qwen3=15 --load-seconds llama3=30 --load-seconds flux=45" in out
    return path


def test_command_end_to_end_table(trace_file):
    out = run(str(trace_file), "--load-seconds", "flux=45", "--default-load-seconds", "10")
    assert "300 requests" in out
    assert "flux=45.0s" in out and "qwen3=10.0s" in out
    for row in ("interactive wait p95", "batch wait max", "swaps (cold loads)", "GPU busy"):
        assert row in out


def test_command_compare_has_a_column_per_variant(trace_file):
    variants = ["defaults", "agingDivisor=0", "agingDivisor=60,swapAffinityBonus=0", "use=fifo"]
    out = run(str(trace_file), "--compare", *variants)
    header = out.splitlines()[1]
    for variant in variants:
        assert variant in header
    assert header.index("defaults") < header.index("use=fifo")


def test_command_json_matches_the_pure_function(trace_file):
    data = json.loads(run(str(trace_file), "--json", "--set", "agingDivisor=600"))
    assert len(data) == 1
    with trace_file.open() as f:
        trace = load_trace(f)
    expected = simulate(trace, parse_overrides(["agingDivisor=600"]))
    assert data[0]["settings"]["agingDivisor"] == 600
    assert data[0]["swaps"] == expected.swaps
    assert data[0]["bands"]["batch"]["requests"] == expected.bands[Band.BATCH].requests
    assert data[0]["reordered"]["aging"] == expected.reordered_aging


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "swapAffinityBonus=500"], "swapAffinityBonus"),
        (["--set", "agingDivisor=-1"], "agingDivisor"),
        (["--set", "use=lifo"], "use"),
        (["--set", "speed=11"], "speed"),
        (["--compare", "defaults", "agingDivisor=x"], "agingDivisor"),
        (["--load-seconds", "flux"], "--load-seconds"),
        (["--load-seconds", "flux=-3"], "--load-seconds"),
    ],
)
def test_command_rejects_bad_settings(trace_file, args, message):
    with pytest.raises(CommandError, match=message):
        run(str(trace_file), *args)


def test_command_bad_trace_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival": 0, "model": "A", "service": 1}\n{"arrival": 1, "model": "A"}\n')
    with pytest.raises(CommandError, match=r"line 2: missing 'service'"):
        run(str(path))


def test_command_needs_a_trace_and_a_readable_file(tmp_path):
    with pytest.raises(CommandError, match="give a trace"):
        run()
    with pytest.raises(CommandError, match="cannot read"):
        run(str(tmp_path / "missing.jsonl"))
