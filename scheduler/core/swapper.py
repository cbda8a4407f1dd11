"""Which loaded models must stop before another may start: llama-swap's groups and matrix.

Pure: no Django, asyncio, I/O or clock. A *swapper* answers one question,
``evict(target, resident)``: the models among ``resident`` (loaded or loading; it may
include ``target``) that must be stopped before ``target`` may start or run. The answer
never includes ``target`` and is sorted, so it does not depend on the order of
``resident``. Starting is always just ``target``: a swapper never asks for other models to
be loaded.

**Groups** (``routing.router.use: group``, llama-swap's default; legacy top-level
``groups:``). Each model is in at most one group; a model in none is in the implicit
``(default)`` group, which swaps and is exclusive, so a config without groups runs one
model at a time. For a target in group T, a resident model in group G is evicted when

* G is T and T ``swap``\\ s (members of a swapping group run one at a time), or
* G is not T, T is ``exclusive`` and G is not ``persistent``.

So a persistent group is never unloaded by *another* group (its own members still swap),
and, as in llama-swap, loading a member of a non-exclusive group leaves every other group
running, exclusive ones included (llama-swap keeps this quirk of its old process groups).

**Matrix** (``routing.router.use: matrix``; legacy top-level ``matrix:``). Named sets of
models that may run together, written in a small language: ``a & b`` (both), ``a | b``
(either), parentheses, and ``+name`` (the expression of another set). ``&`` binds tighter
than ``|``. A name is a ``vars`` entry (short name -> model id) or else a model id. Each
set expands to the concrete combinations it allows; a combination also allows its
subsets. For a target that is not resident, the combination containing it that costs
least is chosen, the cost being the sum of ``evict_costs`` (default 1) of the resident
models outside it, which are evicted. Ties go to the first combination: sets in
definition order, except that a set comes after the sets it references (llama-swap's
topological order), and within a set in the order the expression writes them. A target in
no set runs alone: everything resident is evicted. A resident target evicts nothing.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, TypeAlias

DEFAULT_GROUP = "(default)"
"""The implicit group of every model that is in no group (swap and exclusive)."""
DEFAULT_EVICT_COST = 1
"""The eviction cost of a model not in ``evict_costs``."""
MAX_COMBINATIONS = 10_000
"""The most distinct combinations one matrix set may expand to."""
VAR_NAME = re.compile(r"[A-Za-z0-9.-]{1,32}")
"""A ``vars`` key (llama-swap's rule): letters, digits, ``-`` and ``.``, 1 to 32 of them."""


class Swapper(Protocol):
    """The eviction policy in front of the GPU."""

    kind: str
    """``group`` or ``matrix``."""

    def evict(self, target: str, resident: Collection[str]) -> tuple[str, ...]:
        """Models among ``resident`` (loaded or loading, may include ``target``) that must
        be stopped before ``target`` may start / run; never includes ``target``. Sorted."""
        ...


# --------------------------------------------------------------------------- groups


class GroupError(ValueError):
    """Groups that cannot work together (a model in two groups, a repeated name)."""


@dataclass(frozen=True)
class Group:
    """One ``groups.<name>`` entry, with llama-swap's defaults."""

    name: str
    swap: bool = True
    """At most one member runs at a time."""
    exclusive: bool = True
    """Loading a member unloads the other groups (persistent ones excepted)."""
    persistent: bool = False
    """Other groups never unload this one."""
    members: tuple[str, ...] = ()
    """Model ids."""


class GroupSwapper:
    """llama-swap's group router as a pure eviction policy."""

    kind = "group"

    def __init__(self, groups: Sequence[Group]) -> None:
        group_of: dict[str, Group] = {}
        names: set[str] = set()
        for group in groups:
            if group.name in names:
                raise GroupError(f"group {group.name!r} is defined twice")
            names.add(group.name)
            for model in group.members:
                other = group_of.get(model)
                if other is group:
                    raise GroupError(f"model {model!r} is listed twice in group {group.name!r}")
                if other is not None:
                    raise GroupError(
                        f"model {model!r} is in two groups: {other.name!r} and {group.name!r}"
                    )
                group_of[model] = group
        self._groups = tuple(groups)
        self._group_of = group_of
        self._default = next(
            (group for group in groups if group.name == DEFAULT_GROUP), Group(DEFAULT_GROUP)
        )

    @classmethod
    def default(cls, model_ids: Iterable[str]) -> GroupSwapper:
        """Every model in the implicit ``(default)`` group: one model at a time."""
        return cls([Group(DEFAULT_GROUP, members=tuple(model_ids))])

    @property
    def groups(self) -> tuple[Group, ...]:
        """The groups as given (the configured ones, then ``(default)`` if it has members)."""
        return self._groups

    def group_of(self, model: str) -> Group:
        """The model's group; ``(default)`` (swap, exclusive) for a model in none."""
        return self._group_of.get(model, self._default)

    def evict(self, target: str, resident: Collection[str]) -> tuple[str, ...]:
        mine = self.group_of(target)
        evicted: set[str] = set()
        for model in resident:
            if model == target:
                continue
            theirs = self.group_of(model)
            if theirs is mine:
                if mine.swap:
                    evicted.add(model)
            elif mine.exclusive and not theirs.persistent:
                evicted.add(model)
        return tuple(sorted(evicted))

    def __repr__(self) -> str:
        return f"GroupSwapper({list(self._groups)!r})"


# --------------------------------------------------------------------------- matrix DSL


class MatrixError(ValueError):
    """An invalid ``matrix`` section. ``where`` is the part at fault, relative to the
    section (``sets.<name>``, ``vars.<key>``, ``evict_costs.<key>``, ``sets``), or ""."""

    def __init__(self, message: str, where: str = "") -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class MatrixSyntaxError(MatrixError):
    """A set's expression does not parse. ``column`` is 1-based (0: not at one place)."""

    def __init__(self, message: str, column: int = 0, where: str = "") -> None:
        self.column = column
        super().__init__(message, where)


class MatrixNameError(MatrixError):
    """A name that is neither a var nor a model id, a ``+ref`` to no set, a bad var."""


class MatrixCycleError(MatrixError):
    """Sets that reference each other in a circle."""


class MatrixSizeError(MatrixError):
    """A set that expands to more than :data:`MAX_COMBINATIONS` combinations."""


@dataclass(frozen=True)
class Model:
    """A name in an expression: a var or a model id (resolved to a model id on compile)."""

    name: str


@dataclass(frozen=True)
class SetRef:
    """``+name``: another set's expression."""

    name: str


@dataclass(frozen=True)
class AllOf:
    """``a & b & ...``: one combination of each part, together."""

    parts: tuple[Expr, ...]


@dataclass(frozen=True)
class AnyOf:
    """``a | b | ...``: the combinations of any part."""

    parts: tuple[Expr, ...]


Expr: TypeAlias = Model | SetRef | AllOf | AnyOf


def _is_name_char(char: str) -> bool:
    return char.isalnum() or char in "_-."


_OPERATORS = "&|()"


def _tokens(text: str) -> list[tuple[str, str, int]]:
    """(kind, text, 1-based column); kinds: the operator itself, ``name``, ``ref``, ``end``."""
    tokens: list[tuple[str, str, int]] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char.isspace():
            i += 1
        elif char in _OPERATORS:
            tokens.append((char, char, i + 1))
            i += 1
        elif char == "+" or _is_name_char(char):
            start = i + 1 if char == "+" else i
            end = start
            while end < len(text) and _is_name_char(text[end]):
                end += 1
            if end == start:
                raise MatrixSyntaxError(
                    f"expected a set name after '+' at column {start + 1}", start + 1
                )
            kind = "ref" if char == "+" else "name"
            tokens.append((kind, text[start:end], i + 1))
            i = end
        else:
            raise MatrixSyntaxError(f"unexpected character {char!r} at column {i + 1}", i + 1)
    tokens.append(("end", "", len(text) + 1))
    return tokens


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.pos = 0

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.pos]

    def take(self) -> tuple[str, str, int]:
        token = self.tokens[self.pos]
        if token[0] != "end":
            self.pos += 1
        return token

    def any_of(self) -> Expr:
        parts = [self.all_of()]
        while self.peek()[0] == "|":
            self.take()
            parts.append(self.all_of())
        return parts[0] if len(parts) == 1 else AnyOf(tuple(parts))

    def all_of(self) -> Expr:
        parts = [self.atom()]
        while self.peek()[0] == "&":
            self.take()
            parts.append(self.atom())
        return parts[0] if len(parts) == 1 else AllOf(tuple(parts))

    def atom(self) -> Expr:
        kind, text, column = self.take()
        if kind == "name":
            return Model(text)
        if kind == "ref":
            return SetRef(text)
        if kind == "(":
            inner = self.any_of()
            closing, text, at = self.take()
            if closing != ")":
                raise MatrixSyntaxError(
                    f"missing ')' for the '(' at column {column}: "
                    f"got {_describe(closing, text)} at column {at}",
                    at,
                )
            return inner
        raise MatrixSyntaxError(
            f"expected a name, '+set' or '(' at column {column}, got {_describe(kind, text)}",
            column,
        )


