"""``${env.NAME}`` and macros: expansion in declaration order, with llama-swap's types and
errors, spending a :class:`Budget` so that macros using each other cannot blow up."""

from __future__ import annotations

import math
import re
from collections import ChainMap
from collections.abc import Mapping
from typing import Any

from scheduler.config.values import ConfigError, format_value, kind_of

RESERVED_MACROS = frozenset({"PORT", "MODEL_ID", "PID"})


MAX_EXPANSION_CHARS = 4 * 1024 * 1024
"""The most characters ``${env.NAME}`` and macro expansion may write and scan in all (each
expansion step counting at least :data:`_STEP_COST`)."""


_MACRO_NAME = re.compile(r"[a-zA-Z0-9_-]+")


_MACRO_USE = re.compile(r"\$\{([a-zA-Z0-9_-]+)\}")


_ENV_USE = re.compile(r"\$\{env\.([a-zA-Z_][a-zA-Z0-9_]*)\}")


_INT_TEXT = re.compile(r"[-+]?[0-9]+")


_FLOAT_TEXT = re.compile(r"[-+]?([0-9]+\.[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


_STEP_COST = 256
"""What one macro expansion step spends at least: its fixed cost in characters' worth, so
that a long chain of macros over short text is bounded in time too."""


class Budget:
    """The characters ``${env.NAME}`` and macro expansion may still write and scan for one
    config (:data:`MAX_EXPANSION_CHARS`). Each is linear in its input, but macros that use
    each other (``b: ${a}${a}``, ``c: ${b}${b}``, ...) double the text at every step, and a
    long variable may be used many times: the expansion stops with a ConfigError naming
    the key it was expanding once the budget is spent."""

    def __init__(self, chars: int = MAX_EXPANSION_CHARS) -> None:
        self.left = chars

    def spend(self, chars: int, key: str) -> None:
        self.left -= chars
        if self.left < 0:
            raise ConfigError(
                key,
                f"${{env.NAME}} and macro expansion would write more than {MAX_EXPANSION_CHARS} "
                "characters for this config (macros that use each other many times?)",
            )


def expand_env(value: Any, key: str, environ: Mapping[str, str], budget: Budget) -> Any:
    """``${env.NAME}`` replaced in every string below ``value``."""
    if isinstance(value, str):
        if "${env." not in value:
            return value
        budget.spend(len(value), key)

        def lookup(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in environ:
                raise ConfigError(key, f"environment variable '{name}' is not set")
            budget.spend(len(environ[name]), key)  # before the text is built
            return environ[name]

        expanded = _ENV_USE.sub(lookup, value)
        if expanded != value and _ENV_USE.fullmatch(value):
            # llama-swap substitutes into the YAML text, so `startPort: ${env.BASE}` is an int.
            return _yaml_scalar(expanded)
        return expanded
    if isinstance(value, Mapping):
        return {k: expand_env(v, f"{key}.{k}", environ, budget) for k, v in value.items()}
    if isinstance(value, list):
        return [expand_env(v, f"{key}[{i}]", environ, budget) for i, v in enumerate(value)]
    return value


def _yaml_scalar(text: str) -> Any:
    if _INT_TEXT.fullmatch(text):
        return int(text)
    if _FLOAT_TEXT.fullmatch(text):
        return float(text)
    return text


def read_macros(value: Any, key: str) -> list[tuple[str, Any]]:
    """Macro declarations in declaration order (that order decides what may use what)."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a mapping of macro name to value, got {kind_of(value)}")
    macros: list[tuple[str, Any]] = []
    for raw_name, macro in value.items():
        name = str(raw_name)
        path = f"{key}.{name}"
        if len(name) >= 64:
            raise ConfigError(path, "macro names must be shorter than 64 characters")
        if not _MACRO_NAME.fullmatch(name):
            raise ConfigError(path, "macro names may only use letters, digits, '_' and '-'")
        if name in RESERVED_MACROS:
            raise ConfigError(path, f"'{name}' is reserved: llamaswap sets ${{{name}}} itself")
        if isinstance(macro, str):
            if f"${{{name}}}" in macro:
                raise ConfigError(path, f"macro '{name}' refers to itself")
        elif not isinstance(macro, bool | int | float):
            raise ConfigError(path, f"must be a string, number or boolean, got {kind_of(macro)}")
        macros.append((name, macro))
    return macros


MacroScope = Mapping[str, tuple[int, Any]]
"""Macros in force: name -> (place in the declaration order, value)."""


def macro_scope(macros: list[tuple[str, Any]]) -> dict[str, tuple[int, Any]]:
    """The global macros as a :data:`MacroScope`."""
    return {name: (i, value) for i, (name, value) in enumerate(macros)}


def model_scope(
    model_id: str, global_scope: dict[str, tuple[int, Any]], model_macros: list[tuple[str, Any]]
) -> MacroScope:
    """A model's scope: MODEL_ID (declared first), the globals, its own macros overriding
    globals in place and the new ones after them. Built without copying the globals, so a
    config of many models and many macros costs their sum, not their product."""
    own: dict[str, tuple[int, Any]] = {"MODEL_ID": (-1, model_id)}
    for j, (name, value) in enumerate(model_macros):
        place = global_scope[name][0] if name in global_scope else len(global_scope) + j
        own[name] = (place, value)
    return ChainMap(own, global_scope)


def substitute_all(value: Any, scope: MacroScope, key: str, budget: Budget) -> Any:
    """Every string below ``value`` with its macros expanded (:func:`expand_macros`)."""
    if isinstance(value, str):
        return expand_macros(value, scope, key, budget) if "${" in value else value
    if isinstance(value, Mapping):
        return {k: substitute_all(v, scope, f"{key}.{k}", budget) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_all(v, scope, f"{key}[{i}]", budget) for i, v in enumerate(value)]
    return value


def expand_macros(
    text: str, scope: MacroScope, key: str, budget: Budget, typed: bool = True
) -> Any:
    """``text`` with the macros of ``scope`` expanded, last declared first: a macro's value
    is itself expanded by every macro declared before it, which is how "macros may use
    previously declared macros" works (a use of a later one stays, and is reported).

    Applying every macro in turn would cost macros x text; only the ones ``text`` uses are
    applied, the latest first, which gives the same result: a macro applied puts in uses of
    earlier macros only, the ones still to come. With ``typed``, a value that is exactly
    ``${name}`` becomes the macro's value with its type (``ttl: ${ttl}`` is an int).
    Spends ``budget`` on what it scans and writes."""
    value: Any = text
    below = math.inf  # the place of the macro applied last: only earlier ones follow
    while isinstance(value, str) and "${" in value:
        budget.spend(max(len(value), _STEP_COST), key)
        best: tuple[str, int, Any] | None = None
        for name in set(_MACRO_USE.findall(value)):
            entry = scope.get(name)
            if entry is not None and entry[0] < below and (best is None or entry[0] > best[1]):
                best = (name, *entry)
        if best is None:
            break
        name, below, replacement = best
        slug = f"${{{name}}}"
        if typed and value == slug:
            value = replacement  # the whole value: keep the macro's type
            continue
        written = format_value(replacement)
        budget.spend(len(value) + value.count(slug) * max(0, len(written) - len(slug)), key)
        value = value.replace(slug, written)
    return value


def substitute(value: Any, name: str, replacement: Any) -> Any:
    slug = f"${{{name}}}"
    if isinstance(value, str):
        if value == slug:
            return replacement  # the whole value: keep the macro's type
        return value.replace(slug, format_value(replacement)) if slug in value else value
    if isinstance(value, Mapping):
        return {k: substitute(v, name, replacement) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, name, replacement) for v in value]
    return value


def check_expanded(value: Any, key: str, allow_pid: bool) -> None:
    """Raise for any ``${name}`` still in ``value`` (``${PID}`` allowed in cmdStop)."""
    if isinstance(value, str):
        for match in _MACRO_USE.finditer(value):
            name = match.group(1)
            if name == "PID":
                if allow_pid:
                    continue
                raise ConfigError(key, "${PID} is only available in cmdStop")
            if name == "PORT":
                raise ConfigError(key, "${PORT} is only assigned to models whose cmd uses ${PORT}")
            raise ConfigError(
                key,
                f"unknown macro '${{{name}}}': define it under macros "
                "(a macro may only use macros declared before it)",
            )
    elif isinstance(value, Mapping):
        for k, v in value.items():
            check_expanded(v, f"{key}.{k}", allow_pid)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_expanded(v, f"{key}[{i}]", allow_pid)
