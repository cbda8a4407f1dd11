"""Every scheduler setting, declared once; and the rule that decides between the config
file and an admin edit.

Pure: no Django, no I/O. Each row of :data:`SETTINGS` gives a setting's YAML name and
place under ``routing.scheduler``, its :class:`~scheduler.core.policy.SchedulerSettings`
field, kind, default, range, unit and help text. Everything else is derived from the
table: the validation of :meth:`SchedulerSettings.create` (shared by the config file,
``llamaswap check``, the admin form and the simulator's ``--set``), the YAML reading
(``scheduler.config``), the admin form and the stored record (``dashboard``), the
simulator's ``--set`` (:func:`parse_assignments`) and the table in docs/scheduling.md
(checked by ``tests/test_settings_table.py``).

Adding a setting: a field on ``SchedulerSettings``, a row here, and the code that uses
it. No migration: the admin stores the values as JSON keyed by YAML name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from dataclasses import field as dc_field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from scheduler.core.priority import Band


class Policy(StrEnum):
    """Which scheduler orders the queue (``routing.scheduler.use``)."""

    SERIAL = "serial"
    """The spec's scheduler: one job at a time, score = priority + affinity + aging."""
    FIFO = "fifo"
    """llama-swap's: model priority + header priority, arrival order among equals."""


SETTINGS_PREFIX = "routing.scheduler"


class SettingsError(ValueError):
    """An invalid scheduler setting; ``key`` is the config key path."""

    def __init__(self, key: str, value: object, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"{key}: {self.problem}")

    @property
    def problem(self) -> str:
        """The message without the key, as a config error says it: ``llamaswap check``
        and the admin show ``key: problem`` alike."""
        return f"{self.reason}, got {self.value!r}"


class Kind(StrEnum):
    """What values a setting takes (and so how it is read, checked, stored and edited)."""

    CHOICE = "choice"
    """One of the values of :attr:`Setting.choices` (an enum)."""
    NUMBER = "number"
    """A finite number in range; None too when :attr:`Setting.absent` says what it means."""
    INTEGER = "integer"
    """An integer in range."""
    MODEL_PRIORITIES = "model priorities"
    """Model id -> integer. ``--set name.<model>=N``."""
    BAND_SHARES = "band shares"
    """Band -> share in 0..1, the shares summing to at most 1. ``--set name.<band>=S``."""


class Section(StrEnum):
    """Where a setting sits on the admin page."""

    MAIN = "main"
    BOUNDS = "bounds"
    """The opt-in starvation bounds."""
    STARTS = "starts"
    """Model starts."""


@dataclass(frozen=True)
class Setting:
    """One scheduler setting."""

    name: str
    """The YAML name (camelCase), also the name in ``--set``, JSON and the stored record."""
    field: str
    """The :class:`SchedulerSettings` attribute."""
    path: tuple[str, ...]
    """Where it sits under ``routing.scheduler``."""
    kind: Kind
    default: Any
    help: str
    label: str
    """A short lower-case name for forms."""
    unit: str = ""
    minimum: float | None = None
    above: bool = False
    """``minimum`` is excluded (> rather than >=)."""
    maximum: float | None = None
    choices: type[StrEnum] | None = None
    absent: str = ""
    """What "no value" (None) means; empty: a value is required."""
    section: Section = Section.MAIN
    # Derived once (Enum member access costs ~0.5 us on Python 3.11: kept off the calls).
    key: str = dc_field(init=False)
    """The full config key path, as errors name it."""
    is_map: bool = dc_field(init=False)
    """Given per entry on the command line: ``name.<entry>=value``."""
    _check: Callable[[Setting, object], Any] = dc_field(init=False, repr=False, compare=False)
    _plain: Callable[[Any], Any] = dc_field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", ".".join((SETTINGS_PREFIX, *self.path)))
        object.__setattr__(self, "is_map", self.kind in (Kind.MODEL_PRIORITIES, Kind.BAND_SHARES))
        object.__setattr__(self, "_check", _CHECKS[self.kind])
        object.__setattr__(self, "_plain", _PLAINS[self.kind])

    @property
    def range_text(self) -> str:
        """The valid values in words (the docs table)."""
        if self.kind is Kind.CHOICE:
            assert self.choices is not None
            return " or ".join(c.value for c in self.choices)
        if self.kind is Kind.MODEL_PRIORITIES:
            return "model id -> integer"
        if self.kind is Kind.BAND_SHARES:
            return "band -> 0..1, sum <= 1"
        if self.kind is Kind.INTEGER:
            return f"integer {_g(self.minimum)}..{_g(self.maximum)}"
        text = f"number {'>' if self.above else '>='} {_g(self.minimum)}"
        return f"{text}, or absent: {self.absent}" if self.absent else text

    def check(self, value: object) -> Any:
        """The validated value of a raw one (YAML, form, command line, JSON); raises
        :class:`SettingsError` naming the key and the value."""
        return self._check(self, value)

    def plain(self, value: Any) -> Any:
        """A validated value as JSON, as typed (60 rather than 60.0; bands in band
        order); :meth:`check` takes it back."""
        return None if value is None else self._plain(value)

    def from_text(self, text: str) -> object:
        """A raw value from the command line (``--set name=text``): a number when it reads
        as one; ``none`` is no value."""
        text = text.strip()
        if self.absent and text.lower() in ("none", "null", ""):
            return None
        for convert in (int, float):
            try:
                return convert(text)
            except ValueError:
                pass
        return text


