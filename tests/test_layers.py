"""Arrows point one way: each layer imports only the layers below it.

    scheduler.core  <  scheduler  <  activity  <  proxy, dashboard  <  llamaswap_site

The pure core imports nothing of Django, asyncio, httpx or a clock: time comes in as an
argument. Read from the source (ast), so a new import that breaks the order fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RANK = {"scheduler.core": 0, "scheduler": 1, "activity": 2, "proxy": 3, "dashboard": 3, "llamaswap_site": 4}
CORE_FORBIDDEN = {"django", "asyncio", "httpx", "time", "channels", "daphne", "twisted"}


def layer(module: str) -> str | None:
    if module == "scheduler.core" or module.startswith("scheduler.core."):
        return "scheduler.core"
    top = module.split(".")[0]
    return top if top in RANK else None


def imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


SOURCES = [
    p
    for top in ("scheduler", "activity", "proxy", "dashboard", "llamaswap_site")
    for p in sorted((ROOT / top).rglob("*.py"))
    if "migrations" not in p.parts
]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    mine = layer(module)
    assert mine is not None
    for name in imports(path):
        theirs = layer(name)
        if theirs is None:
            if mine == "scheduler.core":
                assert name.split(".")[0] not in CORE_FORBIDDEN, f"{module} imports {name}"
            continue
        assert RANK[theirs] <= RANK[mine], f"{module} ({mine}) imports {name} ({theirs})"
