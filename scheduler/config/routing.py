"""``routing`` and ``hooks``: the scheduler settings (read through the settings table,
:mod:`scheduler.core.settings`), the router (groups or matrix), lanes, queue bounds and
the models preloaded at start."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from scheduler.config.models import ModelConfig, real_model_id
from scheduler.config.values import (
    ConfigError,
    kind_of,
    or_default,
    read_bool,
    read_int,
    read_mapping,
    read_positive,
    read_string,
    read_string_list,
    warn_unknown,
)
from scheduler.core.lanes import DEFAULT_LANE
from scheduler.core.policy import (
    KEY_FIFO,
    SETTINGS_PREFIX,
    Policy,
    SchedulerSettings,
)
from scheduler.core.priority import BANDS
from scheduler.core.settings import errors as setting_errors
from scheduler.core.settings import from_yaml as settings_from_yaml
from scheduler.core.settings import yaml_keys
from scheduler.core.swapper import (
    DEFAULT_GROUP,
    Group,
    GroupError,
    GroupSwapper,
    MatrixError,
    MatrixSwapper,
    Swapper,
)

_SERIAL = ("settings", "serial")


_FIFO = ("settings", "fifo")


_BOUND_KEYS = frozenset({"maxQueueDepth", "maxWait"})
"""Accepted under both ``routing.scheduler.settings.serial`` and ``.fifo``."""


@dataclass(frozen=True)
class QueueBounds:
    """``maxQueueDepth`` and ``maxWait`` from ``routing.scheduler.settings.serial``/``.fifo``."""

    max_queue_depth: int | None = None
    """Most requests waiting at once; None is unbounded."""
    max_wait: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Band value (``interactive``, ``normal``, ``batch``) -> most seconds a request of that
    band may wait; a band not in it waits unbounded."""


def read_preload(
    value: Any,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    warnings: list[str],
) -> tuple[str, ...]:
    """``hooks.on_startup.preload`` as model ids (aliases resolved, blanks and repeats dropped)."""
    hooks = read_mapping(value, "hooks")
    for name in hooks:
        if name != "on_startup":
            warnings.append(f"hooks.{name}: unknown hook; ignored")
    on_startup = read_mapping(hooks.get("on_startup"), "hooks.on_startup")
    for name in on_startup:
        if name != "preload":
            warnings.append(f"hooks.on_startup.{name}: unknown action; ignored")
    preload: list[str] = []
    names = read_string_list(on_startup.get("preload"), "hooks.on_startup.preload")
    for i, name in enumerate(names):
        name = name.strip()
        if not name:
            continue
        model_id = real_model_id(name, models, aliases)
        if model_id is None:
            raise ConfigError(f"hooks.on_startup.preload[{i}]", f"unknown model {name!r}")
        if model_id not in preload:
            preload.append(model_id)
    return tuple(preload)


def read_scheduler_settings(
    value: Any,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    warnings: list[str],
) -> SchedulerSettings:
    """``routing.scheduler``; ``use`` defaults to serial (llama-swap's default is fifo)."""
    routing = read_mapping(value, "routing")
    warn_unknown(routing, "routing", {"scheduler", "router"}, warnings)
    scheduler = read_mapping(routing.get("scheduler"), SETTINGS_PREFIX)
    warn_unknown(scheduler, SETTINGS_PREFIX, yaml_keys(()), warnings)
    settings = read_mapping(scheduler.get("settings"), f"{SETTINGS_PREFIX}.settings")
    warn_unknown(settings, f"{SETTINGS_PREFIX}.settings", {"serial", "fifo"}, warnings)
    serial_key = f"{SETTINGS_PREFIX}.settings.serial"
    serial = read_mapping(settings.get("serial"), serial_key)
    warn_unknown(serial, serial_key, {*yaml_keys(_SERIAL), "lanes", *_BOUND_KEYS}, warnings)
    fifo_key = f"{SETTINGS_PREFIX}.settings.fifo"
    fifo = read_mapping(settings.get("fifo"), fifo_key)
    warn_unknown(fifo, fifo_key, {*yaml_keys(_FIFO), *_BOUND_KEYS}, warnings)

    raw = settings_from_yaml(scheduler)
    problems = [ConfigError(e.key, e.problem) for e in setting_errors(raw)]
    if problems:
        first, *rest = problems
        raise ConfigError(first.key, first.message, also=rest)
    checked = SchedulerSettings.create(**raw)
    return checked.with_changes(
        fifo_priority=resolve_fifo_priority(checked.fifo_priority, models, aliases)
    )