def _g(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"


def _as_typed(value: Any) -> Any:
    """60.0 -> 60, so stored and config values compare and print alike."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_choice(row: Setting, value: object) -> Any:
    assert row.choices is not None
    try:
        return row.choices(value if isinstance(value, str) else "")
    except ValueError:
        names = " or ".join(f"'{c.value}'" for c in row.choices)
        raise SettingsError(row.key, value, f"must be {names}") from None


def _check_number(row: Setting, value: object) -> Any:
    if value is None and row.absent:
        return None
    bound = f"{'>' if row.above else '>='} {_g(row.minimum)}"
    tail = f" (or absent: {row.absent})" if row.absent else ""
    if not _is_number(value):
        raise SettingsError(row.key, value, f"must be a number {bound}{tail}")
    assert isinstance(value, int | float)
    low = row.minimum if row.minimum is not None else -math.inf
    if not math.isfinite(value) or value < low or (row.above and value == low):
        raise SettingsError(row.key, value, f"must be a finite number {bound}{tail}")
    if row.maximum is not None and value > row.maximum:
        raise SettingsError(row.key, value, f"must be a number {bound} and <= {_g(row.maximum)}")
    return value


def _check_integer(row: Setting, value: object) -> Any:
    reason = f"must be an integer {_g(row.minimum)}..{_g(row.maximum)}"
    if not _is_int(value):
        raise SettingsError(row.key, value, reason)
    assert isinstance(value, int)
    if (row.minimum is not None and value < row.minimum) or (
        row.maximum is not None and value > row.maximum
    ):
        raise SettingsError(row.key, value, reason)
    return value


def _check_model_priorities(row: Setting, value: object) -> Any:
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise SettingsError(row.key, value, "must be a map of model id to integer")
    priorities: dict[str, int] = {}
    for model, priority in value.items():
        if not isinstance(model, str) or not model:
            raise SettingsError(row.key, model, "model ids must be non-empty strings")
        if not _is_int(priority):
            raise SettingsError(f"{row.key}.{model}", priority, "must be an integer")
        priorities[model] = priority
    return MappingProxyType(priorities)


def _check_band_shares(row: Setting, value: object) -> Any:
    """Zero shares are dropped (a band without a share is scheduled by score alone)."""
    if value is None:
        return MappingProxyType({})
    if not isinstance(value, Mapping):
        raise SettingsError(
            row.key, value, "must be a map of band (interactive, normal, batch) to share"
        )
    shares: dict[Band, float] = {}
    for name, share in value.items():
        try:
            band = Band(
                name.value if isinstance(name, Band) else name if isinstance(name, str) else ""
            )
        except ValueError:
            raise SettingsError(row.key, name, "bands are interactive, normal and batch") from None
        key = f"{row.key}.{band.value}"
        if not _is_number(share) or not math.isfinite(share) or not 0 <= share <= 1:
            raise SettingsError(key, share, "must be a number from 0 to 1")
        if share:
            shares[band] = float(share)
    total = sum(shares.values())
    if total > 1 + 1e-9:
        raise SettingsError(
            row.key,
            {b.value: s for b, s in shares.items()},
            f"the shares sum to {total:g}, more than 1",
        )
    return MappingProxyType({band: shares[band] for band in Band if band in shares})


def _plain_choice(value: Any) -> Any:
    return value.value if isinstance(value, StrEnum) else value


def _plain_priorities(value: Any) -> Any:
    return dict(sorted(value.items()))


_BAND_ORDER = {band.value: i for i, band in enumerate(Band)}


def _plain_shares(value: Any) -> Any:
    items = {(k.value if isinstance(k, Band) else str(k)): v for k, v in value.items()}
    ranked = sorted(items, key=lambda k: (_BAND_ORDER.get(k, 9), k))
    return {k: _as_typed(items[k]) for k in ranked}


_PLAINS: dict[Kind, Callable[[Any], Any]] = {
    Kind.CHOICE: _plain_choice,
    Kind.NUMBER: _as_typed,
    Kind.INTEGER: _as_typed,
    Kind.MODEL_PRIORITIES: _plain_priorities,
    Kind.BAND_SHARES: _plain_shares,
}

_CHECKS: dict[Kind, Callable[[Setting, object], Any]] = {
    Kind.CHOICE: _check_choice,
    Kind.NUMBER: _check_number,
    Kind.INTEGER: _check_integer,
    Kind.MODEL_PRIORITIES: _check_model_priorities,
    Kind.BAND_SHARES: _check_band_shares,
}

_SERIAL = ("settings", "serial")

SETTINGS: tuple[Setting, ...] = (
    Setting(
        name="use",
        field="use",
        path=("use",),
        kind=Kind.CHOICE,
        choices=Policy,
        default=Policy.SERIAL,
        label="scheduler",
        help=(
            "serial: the spec's scheduler, score = priority + swap affinity + aging; "
            "fifo: llama-swap's, model priority + header priority, arrival order among equals."
        ),
    ),
    Setting(
        name="agingDivisor",
        field="aging_divisor",
        path=(*_SERIAL, "agingDivisor"),
        kind=Kind.NUMBER,
        minimum=0,
        default=60,
        unit="seconds per point",
        label="aging divisor",
        help="Seconds of waiting per priority point; 0 disables aging.",
    ),
    Setting(
        name="swapAffinityBonus",
        field="swap_affinity_bonus",
        path=(*_SERIAL, "swapAffinityBonus"),
        kind=Kind.INTEGER,
        minimum=0,
        maximum=99,
        default=10,
        unit="points",
        label="swap affinity bonus",
        help="Bonus for a request that needs no model swap, 0..99; 0 disables it.",
    ),
    Setting(
        name="fifoPriority",
        field="fifo_priority",
        path=("settings", "fifo", "priority"),
        kind=Kind.MODEL_PRIORITIES,
        default=MappingProxyType({}),
        label="fifo priorities",
        help="fifo scheduler: a priority per model id (higher goes first).",
    ),
    Setting(
        name="agingCap",
        field="aging_cap",
        path=(*_SERIAL, "agingCap"),
        kind=Kind.NUMBER,
        minimum=0,
        above=True,
        absent="no cap",
        default=None,
        unit="points",
        label="aging cap",
        section=Section.BOUNDS,
        help=(
            "Opt-in: at most this many aging points, reached after agingCap x agingDivisor "
            "seconds; empty: no cap (the default). With a cap C a request is never passed by "
            "one more than C + swapAffinityBonus below it."
        ),
    ),
    Setting(
        name="bandShare",
        field="band_share",
        path=(*_SERIAL, "bandShare"),
        kind=Kind.BAND_SHARES,
        default=MappingProxyType({}),
        unit="share of GPU time",
        label="band share",
        section=Section.BOUNDS,
        help=(
            "Opt-in: the share of GPU time (0..1; the shares sum to at most 1) a band gets "
            "while it has work waiting: when it has had less than its share since it last "
            "had nothing waiting, its best request goes next. Empty or 0: no share (the "
            "default). E.g. batch 0.2: a batch flood gets at least a fifth of the GPU."
        ),
    ),
    Setting(
        name="startFailureCooldown",
        field="start_failure_cooldown",
        path=("startFailureCooldown",),
        kind=Kind.NUMBER,
        minimum=0,
        default=5.0,
        unit="seconds",
        label="start failure cool-down",
        section=Section.STARTS,
        help=(
            "After a model fails to start, requests for it fail at once with the cause for "
            "this many seconds instead of retrying the start; 0 retries every request."
        ),
    ),
)

BY_NAME: Mapping[str, Setting] = MappingProxyType({s.name: s for s in SETTINGS})
BY_FIELD: Mapping[str, Setting] = MappingProxyType({s.field: s for s in SETTINGS})
NAMES: tuple[str, ...] = tuple(BY_NAME)


def check_fields(raw: Mapping[str, object]) -> dict[str, Any]:
    """Raw values by field name -> validated values by field name, defaults for the
    missing ones. Raises :class:`SettingsError` (the first invalid setting, in table
    order) or TypeError for a name that is no setting."""
    unknown = set(raw) - set(BY_FIELD)
    if unknown:
        raise TypeError(f"unknown settings: {sorted(unknown)}")
    return {s.field: s.check(raw[s.field]) if s.field in raw else s.default for s in SETTINGS}


def errors(raw: Mapping[str, object]) -> list[SettingsError]:
    """Every invalid setting among raw values by field name (``llamaswap check`` lists
    them all; :func:`check_fields` stops at the first)."""
    found = []
    for s in SETTINGS:
        if s.field in raw:
            try:
                s.check(raw[s.field])
            except SettingsError as error:
                found.append(error)
    return found


def fields_from_names(values: Mapping[str, object]) -> dict[str, object]:
    """Values by YAML name -> by field name (names that are no setting are dropped)."""
    return {BY_NAME[name].field: value for name, value in values.items() if name in BY_NAME}


def from_yaml(scheduler: Mapping[str, Any]) -> dict[str, object]:
    """The raw values under ``routing.scheduler`` by field name; absent or null: absent
    (the default). The sections on the way are mappings (the caller checked them)."""
    raw: dict[str, object] = {}
    for s in SETTINGS:
        node: Any = scheduler
        for part in s.path[:-1]:
            node = node.get(part) if isinstance(node, Mapping) else None
        value = node.get(s.path[-1]) if isinstance(node, Mapping) else None
        if value is not None:
            raw[s.field] = value
    return raw


def yaml_keys(section: tuple[str, ...]) -> frozenset[str]:
    """The setting names that sit directly in ``routing.scheduler.<section...>`` (and
    the sub-sections on the way to others), for the unknown-key warnings."""
    depth = len(section)
    return frozenset(s.path[depth] for s in SETTINGS if s.path[:depth] == section)


def parse_assignments(pairs: Iterable[str], base: Mapping[str, object]) -> dict[str, object]:
    """``name=value`` pairs (``agingDivisor=600``, ``use=fifo``, ``bandShare.batch=0.2``,
    ``fifoPriority.qwen=10``, ``agingCap=none``), each pair possibly several separated by
    commas, applied to raw values by field name (``base``, e.g. from ``as_dict``).
    Returns the changed raw values by field name, for :meth:`SchedulerSettings.create`.
    Raises :class:`SettingsError` naming the setting for an unknown name or a missing ``=``
    (values are checked by ``create``)."""
    changes: dict[str, object] = {}
    for pair in pairs:
        for item in pair.split(","):
            item = item.strip()
            if not item or item in ("default", "defaults"):
                continue
            name, sep, text = item.partition("=")
            name = name.strip()
            if not sep:
                raise SettingsError(name, item, "expected name=value")
            head, dot, sub = name.partition(".")
            row = BY_NAME.get(head)
            if row is None or row.is_map != bool(dot) or (dot and not sub):
                known = ", ".join(assignable_names())
                raise SettingsError(name, text, f"unknown setting (known: {known})")
            if row.is_map:
                current = changes.get(row.field, base.get(row.field))
                mapping = dict(current) if isinstance(current, Mapping) else {}
                mapping[sub] = row.from_text(text)
                changes[row.field] = mapping
            else:
                changes[row.field] = row.from_text(text)
    return changes


def assignable_names() -> list[str]:
    """The names ``--set`` takes: ``agingDivisor``, ``bandShare.<band>``, ..."""
    return [
        f"{s.name}.<{'band' if s.kind is Kind.BAND_SHARES else 'model'}>" if s.is_map else s.name
        for s in SETTINGS
    ]


# -- precedence: the config file or an admin edit -------------------------------------------
# The whole rule, pure: control.settings_store stores what these return (a start or reload:
# merge_at_start; an admin save: note_admin_edit) and decides nothing itself.


@dataclass(frozen=True)
class Merged:
    """The outcome of :func:`merge_at_start` or :func:`note_admin_edit`."""

    values: dict[str, Any]
    """The values in effect, by YAML name."""
    overrides: dict[str, Any]
    """The admin edits still in force: name -> what the admin noted (by, at)."""
    changed: list[tuple[str, Any, Any]]
    """(name, old, new) for each value that changed (by the config file at a start, by
    the admin in an edit): the change log's rows."""


def merge_at_start(
    config: Mapping[str, Any],
    previous_config: Mapping[str, Any],
    current: Mapping[str, Any],
    overrides: Mapping[str, Any],
) -> Merged:
    """The precedence rule (docs/dashboard.md), for values by YAML name as JSON:

    * a value edited in the admin (``overrides``) stays in effect across restarts ...
    * ... until the config file's value for that key differs from the one it had at the
      previous start (``previous_config``): a changed config file wins over an older
      admin edit;
    * keys the admin never edited follow the config file.
    """
    values: dict[str, Any] = {}
    kept: dict[str, Any] = dict(overrides)
    changed: list[tuple[str, Any, Any]] = []
    for name in NAMES:
        now = config.get(name)
        if name in kept and previous_config.get(name) == now:
            values[name] = current.get(name)  # admin edit, config unchanged: admin wins
            continue
        kept.pop(name, None)  # never edited, or the config file changed: config wins
        values[name] = now
        if current.get(name) != now:
            changed.append((name, current.get(name), now))
    return Merged(values, kept, changed)


def note_admin_edit(
    old: Mapping[str, Any], new: Mapping[str, Any], overrides: Mapping[str, Any], by: str, at: str
) -> Merged:
    """The other half of the rule, for an admin save (values by YAML name as JSON): each
    key whose value the edit changed now comes from the admin (``{by, at}``), and stays so
    until :func:`merge_at_start` sees the config file's value for it change. Keys the edit
    left alone keep where they came from."""
    kept: dict[str, Any] = dict(overrides)
    changed: list[tuple[str, Any, Any]] = []
    for name in NAMES:
        if old.get(name) != new.get(name):
            kept[name] = {"by": by, "at": at}
            changed.append((name, old.get(name), new.get(name)))
    return Merged({name: new.get(name) for name in NAMES}, kept, changed)


# -- a fleet: config file < fleet-wide admin edit < this node's admin edit --------------------
# A named node never writes its config file into the fleet row: the fleet row contributes
# only its admin edits (``overrides`` and their values); each node merges its own config
# file under them, in its own row.

FROM_CONFIG, FROM_FLEET, FROM_NODE = "config", "fleet", "node"
"""Where a value in effect on a node comes from (:attr:`Layered.sources`)."""


@dataclass(frozen=True)
class Layered:
    """The outcome of :func:`layered` or :func:`merge_node_at_start`."""

    values: dict[str, Any]
    """The values in effect on the node, by YAML name."""
    sources: dict[str, str]
    """name -> :data:`FROM_CONFIG`, :data:`FROM_FLEET` or :data:`FROM_NODE`."""
    node_overrides: dict[str, Any]
    """The node's own admin edits still in force."""
    config_wins: dict[str, Any]
    """name -> the ``at`` of a fleet edit this node's changed config file outranks."""
    changed: list[tuple[str, Any, Any]]
    """(name, old, new) for each value in effect that changed."""


def layered(
    config: Mapping[str, Any],
    fleet_values: Mapping[str, Any],
    fleet_overrides: Mapping[str, Any],
    node_values: Mapping[str, Any],
    node_overrides: Mapping[str, Any],
    config_wins: Mapping[str, Any] = MappingProxyType({}),
) -> Layered:
    """The precedence on a node, per key: its own admin edit (``node_overrides``, the value
    in ``node_values``), else a fleet-wide admin edit (``fleet_overrides``, the value in
    ``fleet_values``) unless this node's config file changed after it (``config_wins``
    holds that edit's ``at``), else its config file. ``changed`` compares with
    ``node_values`` (the values in effect before)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    wins: dict[str, Any] = {}
    changed: list[tuple[str, Any, Any]] = []
    for name in NAMES:
        fleet_edit = fleet_overrides.get(name)
        fleet_at = fleet_edit.get("at") if isinstance(fleet_edit, Mapping) else None
        if name in config_wins and fleet_edit is not None and config_wins[name] == fleet_at:
            wins[name] = config_wins[name]  # a newer fleet edit (another ``at``) applies again
        if name in node_overrides:
            values[name], sources[name] = node_values.get(name), FROM_NODE
        elif fleet_edit is not None and name not in wins:
            values[name], sources[name] = fleet_values.get(name), FROM_FLEET
        else:
            values[name], sources[name] = config.get(name), FROM_CONFIG
        if node_values.get(name) != values[name]:
            changed.append((name, node_values.get(name), values[name]))
    return Layered(values, sources, dict(node_overrides), wins, changed)


def merge_node_at_start(
    config: Mapping[str, Any],
    previous_config: Mapping[str, Any] | None,
    fleet_values: Mapping[str, Any],
    fleet_overrides: Mapping[str, Any],
    node_values: Mapping[str, Any],
    node_overrides: Mapping[str, Any],
    config_wins: Mapping[str, Any],
) -> Layered:
    """A named node's start or reload (``previous_config`` None: its first start, as if its
    config file had always said this). As on one box, a key whose config file value
    changed since the node's previous start follows the config file on this node: its own
    edit of that key is dropped, and a fleet edit of it is outranked here (until a newer
    fleet edit). Then :func:`layered`."""
    previous = config if previous_config is None else previous_config
    kept = dict(node_overrides)
    wins = dict(config_wins)
    for name in NAMES:
        if previous.get(name) == config.get(name):
            continue
        kept.pop(name, None)
        fleet_edit = fleet_overrides.get(name)
        if isinstance(fleet_edit, Mapping):
            wins[name] = fleet_edit.get("at")
    return layered(config, fleet_values, fleet_overrides, node_values, kept, wins)


SOURCE_CONFIG = "config file"
"""Where values come from when no admin edit is in force."""


def describe_source(
    overrides: Mapping[str, Mapping[str, str]], sources: Mapping[str, str] | None = None
) -> str:
    """Where the values in effect come from, in words (the dashboard, the dispatcher's
    ``settings_source``): the config file, or the admin edits in force and by whom. On a
    named node, ``overrides`` holds the fleet's and the node's edits and ``sources`` (from
    :func:`layered`) says which is in force: "(fleet-wide)" or "(this node)"."""
    tag = {FROM_FLEET: " (fleet-wide)", FROM_NODE: " (this node)"}
    parts = [
        f"{name} by {info.get('by') or '?'} at {info.get('at', '?')}"
        + (tag.get(sources.get(name, ""), "") if sources is not None else "")
        for name in NAMES
        if (info := overrides.get(name))
        and (sources is None or sources.get(name, FROM_CONFIG) != FROM_CONFIG)
    ]
    if not parts:
        return SOURCE_CONFIG
    return "admin edit: " + "; ".join(parts) + " (the rest from the config file)"


# -- the docs ---------------------------------------------------------------------------------


def docs_table() -> str:
    """The table of every setting in docs/scheduling.md ("Every setting"), between its
    markers; ``tests/test_settings_table.py`` checks that the docs hold exactly this."""
    rows = [
        "| key (under `routing.scheduler`) | name (`--set`, admin, JSON) | values | default "
        "| unit | what it does |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for s in SETTINGS:
        rows.append(
            f"| `{'.'.join(s.path)}` | `{s.name}` | {s.range_text} | {_shown_default(s)} "
            f"| {s.unit or '–'} | {s.help} |"
        )
    return "\n".join(rows)


def _shown_default(row: Setting) -> str:
    default = row.plain(row.default)
    if default is None:
        return row.absent
    if default == {}:
        return "none"
    return f"`{default}`"


def shown(values: Mapping[str, Any]) -> dict[str, str]:
    """Every setting as a person reads it, by name, from JSON values by name (as
    ``SchedulerSettings.as_dict`` gives them): 60 (not 60.0), ``qwen3=10 llama=5``,
    ``none``, or what no value means (``no cap``). The dashboard shows these."""
    out: dict[str, str] = {}
    for s in SETTINGS:
        value = values.get(s.name)
        if value is None:
            out[s.name] = s.absent or "–"
        elif isinstance(value, Mapping):
            out[s.name] = " ".join(f"{k}={_as_typed(v)}" for k, v in value.items()) or "none"
        else:
            out[s.name] = str(_as_typed(value))
    return out
