"""The eviction policy: llama-swap's groups and matrix (scheduler/core/swapper.py).

Pure tables: for a target and the models resident (loaded or loading), which models must
stop first. The cases follow llama-swap's router behaviour (groups: swap, exclusive,
persistent and the non-exclusive quirk; matrix: the DSL, subset semantics, eviction
costs, ties to definition order, a model in no set runs alone).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.core.swapper import (
    DEFAULT_GROUP,
    MAX_COMBINATIONS,
    AllOf,
    AnyOf,
    Expr,
    Group,
    GroupError,
    GroupSwapper,
    MatrixCycleError,
    MatrixError,
    MatrixNameError,
    MatrixSizeError,
    MatrixSwapper,
    MatrixSyntaxError,
    Model,
    SetRef,
    Swapper,
    parse_dsl,
)

# --------------------------------------------------------------------------- groups

GROUPS = GroupSwapper(
    [
        Group("solo", members=("s1", "s2")),  # swap, exclusive (the defaults)
        Group("pair", swap=False, members=("p1", "p2")),  # run together, exclusive
        Group("side", exclusive=False, members=("n1", "n2")),  # swap, not exclusive
        Group("keep", swap=True, exclusive=False, persistent=True, members=("k1", "k2")),
        Group("boss", persistent=True, members=("b1",)),  # exclusive and persistent
        Group(DEFAULT_GROUP, members=("d1", "d2")),
    ]
)


@pytest.mark.parametrize(
    ("target", "resident", "evicted"),
    [
        # Nothing resident: nothing to stop.
        ("s1", [], ()),
        # swap: members of one group take turns.
        ("s2", ["s1"], ("s1",)),
        # swap: false: members run together.
        ("p2", ["p1"], ()),
        # exclusive: a member's start unloads the other groups...
        ("p2", ["p1", "s1", "n1"], ("n1", "s1")),
        ("s1", ["n1", "n2"], ("n1", "n2")),
        # ... but never a persistent one.
        ("s1", ["k1", "b1"], ()),
        ("s1", ["k1", "d1"], ("d1",)),
        # A persistent group still swaps its own members.
        ("k2", ["k1"], ("k1",)),
        ("b1", ["s1", "k1"], ("s1",)),  # persistent and exclusive: unloads the others
        # llama-swap's quirk: a non-exclusive member leaves every other group running,
        # exclusive ones included.
        ("n1", ["s1", "p1", "p2"], ()),
        ("n2", ["n1", "s1"], ("n1",)),  # its own group still swaps
        ("k1", ["s1", "d1"], ()),  # non-exclusive and persistent
        # (default): swap and exclusive, so one model at a time.
        ("d2", ["d1"], ("d1",)),
        ("d1", ["s1", "p1"], ("p1", "s1")),
        ("s1", ["d1"], ("d1",)),
        # A model in no group is in (default).
        ("stray", ["d1", "s1"], ("d1", "s1")),
        ("d1", ["stray"], ("stray",)),
        # The target is never evicted, resident or not; its siblings still are.
        ("s1", ["s1"], ()),
        ("s1", ["s1", "s2"], ("s2",)),
        ("p1", ["p1", "p2"], ()),
        # Sorted, duplicates once, whatever the order given.
        ("d1", ["s1", "p2", "d2", "p2"], ("d2", "p2", "s1")),
    ],
)
def test_group_eviction(target: str, resident: list[str], evicted: tuple[str, ...]) -> None:
    assert GROUPS.evict(target, resident) == evicted


def test_group_defaults_are_llama_swaps() -> None:
    assert Group("g") == Group("g", swap=True, exclusive=True, persistent=False, members=())


def test_default_swapper_runs_one_model_at_a_time() -> None:
    swapper = GroupSwapper.default(["a", "b", "c"])
    assert swapper.kind == "group"
    assert swapper.groups == (Group(DEFAULT_GROUP, members=("a", "b", "c")),)
    assert swapper.evict("a", {"b", "c"}) == ("b", "c")
    assert swapper.evict("b", ["a"]) == ("a",)
    assert swapper.evict("a", ["a"]) == ()


def test_group_of_falls_back_to_default() -> None:
    assert GROUPS.group_of("p1").name == "pair"
    assert GROUPS.group_of("nobody").name == DEFAULT_GROUP
    # Without a configured (default) group, the implicit one swaps and is exclusive.
    bare = GroupSwapper([Group("side", exclusive=False, members=("n",))])
    assert bare.group_of("x") == Group(DEFAULT_GROUP)
    assert bare.evict("x", ["n", "y"]) == ("n", "y")
    assert bare.evict("n", ["x", "y"]) == ()


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        (
            [Group("g1", members=("a",)), Group("g2", members=("b", "a"))],
            "model 'a' is in two groups: 'g1' and 'g2'",
        ),
        ([Group("g", members=("a", "a"))], "model 'a' is listed twice in group 'g'"),
        ([Group("g"), Group("g")], "group 'g' is defined twice"),
    ],
)
def test_group_errors(groups: list[Group], message: str) -> None:
    with pytest.raises(GroupError, match=message):
        GroupSwapper(groups)


# --------------------------------------------------------------------------- matrix DSL


@pytest.mark.parametrize(
    ("text", "tree"),
    [
        ("a", Model("a")),
        ("  qwen3-8b.q4_k_m  ", Model("qwen3-8b.q4_k_m")),
        ("a & b", AllOf((Model("a"), Model("b")))),
        ("a&b&c", AllOf((Model("a"), Model("b"), Model("c")))),
        ("a | b | c", AnyOf((Model("a"), Model("b"), Model("c")))),
        # & binds tighter than |.
        ("a | b & c", AnyOf((Model("a"), AllOf((Model("b"), Model("c")))))),
        ("(a | b) & c", AllOf((AnyOf((Model("a"), Model("b"))), Model("c")))),
        ("((a))", Model("a")),
        ("+llms & v", AllOf((SetRef("llms"), Model("v")))),
        ("a &\n  (+x | b)", AllOf((Model("a"), AnyOf((SetRef("x"), Model("b")))))),
    ],
)
def test_dsl_parses(text: str, tree: Expr) -> None:
    assert parse_dsl(text) == tree


@pytest.mark.parametrize(
    ("text", "message", "column"),
    [
        ("", "empty expression", 0),
        ("   ", "empty expression", 0),
        ("a @ b", "unexpected character '@' at column 3", 3),
        ("qwen3:8b", "unexpected character ':' at column 6", 6),
        ("+", "expected a set name after '+' at column 2", 2),
        ("a & + b", "expected a set name after '+' at column 6", 6),
        ("(a", "missing ')' for the '(' at column 1: got the end of the expression at column 3", 3),
        ("(a | b c", "missing ')' for the '(' at column 1: got 'c' at column 8", 8),
        ("a)", "unexpected ')' at column 2 after a complete expression", 2),
        ("a b", "unexpected 'b' at column 3 after a complete expression", 3),
        ("()", "expected a name, '+set' or '(' at column 2, got ')'", 2),
        ("a &", "expected a name, '+set' or '(' at column 4, got the end of the expression", 4),
        ("a || b", "expected a name, '+set' or '(' at column 4, got '|'", 4),
        ("& a", "expected a name, '+set' or '(' at column 1, got '&'", 1),
    ],
)
def test_dsl_errors(text: str, message: str, column: int) -> None:
    with pytest.raises(MatrixSyntaxError) as info:
        parse_dsl(text)
    assert info.value.message == message
    assert info.value.column == column
    assert isinstance(info.value, ValueError)


# --------------------------------------------------------------------------- matrix compile

MODELS = ("a", "b", "c", "d", "e", "t", "x", "y", "z", "qwen3:8b")


def combos(swapper: MatrixSwapper) -> dict[str, list[set[str]]]:
    return {s.name: [set(c) for c in s.combinations] for s in swapper.sets}


@pytest.mark.parametrize(
    ("sets", "expanded"),
    [
        ({"s": "a"}, {"s": [{"a"}]}),
        ({"s": "a & b"}, {"s": [{"a", "b"}]}),
        ({"s": "a | b | c"}, {"s": [{"a"}, {"b"}, {"c"}]}),
        (
            {"s": "(a | b) & (c | d)"},
            {"s": [{"a", "c"}, {"a", "d"}, {"b", "c"}, {"b", "d"}]},
        ),
        ({"s": "a | b & c"}, {"s": [{"a"}, {"b", "c"}]}),
        # Repeats collapse to their first place.
        ({"s": "a & a"}, {"s": [{"a"}]}),
        ({"s": "a | a & b | a"}, {"s": [{"a"}, {"a", "b"}]}),
        # References inline another set's expression (and come before it).
        (
            {"llms": "a | b | c", "tts": "+llms & d", "mega": "+tts & e"},
            {
                "llms": [{"a"}, {"b"}, {"c"}],
                "tts": [{"a", "d"}, {"b", "d"}, {"c", "d"}],
                "mega": [{"a", "d", "e"}, {"b", "d", "e"}, {"c", "d", "e"}],
            },
        ),
        (
            {"big": "+small & x", "small": "a | b"},
            {"small": [{"a"}, {"b"}], "big": [{"a", "x"}, {"b", "x"}]},
        ),
    ],
)
def test_matrix_expands_sets(sets: dict[str, str], expanded: dict[str, list[set[str]]]) -> None:
    swapper = MatrixSwapper.compile(sets, MODELS)
    assert combos(swapper) == expanded
    assert list(combos(swapper)) == list(expanded)  # the tie-break order


def test_matrix_vars_name_models() -> None:
    swapper = MatrixSwapper.compile(
        {"s": "q & a | q & (b | +t)", "t": "c"},
        MODELS,
        variables={"q": "qwen3:8b", "a": "d"},  # a var wins over a model id of its name
        evict_costs={"q": 7, "b": 2},
    )
    assert combos(swapper)["s"] == [{"qwen3:8b", "d"}, {"qwen3:8b", "b"}, {"qwen3:8b", "c"}]
    assert swapper.evict_costs == {"qwen3:8b": 7, "b": 2}
    assert (swapper.cost_of("qwen3:8b"), swapper.cost_of("b"), swapper.cost_of("e")) == (7, 2, 1)


@pytest.mark.parametrize(
    ("sets", "variables", "costs", "error", "where", "message"),
    [
        ({}, {}, {}, MatrixError, "sets", "define at least one set"),
        ({"s": ""}, {}, {}, MatrixSyntaxError, "sets.s", "empty expression"),
        ({"s": "a & (b"}, {}, {}, MatrixSyntaxError, "sets.s", "missing ')'"),
        ({"s": "a & nope"}, {}, {}, MatrixNameError, "sets.s", "unknown var or model 'nope'"),
        (
            {"s": "a & coder"},
            {},
            {},
            MatrixNameError,
            "sets.s",
            "'coder' is an alias of model 'b'; sets name vars or model ids",
        ),
        ({"s": "a | +nope"}, {}, {}, MatrixNameError, "sets.s", "'+nope' names no set"),
        (
            {"p": "a | +q", "q": "+r & b", "r": "+p"},
            {},
            {},
            MatrixCycleError,
            "sets.p",
            "sets reference each other in a circle: p -> q -> r -> p",
        ),
        ({"s": "a | +s"}, {}, {}, MatrixCycleError, "sets.s", "circle: s -> s"),
        (
            {"s": "a"},
            {"my_var": "a"},
            {},
            MatrixNameError,
            "vars.my_var",
            "var names are 1 to 32 letters, digits, '-' or '.'",
        ),
        ({"s": "a"}, {"v" * 33: "a"}, {}, MatrixNameError, f"vars.{'v' * 33}", "1 to 32"),
        ({"s": "a"}, {"v": "nope"}, {}, MatrixNameError, "vars.v", "unknown model 'nope'"),
        (
            {"s": "a"},
            {"v": "coder"},
            {},
            MatrixNameError,
            "vars.v",
            "'coder' is an alias of model 'b'; vars name model ids",
        ),
        ({"s": "a"}, {}, {"a": 0}, MatrixError, "evict_costs.a", "must be a positive integer"),
        ({"s": "a"}, {}, {"a": -3}, MatrixError, "evict_costs.a", "got -3"),
        ({"s": "a"}, {}, {"a": True}, MatrixError, "evict_costs.a", "positive integer"),
        ({"s": "a"}, {}, {"a": 1.5}, MatrixError, "evict_costs.a", "positive integer"),
        ({"s": "a"}, {}, {"nope": 2}, MatrixNameError, "evict_costs.nope", "unknown var"),
        (
            {"s": "a"},
            {"v": "a"},
            {"a": 2, "v": 3},
            MatrixError,
            "evict_costs.v",
            "model 'a' already has a cost (evict_costs.a)",
        ),
    ],
)
def test_matrix_errors(
    sets: dict[str, str],
    variables: dict[str, str],
    costs: dict[str, int],
    error: type[MatrixError],
    where: str,
    message: str,
) -> None:
    with pytest.raises(error) as info:
        MatrixSwapper.compile(sets, MODELS, variables, costs, aliases={"coder": "b"})
    assert info.value.where == where
    assert message in info.value.message


def test_matrix_set_defined_twice() -> None:
    with pytest.raises(MatrixError) as info:
        MatrixSwapper.compile([("s", "a"), ("s", "b")], MODELS)
    assert (info.value.where, info.value.message) == ("sets.s", "set 's' is defined twice")


def test_matrix_expansion_is_bounded() -> None:
    # 10 choices in each of 5 slots: 100,000 combinations.
    models = [f"m{i}{j}" for i in range(5) for j in range(10)]
    slots = [" | ".join(f"m{i}{j}" for j in range(10)) for i in range(5)]
    with pytest.raises(MatrixSizeError) as info:
        MatrixSwapper.compile({"huge": " & ".join(f"({s})" for s in slots)}, models)
    assert info.value.where == "sets.huge"
    assert f"more than {MAX_COMBINATIONS} combinations" in info.value.message
    # Four slots (10,000) are fine.
    fine = MatrixSwapper.compile({"big": " & ".join(f"({s})" for s in slots[:4])}, models)
    assert len(fine.sets[0].combinations) == 10_000
    assert fine.evict("m00", ["m11", "m29", "m35", "m42"]) == ("m42",)


# --------------------------------------------------------------------------- matrix solving


@pytest.mark.parametrize(
    ("sets", "costs", "target", "resident", "evicted"),
    [
        # Two models that never share a set: one evicts the other.
        ({"sa": "a", "sb": "b"}, {}, "b", ["a"], ("a",)),
        # Models in one set run together.
        ({"ab": "a & b"}, {}, "b", ["a"], ()),
        # A set allows its subsets: a, b of "a & b & c" run without c.
        ({"abc": "a & b & c"}, {}, "a", ["b"], ()),
        ({"abc": "a & b & c"}, {}, "c", ["a", "b"], ()),
        # Resident models in no set with the target go.
        ({"ab": "a & b"}, {}, "a", ["b", "z"], ("z",)),
        # A model in no set runs alone.
        ({"ab": "a & b"}, {}, "z", ["a", "b"], ("a", "b")),
        ({"ab": "a & b"}, {}, "z", [], ()),
        # A resident target evicts nothing (llama-swap forwards at once).
        ({"sa": "a", "sb": "b"}, {}, "a", ["a", "b"], ()),
        # The cheapest set wins: keeping y and z (one eviction) beats keeping x (two).
        ({"tx": "t & x", "tyz": "t & y & z"}, {}, "t", ["x", "y", "z"], ("x",)),
        # Costs steer it: x is dear to lose.
        ({"tx": "t & x", "tyz": "t & y & z"}, {"x": 3}, "t", ["x", "y", "z"], ("y", "z")),
        ({"ac": "a & c", "ab": "a & b"}, {"b": 10}, "a", ["b", "c"], ("c",)),
        # Equal costs: the first set in definition order wins.
        ({"ac": "a & c", "ab": "a & b"}, {}, "a", ["b", "c"], ("b",)),
        ({"ab": "a & b", "ac": "a & c"}, {}, "a", ["b", "c"], ("c",)),
        # ... and within a set, the first alternative.
        ({"s": "t & (a | b)"}, {}, "t", ["a", "b"], ("b",)),
        ({"s": "t & (b | a)"}, {}, "t", ["a", "b"], ("a",)),
        # ... except that a referenced set comes before the set using it (llama-swap's
        # topological order): "second" is tried before "first".
        ({"first": "t & a | +second", "second": "t & b"}, {}, "t", ["a", "b"], ("a",)),
        # A referenced set's models count as the set's own.
        ({"base": "a & b", "ext": "t & +base & b"}, {}, "t", ["a", "b"], ()),
        # A dominated alternative does not hide the better one.
        ({"s": "t & (a | (a & b))"}, {}, "t", ["a", "b"], ()),
        # Costs of models outside every set count too.
        ({"ta": "t & a", "tb": "t & b"}, {"a": 2, "b": 2}, "t", ["a", "b"], ("b",)),
    ],
)
def test_matrix_eviction(
    sets: dict[str, str],
    costs: dict[str, int],
    target: str,
    resident: list[str],
    evicted: tuple[str, ...],
) -> None:
    swapper = MatrixSwapper.compile(sets, MODELS, evict_costs=costs)
    assert swapper.evict(target, resident) == evicted
    assert swapper.evict(target, list(reversed(resident))) == evicted


def test_matrix_decision_says_why() -> None:
    swapper = MatrixSwapper.compile(
        {"chat": "g | q", "voice": "+chat & v", "solo": "big"},
        ["g", "q", "v", "big", "stray"],
        evict_costs={"v": 50},
    )
    assert swapper.kind == "matrix"
    assert [s.name for s in swapper.sets] == ["chat", "voice", "solo"]
    decision = swapper.solve("q", ["g", "v"])  # keep the dear TTS, swap the LLM
    assert (decision.evict, decision.set_name, decision.cost) == (("g",), "voice", 1)
    assert decision.models == {"q", "v"}
    decision = swapper.solve("big", ["g", "v"])
    assert (decision.evict, decision.set_name, decision.cost) == (("g", "v"), "solo", 51)
    decision = swapper.solve("stray", ["q"])  # in no set: alone
    assert (decision.evict, decision.set_name, decision.models) == (("q",), None, {"stray"})
    decision = swapper.solve("q", ["q", "v"])  # resident: nothing to do
    assert (decision.evict, decision.set_name) == ((), "voice")


# --------------------------------------------------------------------------- properties

NAMES = ["a", "b", "c", "d", "t"]


@st.composite
def expressions(draw: st.DrawFn, depth: int = 2) -> str:
    if depth == 0 or draw(st.booleans()):
        return draw(st.sampled_from(NAMES))
    parts = draw(st.lists(expressions(depth=depth - 1), min_size=2, max_size=3))
    return "(" + draw(st.sampled_from([" & ", " | "])).join(parts) + ")"


@given(
    sets=st.lists(expressions(), min_size=1, max_size=3),
    costs=st.dictionaries(st.sampled_from(NAMES), st.integers(1, 5)),
    target=st.sampled_from([*NAMES, "z"]),
    resident=st.sets(st.sampled_from([*NAMES, "z"])),
)
def test_matrix_evicts_the_least_it_can(
    sets: list[str], costs: dict[str, int], target: str, resident: set[str]
) -> None:
    swapper = MatrixSwapper.compile(
        [(f"s{i}", text) for i, text in enumerate(sets)], [*NAMES, "z"], evict_costs=costs
    )
    evicted = swapper.evict(target, resident)
    assert target not in evicted
    assert set(evicted) <= resident
    assert list(evicted) == sorted(evicted)
    if target in resident:
        assert evicted == ()
        return
    allowed = [c for s in swapper.sets for c in s.combinations if target in c]
    if not allowed:
        assert set(evicted) == resident
        return
    # What stays fits one combination, and no combination is cheaper.
    assert any((resident - set(evicted)) | {target} <= c for c in allowed)
    cheapest = min(sum(costs.get(m, 1) for m in resident - c) for c in allowed)
    assert sum(costs.get(m, 1) for m in evicted) == cheapest


@given(
    layout=st.lists(st.sampled_from(["g1", "g2", "g3", None]), min_size=6, max_size=6),
    flags=st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=3, max_size=3),
    target=st.integers(0, 5),
    resident=st.sets(st.integers(0, 5)),
)
def test_group_eviction_rules(
    layout: list[str | None],
    flags: list[tuple[bool, bool, bool]],
    target: int,
    resident: set[int],
) -> None:
    models = [f"m{i}" for i in range(6)]
    groups = [
        Group(
            name,
            swap=swap,
            exclusive=exclusive,
            persistent=persistent,
            members=tuple(m for m, g in zip(models, layout, strict=True) if g == name),
        )
        for name, (swap, exclusive, persistent) in zip(["g1", "g2", "g3"], flags, strict=True)
    ]
    swapper: Swapper = GroupSwapper(groups)
    by_name = {g.name: g for g in groups}
    default = Group(DEFAULT_GROUP)

    def group(i: int) -> Group:
        name = layout[i]
        return default if name is None else by_name[name]

    evicted = set(swapper.evict(models[target], [models[i] for i in resident]))
    for i in resident - {target}:
        same = group(i) == group(target)
        expected = (
            group(target).swap if same else (group(target).exclusive and not group(i).persistent)
        )
        assert (models[i] in evicted) == expected
    assert models[target] not in evicted


def test_swappers_satisfy_the_protocol() -> None:
    swappers: list[Swapper] = [
        GroupSwapper.default(["a"]),
        MatrixSwapper.compile({"s": "a"}, ["a"]),
    ]
    assert [s.kind for s in swappers] == ["group", "matrix"]
    for swapper, (target, resident) in itertools.product(swappers, [("a", ["b"])]):
        assert swapper.evict(target, resident) == ("b",)