def resolve_fifo_priority(
    fifo_priority: Mapping[str, int],
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
) -> dict[str, int]:
    """fifoPriority keyed by the model id a request resolves to (an alias is rewritten to
    its model's id). An unknown model, or one named twice, is a :class:`ConfigError`
    naming the key: the one rule for the config file and the admin's form."""
    priorities: dict[str, int] = {}
    named_by: dict[str, str] = {}
    for name, priority in fifo_priority.items():
        model_id = real_model_id(name, models, aliases)
        if model_id is None:
            raise ConfigError(f"{KEY_FIFO}.{name}", f"unknown model {name!r}")
        if model_id in priorities:
            raise ConfigError(
                f"{KEY_FIFO}.{name}",
                f"model {model_id!r} already has a priority (as {named_by[model_id]!r})",
            )
        priorities[model_id] = priority
        named_by[model_id] = name
    return priorities


ROUTER_PREFIX = "routing.router"


KEY_LANES = f"{SETTINGS_PREFIX}.settings.serial.lanes"


_GROUP_KEYS = frozenset({"swap", "exclusive", "persistent", "members"})


_MATRIX_KEYS = frozenset({"vars", "evict_costs", "sets"})


_LANE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")


def read_router(
    top: Mapping[str, Any],
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    warnings: list[str],
) -> Swapper:
    """``routing.router`` or the legacy top-level ``groups``/``matrix``, as llama-swap
    reads them: one form only, groups or matrix (not both), default every model in the
    ``(default)`` group."""
    router = read_mapping(read_mapping(top.get("routing"), "routing").get("router"), ROUTER_PREFIX)
    warn_unknown(router, ROUTER_PREFIX, {"use", "settings"}, warnings)
    settings = read_mapping(router.get("settings"), f"{ROUTER_PREFIX}.settings")
    warn_unknown(settings, f"{ROUTER_PREFIX}.settings", {"groups", "matrix"}, warnings)
    groups = read_mapping(settings.get("groups"), f"{ROUTER_PREFIX}.settings.groups")
    matrix = settings.get("matrix")
    legacy_groups = read_mapping(top.get("groups"), "groups")
    legacy_matrix = top.get("matrix")

    # Present as llama-swap counts it: an empty groups mapping or a null matrix is absent.
    if legacy_matrix is not None or legacy_groups:
        legacy = "matrix" if legacy_matrix is not None else "groups"
        if router.get("use") not in (None, "") or matrix is not None or groups:
            raise ConfigError(
                legacy,
                "the legacy top-level groups/matrix cannot be used together with "
                f"{ROUTER_PREFIX}; move them under {ROUTER_PREFIX}.settings",
            )
        if legacy_matrix is not None and legacy_groups:
            raise ConfigError("matrix", "cannot be used together with groups; choose one")
        if legacy_matrix is not None:
            return _matrix(legacy_matrix, "matrix", models, aliases, warnings)
        return _groups(legacy_groups, "groups", models, warnings, aliases)

    use = read_string(or_default(router.get("use"), ""), f"{ROUTER_PREFIX}.use") or "group"
    if use == "matrix":
        if matrix is None:
            raise ConfigError(
                f"{ROUTER_PREFIX}.settings.matrix", f"required by {ROUTER_PREFIX}.use: matrix"
            )
        if groups:
            warnings.append(
                f"{ROUTER_PREFIX}.settings.groups: not used with {ROUTER_PREFIX}.use: matrix; "
                "ignored"
            )
        return _matrix(matrix, f"{ROUTER_PREFIX}.settings.matrix", models, aliases, warnings)
    if use == "group":
        if matrix is not None:
            warnings.append(
                f"{ROUTER_PREFIX}.settings.matrix: not used with {ROUTER_PREFIX}.use: group; "
                "ignored"
            )
        return _groups(groups, f"{ROUTER_PREFIX}.settings.groups", models, warnings, aliases)
    raise ConfigError(f"{ROUTER_PREFIX}.use", f"unknown router {use!r} (use group or matrix)")


