"""Typed readers of config values (``read_int``, ``read_mapping``, ...) and
:class:`ConfigError`: each reader names the key path in its error. Shared by every part of
the config's parsing."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any


class ConfigError(ValueError):
    """A config problem that stops startup; ``key`` is the key path (e.g. ``models.qwen.cmd``).

    ``also``: further problems found in the same pass (every invalid scheduler setting),
    which ``llamaswap check`` lists too."""

    def __init__(self, key: str, message: str, also: Sequence[ConfigError] = ()) -> None:
        self.key = key
        self.message = message
        self.also = tuple(also)
        super().__init__(f"{key}: {message}")

    @property
    def every(self) -> tuple[ConfigError, ...]:
        """This problem and the others found with it."""
        return (self, *self.also)


def format_value(value: Any) -> str:
    """A macro value inside a string, written as llama-swap (Go's ``%v``) writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return str(value)


def warn_unknown(
    section: Mapping[str, Any], key: str, known: AbstractSet[str], warnings: list[str]
) -> None:
    """One warning per key of ``section`` (at ``key``) not in ``known``."""
    for name in section:
        if name not in known:
            warnings.append(f"{key}.{name}: unknown key; ignored")


def known_keys(
    section: Mapping[Any, Any],
    key: str,
    known: AbstractSet[str],
    ignored: Mapping[str, str],
    warnings: list[str],
    unknown: str = "unknown key",
) -> dict[str, Any]:
    """The settings of ``section`` (at ``key``; "" the top level) whose names are in
    ``known``; a warning for each other one: why, for one of llama-swap's that we knowingly
    ignore (``ignored``: name -> reason), else ``unknown``."""
    kept: dict[str, Any] = {}
    for raw_name, value in section.items():
        name = str(raw_name)
        path = f"{key}.{name}" if key else name
        if name in known:
            kept[name] = value
        elif name in ignored:
            warnings.append(f"{path}: {ignored[name]}; ignored")
        else:
            warnings.append(f"{path}: {unknown}; ignored")
    return kept


def or_default(value: Any, default: Any) -> Any:
    """YAML ``key:`` with no value is null; llama-swap treats it as unset."""
    return default if value is None else value


def kind_of(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    shown = repr(value)  # bounded by check_size; cut short for the message
    return f"{type(value).__name__} {shown if len(shown) <= 200 else shown[:200] + '...'}"


def read_int(value: Any, key: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {kind_of(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")
    return value


def read_number(value: Any, key: str) -> float:
    """A number of seconds >= 0 (int or float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(key, f"must be a number of seconds, got {kind_of(value)}")
    if not math.isfinite(value) or value < 0:
        raise ConfigError(key, f"must be a finite number >= 0, got {value}")
    return value


def read_positive(value: Any, key: str) -> float:
    """A number of seconds > 0."""
    seconds = read_number(value, key)
    if seconds == 0:
        raise ConfigError(key, "must be > 0 (leave it out for no limit), got 0")
    return seconds


def read_string(value: Any, key: str) -> str:
    # A YAML number decodes into a Go string field too (`name: 7` is "7").
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return format_value(value)
    raise ConfigError(key, f"must be a string, got {kind_of(value)}")


def read_bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be true or false, got {kind_of(value)}")
    return value


def read_mapping(value: Any, key: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping, got {kind_of(value)}")
    return value


def read_string_list(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(key, f"must be a list, got {kind_of(value)}")
    return [read_string(item, f"{key}[{i}]") for i, item in enumerate(value)]
