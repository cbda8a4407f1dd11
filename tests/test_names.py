"""profiles, selectors, peers and setParamsByID aliases: the pure rules (scheduler/names.py).

Strategies as tables (the targets' states and loads in, the pick out), resolution in
llama-swap's order (pin, selector, local, peer), and the load errors, each naming its key.
"""

from __future__ import annotations

import textwrap

import pytest
import yaml

from scheduler.config import ConfigError, parse_config
from scheduler.names import Unroutable, choose_spillover, choose_warm, route
from scheduler.process import ModelState

READY, STARTING, STOPPING, STOPPED = (
    ModelState.READY,
    ModelState.STARTING,
    ModelState.STOPPING,
    ModelState.STOPPED,
)
PEER = None  # a peer model's slot has no state


def parse(text: str, environ: dict[str, str] | None = None):
    return parse_config(yaml.safe_load(textwrap.dedent(text)), environ=environ or {})


# --------------------------------------------------------------------------- strategies


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([STOPPED, STOPPED], 0),  # nothing warm: cold-start the first
        ([STOPPED, READY], 1),  # the loaded one, not the first
        ([READY, READY], 0),  # the first of the loaded
        ([STARTING, STOPPED], 0),
        ([STOPPED, STARTING], 1),  # one already starting beats a cold start
        ([STARTING, READY], 1),  # ready beats starting
        ([STOPPING, STOPPED], 0),  # stopping is not warm: the first
        ([STOPPED, STOPPING, STARTING], 2),
    ],
)
def test_warm_picks_ready_then_starting_then_the_first(states, expected):
    assert choose_warm(states) == expected


@pytest.mark.parametrize(
    ("slots", "spillover", "expected"),
    [
        # Nothing active: the first cold target.
        ([(STOPPED, 0), (STOPPED, 0)], 1, 0),
        # The active one under its share takes it.
        ([(READY, 0), (STOPPED, 0)], 1, 0),
        ([(READY, 1), (STOPPED, 0)], 2, 0),
        # Full (load == spillover): the next cold target is started.
        ([(READY, 1), (STOPPED, 0)], 1, 1),
        ([(READY, 2), (STOPPED, 0), (STOPPED, 0)], 2, 1),
        # Both active: the least loaded, the first of equals.
        ([(READY, 2), (READY, 1)], 3, 1),
        ([(READY, 1), (READY, 1)], 3, 0),
        # All active and full, none cold: the least loaded anyway.
        ([(READY, 3), (READY, 2)], 1, 1),
        # A stopping target is skipped.
        ([(STOPPING, 0), (STOPPED, 0)], 1, 1),
        ([(STOPPING, 0)], 1, None),
        # Load makes a stopped target active (its requests wait for it).
        ([(STOPPED, 1), (STOPPED, 0)], 2, 0),
        ([(STOPPED, 1), (STOPPED, 0)], 1, 1),
        # A starting one counts as active.
        ([(STARTING, 0), (READY, 0)], 1, 0),
        # Peers: active while they have requests in flight, else cold.
        ([(READY, 1), (PEER, 0)], 1, 1),
        ([(PEER, 0), (READY, 0)], 1, 1),
        ([(PEER, 1), (READY, 1)], 1, 0),
    ],
)
def test_spillover_fills_targets_in_order(slots, spillover, expected):
    assert choose_spillover(slots, spillover) == expected


# --------------------------------------------------------------------------- resolution

CONFIG = """
models:
  local:
    cmd: server --port ${PORT}
    aliases: [local-fast]
    filters:
      setParamsByID:
        "${MODEL_ID}:thinking": {thinking: true}
  other:
    cmd: server --port ${PORT}
peers:
  remote:
    proxy: http://example.com
    models: [peer-model, shared]
  second:
    proxy: https://example.org/api
    models: [shared, only-second]
selectors:
  warm-pool:
    strategy: warm
    targets: [local, other]
  spill:
    strategy: spillover
    targets: [local, remote/peer-model]
    settings: {spillover: 2}
  pinned:
    strategy: pin
    targets: [local:thinking, other]
profiles:
  coding:
    description: Coding profile
    pins:
      direct: local
      alias: local-fast
      variant: local:thinking
      peer: peer-model
      peer-qualified: remote/peer-model
      pool: warm-pool
      disabled-empty: ""
      disabled-null: ~
      local: peer-model
"""


