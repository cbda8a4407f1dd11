"""config.yaml -> Config.router, Config.lanes and ModelConfig.slots.

llama-swap's groups and matrix (``routing.router`` and the legacy top-level ``groups:`` /
``matrix:``) with its load errors, each naming its key; our lanes
(``routing.scheduler.settings.serial.lanes``) and per-model ``slots``.
"""

from __future__ import annotations

import textwrap
from typing import Any

import pytest
import yaml

from scheduler.config import DEFAULT_LANE, Config, ConfigError, parse_config
from scheduler.core.swapper import DEFAULT_GROUP, Group, GroupSwapper, MatrixSwapper

MODELS = """
models:
  llama:
    cmd: server --port ${PORT}
    aliases: [chat]
  qwen:
    cmd: server --port ${PORT}
  embed:
    cmd: server --port ${PORT}
  tts:
    cmd: server --port ${PORT}
"""
ALL = ("llama", "qwen", "embed", "tts")


def parse(top: str, models: str = MODELS) -> Config:
    text = textwrap.dedent(top) + textwrap.dedent(models)
    return parse_config(yaml.safe_load(text), environ={})


def error_of(top: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(top)
    return info.value


def groups(config: Config) -> list[tuple[str, bool, bool, bool, tuple[str, ...]]]:
    router = config.router
    assert isinstance(router, GroupSwapper)
    return [(g.name, g.swap, g.exclusive, g.persistent, g.members) for g in router.groups]


# --------------------------------------------------------------------------- groups


def test_no_router_is_one_model_at_a_time() -> None:
    config = parse("")
    assert config.router.kind == "group"
    assert groups(config) == [(DEFAULT_GROUP, True, True, False, ALL)]
    assert config.router.evict("qwen", ["llama", "embed"]) == ("embed", "llama")
    assert config.warnings == ()


GROUPS = """
    g1:
      members: [llama, qwen]
    g2:
      swap: false
      exclusive: false
      persistent: true
      members: [embed]
"""


@pytest.mark.parametrize(
    "top",
    [
        "routing:\n  router:\n    use: group\n    settings:\n      groups:"
        + textwrap.indent(textwrap.dedent(GROUPS), "        "),
        # use defaults to group
        "routing:\n  router:\n    settings:\n      groups:"
        + textwrap.indent(textwrap.dedent(GROUPS), "        "),
        "routing:\n  router:\n    use: ''\n    settings:\n      groups:"
        + textwrap.indent(textwrap.dedent(GROUPS), "        "),
        # llama-swap's legacy top-level form
        "groups:" + textwrap.indent(textwrap.dedent(GROUPS), "  "),
    ],
    ids=["routing.router", "use-omitted", "use-empty", "legacy"],
)
def test_groups_forms(top: str) -> None:
    config = parse(top)
    assert groups(config) == [
        ("g1", True, True, False, ("llama", "qwen")),  # llama-swap's defaults
        ("g2", False, False, True, ("embed",)),
        (DEFAULT_GROUP, True, True, False, ("tts",)),  # every model in no group
    ]
    assert config.router.evict("qwen", ["llama", "embed", "tts"]) == ("llama", "tts")
    assert config.warnings == ()


def test_groups_may_hold_every_model() -> None:
    config = parse("groups: {all: {swap: false, members: [llama, qwen, embed, tts]}}")
    assert groups(config) == [("all", False, True, False, ALL)]


def test_empty_legacy_groups_and_null_matrix_are_absent() -> None:
    # llama-swap counts `groups: {}` and `matrix:` as not set, so no conflict either.
    config = parse(
        "groups: {}\nmatrix:\nrouting: {router: {use: matrix, settings: {matrix: {sets: {s: llama}}}}}"
    )
    assert isinstance(config.router, MatrixSwapper)


# --------------------------------------------------------------------------- matrix

MATRIX = """
  vars:
    l: llama
    q: qwen
  evict_costs:
    tts: 50
  sets:
    chat: "l | q"
    voice: "+chat & tts"
    solo: embed
"""


@pytest.mark.parametrize(
    "top",
    [
        "routing:\n  router:\n    use: matrix\n    settings:\n      matrix:"
        + textwrap.indent(textwrap.dedent(MATRIX), "        "),
        "matrix:" + textwrap.indent(textwrap.dedent(MATRIX), "  "),
    ],
    ids=["routing.router", "legacy"],
)
def test_matrix_forms(top: str) -> None:
    config = parse(top)
    router = config.router
    assert isinstance(router, MatrixSwapper)
    assert [(s.name, s.combinations) for s in router.sets] == [
        ("chat", (frozenset({"llama"}), frozenset({"qwen"}))),
        ("voice", (frozenset({"llama", "tts"}), frozenset({"qwen", "tts"}))),
        ("solo", (frozenset({"embed"}),)),
    ]
    assert router.evict_costs == {"tts": 50}
    assert router.evict("qwen", ["llama", "tts"]) == ("llama",)
    assert router.evict("embed", ["llama", "tts"]) == ("llama", "tts")
    assert config.warnings == ()


def test_router_section_not_in_use_warns() -> None:
    config = parse(
        """
        routing:
          router:
            use: matrix
            settings:
              groups: {g: {members: [llama]}}
              matrix: {sets: {s: "llama & qwen"}}
        """
    )
    assert config.router.kind == "matrix"
    assert config.warnings == (
        "routing.router.settings.groups: not used with routing.router.use: matrix; ignored",
    )


# --------------------------------------------------------------------------- load errors

R = "routing.router"
RG = f"{R}.settings.groups"
RM = f"{R}.settings.matrix"


@pytest.mark.parametrize(
    ("top", "key", "message"),
    [
        # A model in two groups (llama-swap: "used in multiple groups").
        (
            "routing: {router: {settings: {groups: {g1: {members: [llama]}, g2: {members: [qwen, llama]}}}}}",
            f"{RG}.g2.members[1]",
            "model 'llama' is in two groups: 'g1' and 'g2'",
        ),
        (
            "groups: {g1: {members: [llama]}, g2: {members: [llama]}}",
            "groups.g2.members[0]",
            "in two groups",
        ),
        ("groups: {g: {members: [qwen, qwen]}}", "groups.g.members[1]", "listed twice"),
        # Members are model ids: unknown ones and aliases are errors.
        ("groups: {g: {members: [nope]}}", "groups.g.members[0]", "unknown model 'nope'"),
        (
            "groups: {g: {members: [chat]}}",
            "groups.g.members[0]",
            "'chat' is an alias of model 'llama'; members are model ids",
        ),
        ("groups: {'(default)': {members: [qwen]}}", "groups.(default)", "rename it"),
        ("groups: {g: {swap: yes please, members: [qwen]}}", "groups.g.swap", "true or false"),
        ("groups: {g: {exclusive: 1}}", "groups.g.exclusive", "true or false"),
        ("groups: {g: {persistent: 'no'}}", "groups.g.persistent", "true or false"),
        ("groups: {g: {members: qwen}}", "groups.g.members", "must be a list"),
        ("groups: {g: [qwen]}", "groups.g", "must be a mapping"),
        ("groups: [qwen]", "groups", "must be a mapping"),
        ("routing: {router: {settings: {groups: [g]}}}", RG, "must be a mapping"),
        # Groups with matrix, and the legacy form with routing.router.
        (
            "groups: {g: {members: [qwen]}}\nmatrix: {sets: {s: qwen}}",
            "matrix",
            "cannot be used together with groups",
        ),
        (
            "groups: {g: {members: [qwen]}}\nrouting: {router: {use: group}}",
            "groups",
            "legacy top-level groups/matrix cannot be used together with routing.router",
        ),
        (
            "matrix: {sets: {s: qwen}}\nrouting: {router: {settings: {matrix: {sets: {s: qwen}}}}}",
            "matrix",
            "move them under routing.router.settings",
        ),
        # use
        ("routing: {router: {use: matrix}}", RM, "required by routing.router.use: matrix"),
        ("routing: {router: {use: Group}}", f"{R}.use", "unknown router 'Group'"),
        ("routing: {router: {use: [group]}}", f"{R}.use", "must be a string"),
        # matrix
        (
            "routing: {router: {use: matrix, settings: {matrix: {}}}}",
            f"{RM}.sets",
            "define at least one set",
        ),
        ("matrix: {}", "matrix.sets", "define at least one set"),
        ("matrix: {sets: [a, b]}", "matrix.sets", "must be a mapping"),
        ("matrix: {sets: {s: 'qwen &'}}", "matrix.sets.s", "column 7"),
        ("matrix: {sets: {s: }}", "matrix.sets.s", "empty expression"),
        ("matrix: {sets: {s: 'qwen & nope'}}", "matrix.sets.s", "unknown var or model 'nope'"),
        (
            "matrix: {sets: {s: 'qwen & chat'}}",
            "matrix.sets.s",
            "'chat' is an alias of model 'llama'",
        ),
        ("matrix: {sets: {s: '+t'}}", "matrix.sets.s", "'+t' names no set"),
        ("matrix: {sets: {s: '+t', t: '+s'}}", "matrix.sets.s", "circle: s -> t -> s"),
        ("matrix: {vars: {q_1: qwen}, sets: {s: qwen}}", "matrix.vars.q_1", "var names are"),
        ("matrix: {vars: {q: nope}, sets: {s: q}}", "matrix.vars.q", "unknown model 'nope'"),
        ("matrix: {vars: {q: 7}, sets: {s: q}}", "matrix.vars.q", "unknown model '7'"),
        ("matrix: {vars: [q], sets: {s: qwen}}", "matrix.vars", "must be a mapping"),
        (
            "matrix: {evict_costs: {qwen: 0}, sets: {s: qwen}}",
            "matrix.evict_costs.qwen",
            "positive integer",
        ),
        (
            "matrix: {evict_costs: {qwen: high}, sets: {s: qwen}}",
            "matrix.evict_costs.qwen",
            "must be an integer",
        ),
        (
            "matrix: {evict_costs: {nope: 2}, sets: {s: qwen}}",
            "matrix.evict_costs.nope",
            "unknown var or model",
        ),
        (
            "routing: {router: {use: matrix, settings: {matrix: {sets: {s: nope}}}}}",
            f"{RM}.sets.s",
            "unknown var or model",
        ),
    ],
)
def test_router_errors_name_the_key(top: str, key: str, message: str) -> None:
    error = error_of(top)
    assert error.key == key
    assert message in error.message


def test_unknown_router_keys_warn() -> None:
    config = parse(
        "routing: {router: {use: group, extra: 1, settings: {groups: {g: {members: [qwen], color: red}}, other: 2}}}"
    )
    assert config.warnings == (
        "routing.router.extra: unknown key; ignored",
        "routing.router.settings.other: unknown key; ignored",
        "routing.router.settings.groups.g.color: unknown key; ignored",
    )


# --------------------------------------------------------------------------- lanes

LANES = "routing.scheduler.settings.serial.lanes"


def lanes_of(config: Config) -> dict[str, tuple[str, ...]]:
    return dict(config.lanes)


def test_one_default_lane_without_lanes() -> None:
    for top in ("", "routing: {scheduler: {settings: {serial: {lanes: {}}}}}"):
        config = parse(top)
        assert lanes_of(config) == {DEFAULT_LANE: ALL}
        assert config.lane_of == dict.fromkeys(ALL, DEFAULT_LANE)


def lanes_config(lanes: str, extra: str = "") -> str:
    return f"routing: {{scheduler: {{settings: {{serial: {{lanes: {lanes}}}}}}}}}\n{extra}"


@pytest.mark.parametrize(
    ("lanes", "extra", "expected"),
    [
        # Named lanes, then the default lane with every other model.
        (
            "{gpu0: [llama], gpu1: [qwen]}",
            "",
            {"gpu0": ("llama",), "gpu1": ("qwen",), DEFAULT_LANE: ("embed", "tts")},
        ),
        # An alias names its model; a model twice on one lane counts once.
        (
            "{gpu0: [chat, llama, qwen]}",
            "",
            {"gpu0": ("llama", "qwen"), DEFAULT_LANE: ("embed", "tts")},
        ),
        # No default lane when every model is on a named one.
        (
            "{a: [llama, qwen], b: [embed, tts]}",
            "",
            {"a": ("llama", "qwen"), "b": ("embed", "tts")},
        ),
        # A group stands for its members.
        (
            "{gpu0: [pair], gpu1: [tts]}",
            "groups: {pair: {swap: false, members: [qwen, llama]}}",
            {"gpu0": ("qwen", "llama"), "gpu1": ("tts",), DEFAULT_LANE: ("embed",)},
        ),
        # ... (default) too: the models in no group.
        (
            "{gpu0: [pair], gpu1: ['(default)']}",
            "groups: {pair: {members: [qwen, llama]}}",
            {"gpu0": ("qwen", "llama"), "gpu1": ("embed", "tts")},
        ),
        # A lane named default gets the models on no lane as well.
        (
            "{default: [tts], gpu1: [qwen]}",
            "",
            {DEFAULT_LANE: ("tts", "llama", "embed"), "gpu1": ("qwen",)},
        ),
    ],
)
def test_lanes(lanes: str, extra: str, expected: dict[str, tuple[str, ...]]) -> None:
    config = parse(lanes_config(lanes, extra))
    assert lanes_of(config) == expected
    assert list(config.lanes) == list(expected)
    assert config.lane_of == {m: lane for lane, ms in expected.items() for m in ms}
    assert config.warnings == ()


@pytest.mark.parametrize(
    ("lanes", "extra", "key", "message"),
    [
        (
            "{gpu0: [llama], gpu1: [qwen, chat]}",
            "",
            f"{LANES}.gpu1[1]",
            "model 'llama' is on two lanes: 'gpu0' and 'gpu1'",
        ),
        (
            "{gpu0: [pair], gpu1: [qwen]}",
            "groups: {pair: {members: [qwen, llama]}}",
            f"{LANES}.gpu1[0]",
            "model 'qwen' is on two lanes: 'gpu0' and 'gpu1'",
        ),
        ("{gpu0: [nope]}", "", f"{LANES}.gpu0[0]", "unknown group, model or alias 'nope'"),
        # Under the matrix there are no groups.
        ("{gpu0: [pair]}", "matrix: {sets: {pair: qwen}}", f"{LANES}.gpu0[0]", "unknown group"),
        ("{gpu0: []}", "", f"{LANES}.gpu0", "must be a non-empty list"),
        ("{gpu0: }", "", f"{LANES}.gpu0", "must be a non-empty list"),
        ("{gpu0: llama}", "", f"{LANES}.gpu0", "must be a non-empty list"),
        ("{gpu0: [{x: 1}]}", "", f"{LANES}.gpu0[0]", "must be a string"),
        ("{'gpu 0': [llama]}", "", f"{LANES}.gpu 0", "a lane name is a letter"),
        ("{0gpu: [llama]}", "", f"{LANES}.0gpu", "a lane name is a letter"),
        ("{" + "g" * 33 + ": [llama]}", "", f"{LANES}.{'g' * 33}", "a lane name is a letter"),
        ("[gpu0]", "", LANES, "must be a mapping"),
        # A group named like a model outside it is ambiguous.
        (
            "{gpu0: [qwen]}",
            "groups: {qwen: {members: [llama]}}",
            f"{LANES}.gpu0[0]",
            "both a group and a model outside it",
        ),
    ],
)
def test_lane_errors(lanes: str, extra: str, key: str, message: str) -> None:
    error = error_of(lanes_config(lanes, extra))
    assert error.key == key
    assert message in error.message


def test_lanes_under_fifo_are_read_too() -> None:
    # fifo does not use them (one queue), but a config that switches back keeps working.
    config = parse(
        "routing: {scheduler: {use: fifo, settings: {serial: {lanes: {gpu0: [llama]}}}}}"
    )
    assert config.lane_of["llama"] == "gpu0"
    assert config.warnings == ()


def test_a_config_built_by_hand_gets_the_defaults() -> None:
    config = parse("")
    bare = Config(models=config.models)
    assert groups(bare) == [(DEFAULT_GROUP, True, True, False, ALL)]
    assert lanes_of(bare) == {DEFAULT_LANE: ALL}
    assert bare.lane_of == dict.fromkeys(ALL, DEFAULT_LANE)


# --------------------------------------------------------------------------- slots


@pytest.mark.parametrize(("setting", "slots"), [("", 1), ("slots: 1", 1), ("slots: 4", 4)])
def test_slots(setting: str, slots: int) -> None:
    config = parse("", f"models:\n  m:\n    cmd: server --port ${{PORT}}\n    {setting}\n")
    assert config.models["m"].slots == slots
    assert config.warnings == ()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0", "must be >= 1, got 0"),
        ("-2", "must be >= 1, got -2"),
        ("'2'", "must be an integer"),
        ("1.5", "must be an integer"),
        ("true", "must be an integer"),
    ],
)
def test_slots_errors(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse("", f"models:\n  m:\n    cmd: server --port ${{PORT}}\n    slots: {value}\n")
    assert info.value.key == "models.m.slots"
    assert message in info.value.message


# --------------------------------------------------------------------------- a real config

# llama-swap's aider example (docs/examples/aider-qwq-coder): a coder and a reasoning
# model, each pinned to its own GPU, kept loaded together; plus our lanes, one per GPU,
# so each GPU serves one request at a time while the other GPU works.
AIDER = """
healthCheckTimeout: 300
logLevel: debug

macros:
  llama-server: /opt/llama.cpp/llama-server --host 127.0.0.1 --flash-attn --slots

models:
  "qwen-coder-32B":
    env:
      - "CUDA_VISIBLE_DEVICES=0"
    aliases:
      - coder
    proxy: "http://127.0.0.1:8999"
    cmd: >
      ${llama-server} --port 8999
      --ctx-size 16000
      --model /models/Qwen2.5-Coder-32B-Instruct-Q4_K_M.gguf
      --model-draft /models/Qwen2.5-Coder-1.5B-Instruct-Q8_0.gguf
      -ngl 99 -ngld 99 --draft-max 16 --draft-min 4
    slots: 2
  "QwQ":
    env:
      - "CUDA_VISIBLE_DEVICES=1"
    proxy: "http://127.0.0.1:9503"
    cmd: >
      ${llama-server} --port 9503
      --model /models/Qwen_QwQ-32B-Q4_K_M.gguf
      --ctx-size 32000 --temp 0.6 -ngl 99
  "small-embed":
    cmd: ${llama-server} --port ${PORT} --embedding --model /models/embed.gguf
    ttl: 300

routing:
  router:
    use: group
    settings:
      groups:
        aider:
          swap: false
          exclusive: true
          members: [qwen-coder-32B, QwQ]
  scheduler:
    use: serial
    settings:
      serial:
        agingDivisor: 60
        lanes:
          gpu0: [coder]
          gpu1: [QwQ, small-embed]
"""


def test_aider_dual_gpu_config_loads_cleanly() -> None:
    config = parse_config(yaml.safe_load(AIDER), environ={})
    assert config.warnings == ()
    assert groups(config) == [
        ("aider", False, True, False, ("qwen-coder-32B", "QwQ")),
        (DEFAULT_GROUP, True, True, False, ("small-embed",)),
    ]
    assert config.models["qwen-coder-32B"].env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert config.models["QwQ"].env == {"CUDA_VISIBLE_DEVICES": "1"}
    assert (config.models["qwen-coder-32B"].slots, config.models["QwQ"].slots) == (2, 1)
    assert dict(config.lanes) == {"gpu0": ("qwen-coder-32B",), "gpu1": ("QwQ", "small-embed")}
    assert config.lane_of == {"qwen-coder-32B": "gpu0", "QwQ": "gpu1", "small-embed": "gpu1"}
    # Both aider models stay loaded together; the embedder swaps them both out.
    router = config.router
    assert router.evict("QwQ", ["qwen-coder-32B"]) == ()
    assert router.evict("small-embed", ["qwen-coder-32B", "QwQ"]) == ("QwQ", "qwen-coder-32B")
    assert router.evict("qwen-coder-32B", ["small-embed"]) == ("small-embed",)


def test_group_objects_are_the_swappers() -> None:
    config = parse("groups: {g: {members: [qwen]}}")
    router: Any = config.router
    assert router.groups[0] == Group("g", members=("qwen",))