def _groups(
    value: Mapping[str, Any],
    key: str,
    models: Mapping[str, ModelConfig],
    warnings: list[str],
    aliases: Mapping[str, str],
) -> GroupSwapper:
    """The configured groups, then ``(default)`` with every model in none.

    Members are model ids: llama-swap keys a group's processes by the member as written,
    so an alias there does not group the model it names; here it is an error.
    """
    groups: list[Group] = []
    group_of: dict[str, str] = {}
    for raw_name, raw_spec in value.items():
        name = str(raw_name)
        group_key = f"{key}.{name}"
        if name == DEFAULT_GROUP:
            raise ConfigError(
                group_key, f"{DEFAULT_GROUP} is the group of the models in no group; rename it"
            )
        spec = read_mapping(raw_spec, group_key)
        warn_unknown(spec, group_key, set(_GROUP_KEYS), warnings)
        members: list[str] = []
        for i, member in enumerate(read_string_list(spec.get("members"), f"{group_key}.members")):
            member_key = f"{group_key}.members[{i}]"
            if member not in models:
                if member in aliases:
                    raise ConfigError(
                        member_key,
                        f"{member!r} is an alias of model {aliases[member]!r}; "
                        "members are model ids",
                    )
                raise ConfigError(member_key, f"unknown model {member!r}")
            if member in members:
                raise ConfigError(member_key, f"model {member!r} is listed twice in this group")
            if member in group_of:
                raise ConfigError(
                    member_key,
                    f"model {member!r} is in two groups: {group_of[member]!r} and {name!r}",
                )
            group_of[member] = name
            members.append(member)
        groups.append(
            Group(
                name,
                swap=read_bool(or_default(spec.get("swap"), True), f"{group_key}.swap"),
                exclusive=read_bool(
                    or_default(spec.get("exclusive"), True), f"{group_key}.exclusive"
                ),
                persistent=read_bool(
                    or_default(spec.get("persistent"), False), f"{group_key}.persistent"
                ),
                members=tuple(members),
            )
        )
    ungrouped = tuple(model_id for model_id in models if model_id not in group_of)
    if ungrouped:
        groups.append(Group(DEFAULT_GROUP, members=ungrouped))
    try:
        return GroupSwapper(groups)
    except GroupError as exc:  # checked above; kept for the swapper's own rules
        raise ConfigError(key, str(exc)) from None


def _matrix(
    value: Any,
    key: str,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    warnings: list[str],
) -> MatrixSwapper:
    """``matrix``: ``vars`` (short name -> model id), ``evict_costs``, ``sets`` (in order)."""
    spec = read_mapping(value, key)
    warn_unknown(spec, key, set(_MATRIX_KEYS), warnings)
    variables = {
        str(name): read_string(model_id, f"{key}.vars.{name}")
        for name, model_id in read_mapping(spec.get("vars"), f"{key}.vars").items()
    }
    costs = {
        str(name): read_int(cost, f"{key}.evict_costs.{name}")
        for name, cost in read_mapping(spec.get("evict_costs"), f"{key}.evict_costs").items()
    }
    sets = [
        (str(name), read_string(or_default(text, ""), f"{key}.sets.{name}"))
        for name, text in read_mapping(spec.get("sets"), f"{key}.sets").items()
    ]
    try:
        return MatrixSwapper.compile(sets, models, variables, costs, aliases)
    except MatrixError as exc:
        raise ConfigError(f"{key}.{exc.where}" if exc.where else key, exc.message) from None