def _route(config, name, profile="", states=None, loads=None):
    loads = loads or {}
    return route(config, name, profile=profile, states=states or {}, load=lambda k: loads.get(k, 0))


@pytest.mark.parametrize(
    ("requested", "name", "local", "peer"),
    [
        ("direct", "local", "local", None),
        ("alias", "local-fast", "local", None),
        ("variant", "local:thinking", "local", None),
        ("peer", "peer-model", None, "remote/peer-model"),
        ("peer-qualified", "remote/peer-model", None, "remote/peer-model"),
        ("local", "peer-model", None, "remote/peer-model"),  # a pin shadows a model id
        ("pool", "local", "local", None),  # a pin may name a selector
        ("other", "other", "other", None),  # not pinned: as without a profile
    ],
)
def test_profile_pins_rewrite_the_name(requested, name, local, peer):
    config = parse(CONFIG)
    target = _route(config, requested, profile="coding")
    assert target.name == name
    assert (target.model.id if target.model else None) == local
    assert (target.peer.fqn if target.peer else None) == peer
    assert target.profile == ("coding" if requested != "other" else "")


@pytest.mark.parametrize("requested", ["disabled-empty", "disabled-null"])
def test_an_empty_pin_disables_the_name(requested):
    config = parse(CONFIG)
    with pytest.raises(Unroutable) as info:
        _route(config, requested, profile="coding")
    assert info.value.status == 404 and "disabled by the active profile 'coding'" in info.value.why


def test_without_the_profile_pins_mean_nothing():
    config = parse(CONFIG)
    assert _route(config, "local").model.id == "local"
    with pytest.raises(Unroutable):
        _route(config, "direct")
    # An unknown profile (say, gone after a reload) is no profile.
    assert _route(config, "local", profile="gone").model.id == "local"


def test_peer_names_full_and_bare():
    config = parse(CONFIG)
    assert _route(config, "remote/shared").peer.fqn == "remote/shared"
    assert _route(config, "second/shared").peer.fqn == "second/shared"
    assert _route(config, "only-second").peer.fqn == "second/only-second"  # one peer has it
    with pytest.raises(Unroutable):
        _route(config, "shared")  # two peers have it: ambiguous, so unknown


def test_set_params_by_id_keys_are_aliases():
    config = parse(CONFIG)
    local = config.models["local"]
    assert local.aliases == ("local-fast", "local:thinking")  # ${MODEL_ID} expanded
    assert local.set_params_by_id == {"local:thinking": {"thinking": True}}
    target = _route(config, "local:thinking")
    assert target.model is local and target.name == "local:thinking"


def test_selectors_resolve_before_anything_queues():
    config = parse(CONFIG)
    assert _route(config, "pinned").name == "local:thinking"
    assert _route(config, "pinned").selector == "pinned"
    # warm: the loaded one.
    assert _route(config, "warm-pool", states={"other": READY}).model.id == "other"
    assert _route(config, "warm-pool").model.id == "local"
    # spillover: the local model up to 2 waiting or running, then the peer.
    spill = {"local": READY}
    assert _route(config, "spill", states=spill, loads={"local": 1}).model.id == "local"
    assert _route(config, "spill", states=spill, loads={"local": 2}).peer.fqn == "remote/peer-model"
    assert (
        _route(config, "spill", states=spill, loads={"local": 3, "remote/peer-model": 4}).model.id
        == "local"  # both full, none cold: the least loaded
    )
    # A stopping local target is skipped; a peer is always available.
    target = _route(config, "spill", states={"local": STOPPING})
    assert target.peer.fqn == "remote/peer-model"