def _describe(kind: str, text: str) -> str:
    if kind == "end":
        return "the end of the expression"
    if kind == "ref":
        return f"'+{text}'"
    return f"{text!r}"


def parse_dsl(text: str) -> Expr:
    """A matrix set's expression as a tree. Raises :class:`MatrixSyntaxError`."""
    if not text.strip():
        raise MatrixSyntaxError("empty expression")
    parser = _Parser(text)
    expr = parser.any_of()
    kind, token, column = parser.peek()
    if kind != "end":
        raise MatrixSyntaxError(
            f"unexpected {_describe(kind, token)} at column {column} after a complete expression",
            column,
        )
    return expr


def _names(expr: Expr) -> Iterable[Model | SetRef]:
    if isinstance(expr, Model | SetRef):
        yield expr
    else:
        for part in expr.parts:
            yield from _names(part)


# --------------------------------------------------------------------------- matrix solver


@dataclass(frozen=True)
class MatrixSet:
    """One ``sets.<name>`` entry, expanded."""

    name: str
    dsl: str
    combinations: tuple[frozenset[str], ...]
    """The distinct model-id combinations it allows, in expression order (each also
    allows its subsets)."""


@dataclass(frozen=True)
class MatrixDecision:
    """What :meth:`MatrixSwapper.solve` chose."""

    evict: tuple[str, ...]
    """Sorted; never the target."""
    set_name: str | None
    """The set of the chosen combination; None when the target is in no set, or when it is
    resident and no single combination holds everything resident."""
    models: frozenset[str]
    """The combination that will be resident (or may be: only the target is started)."""
    cost: int
    """The sum of the evicted models' costs."""


