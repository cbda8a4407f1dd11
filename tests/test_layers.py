"""Arrows point one way: each package imports only the packages below it, and no module
imports itself back through others.

    scheduler.core  <  scheduler  <  activity | control  <  web | fleet  <  proxy | dashboard
        <  llamaswap_site

``proxy`` and ``dashboard`` share a rank and import nothing of each other: what both need
(OpenAI-shaped errors, the path tables, the cross-site rule) lives in ``web`` below them.
``fakellm`` (the simulated model server) imports nothing of the project. The pure core
imports nothing of Django, asyncio, httpx or a clock: time comes in as an argument.

Read from the source (ast), every import counted: at module level and inside functions
(a lazy import still ties two modules together), absolute and relative. So a new import
that breaks the order, closes a circle, takes another module's private name, or a module
that outgrows a reader fails here.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RANK = {
    "fakellm": 0,
    "scheduler.core": 0,
    "scheduler": 1,
    "activity": 2,
    "control": 2,
    "web": 3,
    "fleet": 3,
    "proxy": 4,
    "dashboard": 4,
    "llamaswap_site": 5,
}
"""Each package's place. Packages of one rank are siblings: neither imports the other."""
PACKAGES = (
    "fakellm",
    "scheduler",
    "activity",
    "control",
    "web",
    "fleet",
    "proxy",
    "dashboard",
    "llamaswap_site",
)
CORE_FORBIDDEN = {"django", "asyncio", "httpx", "time", "channels", "daphne", "twisted"}

MAX_LINES = 600
"""Non-blank lines a product module may have: past that, split it by concern."""
STILL_SPLITTING: set[str] = set()
"""Modules allowed over the cap while a split is under way (none now)."""


def layer(module: str) -> str | None:
    if module == "scheduler.core" or module.startswith("scheduler.core."):
        return "scheduler.core"
    top = module.split(".")[0]
    return top if top in RANK else None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCES = [
    p for top in PACKAGES for p in sorted((ROOT / top).rglob("*.py")) if "migrations" not in p.parts
]
MODULES = {module_name(p): p for p in SOURCES}


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def imports(path: Path, module: str | None = None) -> list[str]:
    """Every name a module imports (``from a import b`` gives ``a`` and ``a.b``), relative
    imports made absolute, function-level ones included."""
    module = module or module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call):
            found += loaded_by_name(node)
    return found


LOADERS = {"import_string", "import_module", "__import__"}
"""Calls that import what a string names (``django.utils.module_loading.import_string``,
``importlib.import_module``): a project module named in one is imported all the same."""


def loaded_by_name(call: ast.Call) -> list[str]:
    """The project module (or name in it) a string literal given to a loader names:
    ``import_string("dashboard.settings_store.stored_settings")`` imports ``dashboard``."""
    func = call.func
    called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
    if called not in LOADERS or not call.args:
        return []
    first = call.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return [first.value] if layer(first.value) is not None else []
    return []


def project_module(name: str) -> str | None:
    """The project module an imported name lives in (``a.b.f`` -> ``a.b``), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


@cache
def graph() -> dict[str, frozenset[str]]:
    edges = {}
    for module, path in MODULES.items():
        targets = {project_module(name) for name in imports(path)}
        edges[module] = frozenset(t for t in targets if t is not None and t != module)
    return edges


def cycles(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative),
    each as one circle through it: ``[a, b, c, a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(circle(edges, set(component)))
    return found


def circle(edges: dict[str, frozenset[str]], component: set[str]) -> list[str]:
    """A shortest circle from the component's first module back to itself (breadth first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle in {sorted(component)}")


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    module = module_name(path)
    mine = layer(module)
    assert mine is not None
    for name in imports(path):
        theirs = layer(name)
        if theirs is None:
            if mine == "scheduler.core":
                assert name.split(".")[0] not in CORE_FORBIDDEN, f"{module} imports {name}"
            continue
        if theirs == mine:
            continue
        assert RANK[theirs] < RANK[mine], f"{module} ({mine}) imports {name} ({theirs})"


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_takes_another_ones_private_names(path):
    """A name with a leading underscore is its module's own: what another module needs is
    made public where it lives (or moved), never reached into."""
    taken = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree(path))
        if isinstance(node, ast.ImportFrom) and node.module and layer(node.module) is not None
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert not taken, f"{module_name(path)} imports private names: {', '.join(taken)}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_readable(path):
    name = str(path.relative_to(ROOT))
    lines = sum(1 for line in path.read_text().splitlines() if line.strip())
    if name in STILL_SPLITTING and lines > MAX_LINES:
        pytest.skip(f"{name}: {lines} non-blank lines, being split")
    assert lines <= MAX_LINES, f"{name} has {lines} non-blank lines (over {MAX_LINES}): split it"


# -- the checks themselves -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"a": {"b"}, "b": set()}, []),  # a line is not a circle
        ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),  # two modules
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c", "a"]]),  # three
        # one component, the shortest circle through its first module named
        ({"a": {"b", "c"}, "b": {"c"}, "c": {"a"}}, [["a", "c", "a"]]),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b", "a"], ["c", "d", "c"]]),
    ],
)
def test_cycles_finds_every_circle(edges, expected):
    frozen = {k: frozenset(v) for k, v in edges.items()}
    assert sorted(cycles(frozen)) == expected


def test_imports_count_lazy_and_relative_ones(tmp_path):
    source = tmp_path / "thing.py"
    source.write_text(
        "from . import views\nfrom .errors import echo\n"
        "def f():\n    from dashboard.live import current\n"
    )
    found = set(imports(source, "proxy.thing"))
    assert {"proxy.views", "proxy.errors.echo", "dashboard.live.current"} <= found


def test_a_module_named_in_a_string_to_a_loader_is_an_import(tmp_path):
    """The old dodge of ``simulate --from-history`` (a scheduler command loading the
    dashboard's settings store by name) is an upward import like any other."""
    source = tmp_path / "simulate.py"
    source.write_text(
        "import importlib\n"
        "from django.utils.module_loading import import_string\n"
        "def from_history():\n"
        '    stored_settings = import_string("dashboard.settings_store.stored_settings")\n'
        '    history = importlib.import_module("activity.history")\n'
        '    yaml = importlib.import_module("yaml")\n'
        "    return import_string(stored_settings)\n"
    )
    found = imports(source, "scheduler.management.commands.simulate")
    loaded = [name for name in found if name.startswith(("dashboard.", "activity.", "yaml"))]
    assert loaded == ["dashboard.settings_store.stored_settings", "activity.history"]
    upward = [n for n in loaded if RANK[layer(n) or ""] >= RANK["scheduler"]]
    assert upward == loaded  # test_imports_point_down fails on either