def test_a_spillover_selector_with_no_usable_target_is_a_503():
    config = parse(
        """
        models:
          a: {cmd: "server --port ${PORT}"}
          b: {cmd: "server --port ${PORT}"}
        selectors:
          s: {strategy: spillover, targets: [a, b]}
        """
    )
    with pytest.raises(Unroutable) as info:
        _route(config, "s", states={"a": STOPPING, "b": STOPPING})
    assert info.value.status == 503


# --------------------------------------------------------------------------- load errors

BASE = """
models:
  a:
    cmd: server --port ${PORT}
    aliases: [a-alias]
  b:
    cmd: server --port ${PORT}
"""


@pytest.mark.parametrize(
    ("extra", "key", "message"),
    [
        # profiles
        ("profiles: {old: [a]}", "profiles.old", "legacy list syntax"),
        ("profiles: {p: {pins: {}}}", "profiles.p.pins", "must contain at least one entry"),
        ("profiles: {p: {}}", "profiles.p.pins", "must contain at least one entry"),
        ("profiles: {p: {pins: {x: missing}}}", "profiles.p.pins.x", "references unknown model 'missing'"),
        ("profiles: {p: {pins: {'': a}}}", "profiles.p.pins", "pin names cannot be empty"),
        (
            "peers: {r: {proxy: 'http://x', models: [m]}}\nprofiles: {p: {pins: {r/m: a}}}",
            "profiles.p.pins.r/m",
            "conflicts with the peer model",
        ),
        # selectors
        ("selectors: {a: {strategy: pin, targets: [b]}}", "selectors.a", "name conflicts with model ID"),
        (
            "selectors: {a-alias: {strategy: pin, targets: [b]}}",
            "selectors.a-alias",
            "name conflicts with model alias",
        ),
        ("selectors: {s: {targets: [a]}}", "selectors.s.strategy", "required"),
        ("selectors: {s: {strategy: fastest, targets: [a]}}", "selectors.s.strategy", "unknown strategy 'fastest'"),
        ("selectors: {s: {strategy: pin}}", "selectors.s.targets", "must contain at least one entry"),
        ("selectors: {s: {strategy: pin, targets: [nope]}}", "selectors.s.targets[0]", "references unknown model 'nope'"),
        (
            "selectors: {s: {strategy: pin, targets: [a]}, t: {strategy: pin, targets: [s]}}",
            "selectors.t.targets[0]",
            "selector chaining is not supported",
        ),
        (
            "peers: {r: {proxy: 'http://x', models: [m]}}\nselectors: {s: {strategy: warm, targets: [r/m]}}",
            "selectors.s.targets[0]",
            "must resolve to a local model for strategy 'warm'",
        ),
        (
            "selectors: {s: {strategy: spillover, targets: [a], settings: {spillover: 0}}}",
            "selectors.s.settings.spillover",
            "must be >= 1",
        ),
        (
            "selectors: {s: {strategy: spillover, targets: [a, a-alias]}}",
            "selectors.s.targets[1]",
            "duplicate resolved model 'a'",
        ),
        (
            "peers: {r: {proxy: 'http://x', models: [m]}}\nselectors: {s: {strategy: spillover, targets: [m, r/m]}}",
            "selectors.s.targets[1]",
            "duplicate resolved model 'r/m'",
        ),
        # peers
        ("peers: {r: {models: [m]}}", "peers.r.proxy", "required"),
        ("peers: {r: {proxy: 'ftp://x', models: [m]}}", "peers.r.proxy", "must be an http(s) URL"),
        ("peers: {r: {proxy: 'http://x'}}", "peers.r.models", "peer models can not be empty"),
        ("peers: {r: {proxy: 'http://x', models: [m], timeouts: {connect: -1}}}", "peers.r.timeouts.connect", ">= 0"),
        (
            "peers: {r/x: {proxy: 'http://x', models: [m]}, r: {proxy: 'http://y', models: [x/m]}}",
            "peers.r/x.models[0]",
            "is ambiguous between peers.r model 'x/m' and peers.r/x model 'm'",
        ),
        (
            "models: {r/m: {cmd: 'server --port ${PORT}'}}\npeers: {r: {proxy: 'http://x', models: [m]}}",
            "peers.r.models[0]",
            "also the id of a local model",
        ),
    ],
)
def test_load_errors_name_their_key(extra, key, message):
    text = BASE + extra if not extra.startswith("models:") else extra
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert info.value.key == key, info.value
    assert message in info.value.message, info.value