class MatrixSwapper:
    """llama-swap's matrix router as a pure eviction policy."""

    kind = "matrix"

    def __init__(
        self, sets: Sequence[MatrixSet], evict_costs: Mapping[str, int] | None = None
    ) -> None:
        self._sets = tuple(sets)
        self._costs: Mapping[str, int] = MappingProxyType(dict(evict_costs or {}))
        # model id -> (set name, combination) containing it, in tie-break order
        by_model: dict[str, list[tuple[str, frozenset[str]]]] = {}
        for matrix_set in self._sets:
            for combination in matrix_set.combinations:
                for model in combination:
                    by_model.setdefault(model, []).append((matrix_set.name, combination))
        self._by_model = by_model

    @classmethod
    def compile(
        cls,
        sets: Mapping[str, str] | Sequence[tuple[str, str]],
        models: Collection[str],
        variables: Mapping[str, str] | None = None,
        evict_costs: Mapping[str, int] | None = None,
        aliases: Mapping[str, str] | None = None,
    ) -> MatrixSwapper:
        """Parse, check and expand a ``matrix`` section.

        ``sets``: name -> expression, in definition order. ``models``: the model ids.
        ``variables``: the ``vars`` (short name -> model id). ``evict_costs``: var or model
        id -> cost > 0. ``aliases`` (alias -> model id) only improves error messages: the
        matrix names model ids, as llama-swap's does. Raises a :class:`MatrixError`.
        """
        variables = variables or {}
        aliases = aliases or {}
        definitions = list(sets.items()) if isinstance(sets, Mapping) else list(sets)
        if not definitions:
            raise MatrixError("define at least one set", "sets")

        for name, value in variables.items():
            where = f"vars.{name}"
            if not VAR_NAME.fullmatch(name):
                raise MatrixNameError(
                    f"var names are 1 to 32 letters, digits, '-' or '.', got {name!r}", where
                )
            if value not in models:
                raise MatrixNameError(_unknown_model(value, aliases), where)

        def resolve(name: str) -> str | None:
            return variables.get(name, name if name in models else None)

        costs: dict[str, int] = {}
        cost_key: dict[str, str] = {}
        for key, cost in (evict_costs or {}).items():
            where = f"evict_costs.{key}"
            if isinstance(cost, bool) or not isinstance(cost, int) or cost <= 0:
                raise MatrixError(f"must be a positive integer, got {cost!r}", where)
            model_id = resolve(key)
            if model_id is None:
                raise MatrixNameError(f"unknown var or model {key!r}", where)
            if model_id in costs:
                raise MatrixError(
                    f"model {model_id!r} already has a cost (evict_costs.{cost_key[model_id]})",
                    where,
                )
            costs[model_id] = cost
            cost_key[model_id] = key

        set_names = {name for name, _ in definitions}
        trees: dict[str, Expr] = {}
        dsl: dict[str, str] = {}
        for name, text in definitions:
            where = f"sets.{name}"
            if name in trees:
                raise MatrixError(f"set {name!r} is defined twice", where)
            try:
                tree = parse_dsl(text)
            except MatrixSyntaxError as exc:
                raise MatrixSyntaxError(exc.message, exc.column, where) from None
            for node in _names(tree):
                if isinstance(node, SetRef):
                    if node.name not in set_names:
                        raise MatrixNameError(f"'+{node.name}' names no set", where)
                elif resolve(node.name) is None:
                    raise MatrixNameError(_unknown_name(node.name, aliases), where)
            trees[name] = tree
            dsl[name] = text

        expanded: dict[str, tuple[frozenset[str], ...]] = {}
        order: list[str] = []

        def expand_set(name: str, path: tuple[str, ...]) -> tuple[frozenset[str], ...]:
            if name in expanded:
                return expanded[name]
            if name in path:
                circle = " -> ".join((*path[path.index(name) :], name))
                raise MatrixCycleError(
                    f"sets reference each other in a circle: {circle}", f"sets.{path[0]}"
                )
            combinations = expand(trees[name], (*path, name))
            expanded[name] = combinations
            order.append(name)
            return combinations

        def expand(expr: Expr, path: tuple[str, ...]) -> tuple[frozenset[str], ...]:
            if isinstance(expr, Model):
                model_id = resolve(expr.name)
                assert model_id is not None  # checked above
                return (frozenset({model_id}),)
            if isinstance(expr, SetRef):
                return expand_set(expr.name, path)
            seen: dict[frozenset[str], None] = {}
            if isinstance(expr, AnyOf):
                for part in expr.parts:
                    for combination in expand(part, path):
                        seen.setdefault(combination)
                        _check_size(seen, path)
                return tuple(seen)
            product: tuple[frozenset[str], ...] = (frozenset(),)
            for part in expr.parts:
                right = expand(part, path)
                seen = {}
                for left_combination in product:
                    for right_combination in right:
                        seen.setdefault(left_combination | right_combination)
                        _check_size(seen, path)
                product = tuple(seen)
            return product

        for name, _ in definitions:
            expand_set(name, ())
        return cls(
            [MatrixSet(name, dsl[name], expanded[name]) for name in order], MappingProxyType(costs)
        )

    @property
    def sets(self) -> tuple[MatrixSet, ...]:
        """The sets, expanded, in tie-break order."""
        return self._sets

    @property
    def evict_costs(self) -> Mapping[str, int]:
        """Model id -> cost, for the models whose cost is not :data:`DEFAULT_EVICT_COST`."""
        return self._costs

    def cost_of(self, model: str) -> int:
        return self._costs.get(model, DEFAULT_EVICT_COST)

    def solve(self, target: str, resident: Collection[str]) -> MatrixDecision:
        """The cheapest combination holding ``target`` and what it evicts."""
        present = frozenset(resident)
        if target in present:
            holder = next(
                (name for name, combo in self._by_model.get(target, ()) if present <= combo), None
            )
            return MatrixDecision((), holder, present, 0)
        best: tuple[str, frozenset[str]] | None = None
        best_cost = 0
        for name, combination in self._by_model.get(target, ()):
            cost = sum(self.cost_of(model) for model in present - combination)
            if best is None or cost < best_cost:
                best, best_cost = (name, combination), cost
                if cost == 0:
                    break
        if best is None:
            cost = sum(self.cost_of(model) for model in present)
            return MatrixDecision(tuple(sorted(present)), None, frozenset({target}), cost)
        name, combination = best
        return MatrixDecision(tuple(sorted(present - combination)), name, combination, best_cost)

    def evict(self, target: str, resident: Collection[str]) -> tuple[str, ...]:
        return self.solve(target, resident).evict

    def __repr__(self) -> str:
        return f"MatrixSwapper({[s.name for s in self._sets]!r})"


def _check_size(seen: Mapping[frozenset[str], None], path: tuple[str, ...]) -> None:
    if len(seen) > MAX_COMBINATIONS:
        raise MatrixSizeError(
            f"expands to more than {MAX_COMBINATIONS} combinations of models; "
            "split it into smaller sets",
            f"sets.{path[-1]}",
        )


def _unknown_name(name: str, aliases: Mapping[str, str]) -> str:
    if name in aliases:
        return f"{name!r} is an alias of model {aliases[name]!r}; sets name vars or model ids"
    return f"unknown var or model {name!r}"


def _unknown_model(name: str, aliases: Mapping[str, str]) -> str:
    if name in aliases:
        return f"{name!r} is an alias of model {aliases[name]!r}; vars name model ids"
    return f"unknown model {name!r}"