def read_lanes(
    value: Any,
    models: Mapping[str, ModelConfig],
    aliases: Mapping[str, str],
    router: Swapper,
) -> tuple[Mapping[str, tuple[str, ...]], Mapping[str, str]]:
    """``routing.scheduler.settings.serial.lanes``: lane name -> [group, model id or alias].

    Called after :func:`read_scheduler_settings`, which checked the sections' shapes.
    """
    scheduler = read_mapping(read_mapping(value, "routing").get("scheduler"), SETTINGS_PREFIX)
    settings = read_mapping(scheduler.get("settings"), f"{SETTINGS_PREFIX}.settings")
    serial = read_mapping(settings.get("serial"), f"{SETTINGS_PREFIX}.settings.serial")
    group_members = (
        {group.name: group.members for group in router.groups}
        if isinstance(router, GroupSwapper)
        else {}
    )
    lanes: dict[str, tuple[str, ...]] = {}
    lane_of: dict[str, str] = {}
    for raw_name, members in read_mapping(serial.get("lanes"), KEY_LANES).items():
        name = str(raw_name)
        lane_key = f"{KEY_LANES}.{name}"
        if not _LANE_NAME.fullmatch(name):
            raise ConfigError(
                lane_key,
                f"a lane name is a letter, then up to 31 letters, digits, '_', '-'; got {name!r}",
            )
        if not isinstance(members, list) or not members:
            raise ConfigError(
                lane_key,
                f"must be a non-empty list of groups, model ids or aliases, got {kind_of(members)}",
            )
        on_lane: list[str] = []
        for i, item in enumerate(members):
            member_key = f"{lane_key}[{i}]"
            member = read_string(item, member_key)
            if member in group_members:
                if member in models and member not in group_members[member]:
                    raise ConfigError(
                        member_key,
                        f"{member!r} is both a group and a model outside it; ambiguous",
                    )
                model_ids: tuple[str, ...] = group_members[member]
            else:
                model_id = real_model_id(member, models, aliases)
                if model_id is None:
                    raise ConfigError(member_key, f"unknown group, model or alias {member!r}")
                model_ids = (model_id,)
            for model_id in model_ids:
                other = lane_of.get(model_id)
                if other is None:
                    lane_of[model_id] = name
                    on_lane.append(model_id)
                elif other != name:
                    raise ConfigError(
                        member_key, f"model {model_id!r} is on two lanes: {other!r} and {name!r}"
                    )
        lanes[name] = tuple(on_lane)
    rest = tuple(model_id for model_id in models if model_id not in lane_of)
    if rest or not lanes:
        lanes[DEFAULT_LANE] = lanes.get(DEFAULT_LANE, ()) + rest
        lane_of.update(dict.fromkeys(rest, DEFAULT_LANE))
    return MappingProxyType(lanes), MappingProxyType(lane_of)


def read_queue_bounds(value: Any, use: Policy) -> QueueBounds:
    """``maxQueueDepth`` and ``maxWait`` from the serial and fifo sections.

    Both sections are checked. Each setting (``maxQueueDepth``, and each band of
    ``maxWait``) is taken from the section named by ``use`` if it sets it, else from the
    other one. Called after :func:`read_scheduler_settings`, which checked the section shapes
    and warned about unknown keys.
    """
    settings = read_mapping(read_mapping(value, "routing").get("scheduler"), SETTINGS_PREFIX)
    settings = read_mapping(settings.get("settings"), f"{SETTINGS_PREFIX}.settings")
    depth: int | None = None
    waits: dict[str, float] = {}
    # The section in use is read last, so its values win.
    for policy in [*(p for p in Policy if p is not use), use]:
        key = f"{SETTINGS_PREFIX}.settings.{policy.value}"
        section = read_mapping(settings.get(policy.value), key)
        if section.get("maxQueueDepth") is not None:
            depth = read_int(section["maxQueueDepth"], f"{key}.maxQueueDepth", 1)
        max_wait = read_mapping(section.get("maxWait"), f"{key}.maxWait")
        for raw_band, seconds in max_wait.items():
            band = str(raw_band)
            band_key = f"{key}.maxWait.{band}"
            if band not in BANDS:
                names = ", ".join(BANDS)
                raise ConfigError(band_key, f"unknown band {band!r} (use one of {names})")
            if seconds is not None:
                waits[band] = read_positive(seconds, band_key)
    ordered = {band.value: waits[band] for band in BANDS if band in waits}
    return QueueBounds(max_queue_depth=depth, max_wait=MappingProxyType(ordered))
