"""The names a request may use besides model ids and aliases: llama-swap's ``profiles``,
``selectors``, ``peers`` and the aliases ``filters.setParamsByID`` creates.

Two halves:

* **Parsing** lives with the rest of the config: :mod:`scheduler.config.peers` (profiles,
  selectors, peers) and :mod:`scheduler.config.models` (the aliases
  ``filters.setParamsByID`` creates). The values are re-exported here.
* **Resolution** (here) (:func:`route`, :func:`choose_warm`, :func:`choose_spillover`): pure, the
  state of the models and the load of each target come in as arguments. A request's name
  goes through, in llama-swap's order:
  1. the active profile's pin (``profiles.<p>.pins``): the name is replaced by the pin's
     target; an empty target makes the name unknown while the profile is active;
  2. a selector (``selectors.<s>``) picks one of its targets (``pin``, ``warm``,
     ``spillover``);
  3. a local model id or alias (``setParamsByID`` keys included), else a peer model
     (``peer/model``, or the bare ``model`` when exactly one peer lists it).

  Pins do not chain (a pin's target is never looked up in the pins again) and selectors do
  not point at selectors (a load error).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.config import Config, ModelConfig
from scheduler.config.peers import (
    DEFAULT_SPILLOVER,
    STRATEGIES,
    STRATEGY_PIN,
    STRATEGY_SPILLOVER,
    STRATEGY_WARM,
    Peer,
    PeerModel,
    Profile,
    Selector,
)
from scheduler.process import ModelState

__all__ = [
    "DEFAULT_SPILLOVER",
    "STRATEGIES",
    "STRATEGY_PIN",
    "STRATEGY_SPILLOVER",
    "STRATEGY_WARM",
    "Peer",
    "PeerModel",
    "Profile",
    "Route",
    "Selector",
    "Unroutable",
    "choose_spillover",
    "choose_warm",
    "pick_target",
    "route",
    "target_key",
]


# --------------------------------------------------------------------------- resolution


class Unroutable(LookupError):
    """The requested name leads to no model: ``status`` 404, or 503 when a selector has
    no target it can use now. ``why`` says more than "not found" (or is empty)."""

    def __init__(self, requested: str, why: str = "", status: int = 404) -> None:
        self.requested = requested
        self.why = why
        self.status = status
        super().__init__(f"model {requested!r} not found" + (f": {why}" if why else ""))


@dataclass(frozen=True)
class Route:
    """Where a request goes, and how its name got there."""

    requested: str
    """The name the client sent."""
    name: str
    """The name after the profile's pin and the selector: the ``model`` sent on (unless
    ``useModelName`` or the peer's own name replaces it) and the key of
    ``setParamsByID``."""
    model: ModelConfig | None = None
    """The local model that runs it, or None for a peer. With ``peer`` set too: a request
    this node's fleet placed on another node (fleet/placing.py), whose ticket and record
    name this local model from the start (a finished ticket's record is made at once)."""
    peer: PeerModel | None = None
    selector: str = ""
    """The selector that picked ``name``, if any."""
    profile: str = ""
    """The profile whose pin rewrote the name, if any."""


def route(
    config: Config,
    requested: str,
    *,
    profile: str = "",
    states: Mapping[str, ModelState] | None = None,
    load: Callable[[str], int] | None = None,
) -> Route:
    """Resolve a requested name (see the module's docstring). Raises :class:`Unroutable`.

    ``states``: model id -> state (absent: stopped), for ``warm`` and ``spillover``.
    ``load``: a local model id or a peer model's ``peer/model`` -> requests of it waiting
    or running, for ``spillover``. Only a selector asks for either.
    """
    name = requested
    pinned_by = ""
    active = config.profiles.get(profile) if profile else None
    if active is not None and requested in active.pins:
        name = active.pins[requested]
        pinned_by = active.id
        if not name:
            raise Unroutable(requested, f"disabled by the active profile {active.id!r}")
    selector = config.selectors.get(name)
    chosen_by = ""
    if selector is not None:
        chosen_by = selector.id
        picked = pick_target(config, selector, states or {}, load or _no_load)
        if picked is None:
            raise Unroutable(
                requested, f"selector {selector.id!r} has no available spillover target", 503
            )
        name = picked
    model = config.resolve(name)
    if model is not None:
        return Route(requested, name, model=model, selector=chosen_by, profile=pinned_by)
    peer = config.peer_routes.get(name)
    if peer is not None:
        return Route(requested, name, peer=peer, selector=chosen_by, profile=pinned_by)
    raise Unroutable(requested)


def _no_load(_: str) -> int:
    return 0


def target_key(config: Config, target: str) -> tuple[str, bool]:
    """A selector target's model id (local) or ``peer/model`` (remote), and whether local."""
    local = config.resolve(target)
    if local is not None:
        return local.id, True
    peer = config.peer_routes[target]
    return peer.fqn, False


def pick_target(
    config: Config,
    selector: Selector,
    states: Mapping[str, ModelState],
    load: Callable[[str], int],
) -> str | None:
    """The target a selector picks now (as written in its ``targets``); None when a
    ``spillover`` selector has none it can use (every local target is stopping)."""
    if selector.strategy == STRATEGY_WARM:
        keys = [target_key(config, t)[0] for t in selector.targets]
        return selector.targets[choose_warm([states.get(k, ModelState.STOPPED) for k in keys])]
    if selector.strategy == STRATEGY_SPILLOVER:
        slots: list[tuple[ModelState | None, int]] = []
        for target in selector.targets:
            key, local = target_key(config, target)
            slots.append((states.get(key, ModelState.STOPPED) if local else None, load(key)))
        index = choose_spillover(slots, selector.spillover)
        return None if index is None else selector.targets[index]
    return selector.targets[0]  # pin


def choose_warm(states: Sequence[ModelState]) -> int:
    """``warm``: the first target that is ready, else the first one starting, else the
    first (it is cold-started). Pure: the targets' states in target order."""
    for wanted in (ModelState.READY, ModelState.STARTING):
        for i, state in enumerate(states):
            if state is wanted:
                return i
    return 0


def choose_spillover(slots: Sequence[tuple[ModelState | None, int]], spillover: int) -> int | None:
    """``spillover``: which target takes the next request, or None when none can.

    ``slots`` are the targets in order, each ``(state, load)``: ``state`` None for a peer
    model (always available), ``load`` the requests of it waiting or running. A local
    target that is stopping is skipped. A target is *active* when it is loaded or starting,
    or has load; else *cold*. The least-loaded active target (the first of equals) takes
    the request while its load is under ``spillover``; once every active one has
    ``spillover``, the first cold target is started; with none left, the least-loaded
    active one takes it anyway. With nothing active, the first cold target.
    """
    active: list[int] = []
    cold: list[int] = []
    for i, (state, load) in enumerate(slots):
        if state is ModelState.STOPPING:
            continue
        if state in (ModelState.READY, ModelState.STARTING) or load > 0:
            active.append(i)
        else:
            cold.append(i)
    if not active:
        return cold[0] if cold else None
    least = min(active, key=lambda i: slots[i][1])
    if slots[least][1] < spillover or not cold:
        return least
    return cold[0]