@pytest.mark.parametrize(
    ("filters", "key", "message"),
    [
        ("{setParamsByID: {b: {x: 1}}}", "models.a.filters.setParamsByID.b", "conflicts with the id of model 'b'"),
        (
            "{setParamsByID: {b-alias: {x: 1}}}",
            "models.a.filters.setParamsByID.b-alias",
            "already an alias of model 'b'",
        ),
        ("{setParamsByID: {'${nope}:x': {x: 1}}}", "models.a.filters.setParamsByID.${nope}:x", "unknown macro"),
        (
            "{setParamsByID: {'${MODEL_ID}:x': {}, 'a:x': {}}}",
            "models.a.filters.setParamsByID",
            "both expand to 'a:x'",
        ),
        ("{setParamsByID: {hi: 3}}", "models.a.filters.setParamsByID.hi", "must be a mapping"),
    ],
)
def test_set_params_by_id_errors_name_their_key(filters, key, message):
    text = f"""
    models:
      a:
        cmd: server --port ${{PORT}}
        filters: {filters}
      b:
        cmd: server --port ${{PORT}}
        aliases: [b-alias]
    """
    with pytest.raises(ConfigError) as info:
        parse(text)
    assert info.value.key == key, info.value
    assert message in info.value.message, info.value


def test_set_params_by_id_on_the_model_id_or_its_own_alias_adds_no_alias():
    config = parse(
        """
        models:
          a:
            cmd: server --port ${PORT}
            aliases: [fast]
            filters:
              setParams: {temperature: 0.5, model: nope}
              setParamsByID:
                a: {temperature: 0.1}
                fast: {temperature: 0.9, model: never}
        """
    )
    model = config.models["a"]
    assert model.aliases == ("fast",)
    assert model.set_params_by_id == {"a": {"temperature": 0.1}, "fast": {"temperature": 0.9}}
    assert model.set_params == {"temperature": 0.5}  # model is protected


def test_peer_defaults_and_filters():
    config = parse(
        """
        models:
          a: {cmd: "server --port ${PORT}"}
        peers:
          openrouter:
            proxy: https://openrouter.ai/api
            apiKey: ${env.OR_KEY}
            models: [z-ai/glm-4.7, z-ai/glm-4.7]
            filters:
              stripParams: "temperature, model"
              setParams: {provider: {sort: price}}
              setParamsByID:
                openrouter/z-ai/glm-4.7: {reasoning: {effort: high}}
            timeouts: {connect: 5}
        """,
        {"OR_KEY": "sk-or-1"},
    )
    peer = config.peers["openrouter"]
    assert peer.models == ("z-ai/glm-4.7",)  # repeats dropped
    assert peer.api_key == "sk-or-1"
    assert peer.strip_params == ("temperature",)
    assert peer.timeouts.response_header == 60 and peer.timeouts.connect == 5
    assert peer.timeouts.idle == 0
    assert set(config.peer_routes) == {"openrouter/z-ai/glm-4.7", "z-ai/glm-4.7"}
    assert config.warnings == ()


def test_a_selector_may_shadow_a_bare_peer_name():
    config = parse(
        """
        models:
          a: {cmd: "server --port ${PORT}"}
        peers:
          remote: {proxy: "http://example.com", models: [remote-model]}
        selectors:
          remote-model: {strategy: spillover, targets: [remote/remote-model]}
        """
    )
    target = _route(config, "remote-model")
    assert target.selector == "remote-model" and target.peer.fqn == "remote/remote-model"


def test_a_local_name_wins_over_a_bare_peer_name():
    config = parse(
        """
        models:
          shared: {cmd: "server --port ${PORT}"}
        peers:
          remote: {proxy: "http://example.com", models: [shared]}
        """
    )
    assert _route(config, "shared").model.id == "shared"
    assert _route(config, "remote/shared").peer.fqn == "remote/shared"
