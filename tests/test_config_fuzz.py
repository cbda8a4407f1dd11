"""Broken configs, generated: loading one raises ConfigError and nothing else, and
``llamaswap check`` says what is wrong without a traceback.

A seeded mutator takes the corpus (config.example.yaml and tests/configs/*.yaml) and
breaks it the ways people and attackers do: keys deleted or renamed, values of the wrong
type, odd strings, huge numbers, bad URLs, macros used where none is defined, YAML alias
bombs, and the file's text cut or spliced. Each run is bounded by a count and a time.
A failure prints the seed and the case, so it can be replayed.
"""

from __future__ import annotations

import copy
import io
import random
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command

from scheduler.config import ConfigError, load_config, parse_config

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
CORPUS = [ROOT / "config.example.yaml", *sorted((ROOT / "tests" / "configs").glob("*.yaml"))]
ENVIRON = {
    name: "sk-test"
    for name in (
        "OPENROUTER_API_KEY",
        "LLAMASWAP_KEY",
        "BIG_BOX_KEY",
        "IDE_KEY",
        "BATCH_KEY",
        "NEIGHBOUR_KEY",
    )
}
SEED = 19
SECONDS = 3.0
"""Time given to each fuzz loop; it stops earlier at its count."""

ODD: list[Any] = [
    None,
    True,
    0,
    -1,
    2**63,
    -(2**70),
    1e308,
    float("nan"),
    float("-inf"),
    "",
    " ",
    "x",
    "-5",
    "${nope}",
    "${PORT}",
    "${PID}",
    "${MODEL_ID}",
    "${env.NOT_SET}",
    "${env.BIG}",
    "http://[::1",
    "http://[::1]:99999",
    "http://127.0.0.1:99999",
    "http://127.0.0.1:0",
    "http://user:pw@h:1",
    "https://h:1/p?q=1",
    "ftp://h",
    "://",
    "\0",
    "\n\t",
    "é" * 3,
    "a" * 5000,
    "(unclosed",
    "[",
    "interactive",
    "a,b,model",
    "#",
    "'\"",
    "\\",
    [],
    {},
    [None],
    ["x", 1, None],
    {"x": None},
    {"x": {"y": [1, {"z": "${nope}"}]}},
    {"members": ["nope"]},
]
"""Values that are wrong somewhere: types, ranges, URLs, macros, regexes, control bytes."""


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def paths(node: Any, at: tuple[Any, ...] = (), seen: set[int] | None = None) -> list[tuple[Any, ...]]:
    """Key paths in ``node`` (mapping keys and list indexes), each container entered once:
    mutants share subtrees and may contain themselves."""
    seen = set() if seen is None else seen
    found = [at]
    if isinstance(node, dict | list) and id(node) not in seen:
        seen.add(id(node))
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            found += paths(value, (*at, key), seen)
    return found


def mutate(data: dict[str, Any], rng: random.Random) -> None:
    """One change at a random key path, in place."""
    where = rng.choice([p for p in paths(data) if p])
    parent: Any = data
    for step in where[:-1]:
        parent = parent[step]
    last = where[-1]
    roll = rng.random()
    if roll < 0.25:
        parent.pop(last)
    elif roll < 0.75:
        parent[last] = copy.deepcopy(rng.choice(ODD))
    elif roll < 0.85 and isinstance(parent, dict):
        new_key = rng.choice(["", " ", "${x}", 7, None, True, "models", "a" * 300, f"{last}2"])
        parent[new_key] = parent.pop(last)
    elif roll < 0.95:
        # A shared subtree: what an alias gives, so mutations reach more than one key.
        parent[last] = data.get(rng.choice(list(data)))
    else:
        parent[last] = [copy.deepcopy(parent[last])] * rng.randint(2, 50)


def bomb(rng: random.Random) -> str:
    """A billion laughs of random shape, used at a random key."""
    levels, width = rng.randint(3, 12), rng.randint(2, 12)
    lines = ["l0: &l0 [lol]"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * width) + "]")
    key = rng.choice(["macros", "metadata", "hooks", "apiKeys", "peers", "unknownKey"])
    return "\n".join(lines) + f"\n{key}: *l{levels}\n"


def text_mutant(text: str, rng: random.Random) -> str:
    """The file's text cut, spliced, or with a bomb or a recursive alias added."""
    roll = rng.random()
    if roll < 0.3:
        return text[: rng.randrange(len(text))]
    if roll < 0.5:
        a, b = sorted(rng.randrange(len(text)) for _ in range(2))
        return text[:a] + text[b:] + text[a:b]
    if roll < 0.7:
        return bomb(rng) + text
    if roll < 0.8:
        return text + "\nselectors: &r {s: {targets: *r}}\n"
    if roll < 0.9:
        return text.replace("  ", "\t", 1)
    return text + "\nunknown: " + "[" * rng.randint(10, 2000) + "]" * rng.randint(0, 2000) + "\n"


def test_parse_raises_only_config_errors() -> None:
    rng = random.Random(SEED)
    corpus = [load(p) for p in CORPUS]
    environ = {**ENVIRON, "BIG": "y" * 10_000}
    deadline = time.monotonic() + SECONDS
    tried = refused = 0
    while tried < 3000 and time.monotonic() < deadline:
        data = copy.deepcopy(rng.choice(corpus))
        for _ in range(rng.randint(1, 4)):
            mutate(data, rng)
        tried += 1
        try:
            parse_config(data, environ=environ)
        except ConfigError:
            refused += 1
        except Exception as exc:
            pytest.fail(f"case {tried} (seed {SEED}): {type(exc).__name__}: {exc}\n{data!r:.2000}")
    assert tried >= 100 and refused > tried // 2  # enough cases, and broken ones


def test_load_raises_only_config_errors(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    texts = [p.read_text() for p in CORPUS]
    path = tmp_path / "config.yaml"
    deadline = time.monotonic() + SECONDS
    tried = 0
    while tried < 500 and time.monotonic() < deadline:
        path.write_text(text_mutant(rng.choice(texts), rng))
        tried += 1
        try:
            load_config(path)
        except ConfigError:
            pass
        except Exception as exc:
            pytest.fail(f"case {tried} (seed {SEED}): {type(exc).__name__}: {exc}\n{path.read_text():.2000}")
    assert tried >= 50


def test_check_never_prints_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``llamaswap check`` (the management command, in process) on generated broken files:
    exit status 1 with an ``error:`` line naming the key or the file, or 0; never another
    exception (which the console script would print as a traceback)."""
    for name, value in ENVIRON.items():
        monkeypatch.setenv(name, value)
    rng = random.Random(SEED + 1)
    corpus = [load(p) for p in CORPUS]
    texts = [p.read_text() for p in CORPUS]
    path = tmp_path / "config.yaml"
    deadline = time.monotonic() + SECONDS
    tried = failed = 0
    while tried < 300 and time.monotonic() < deadline:
        if rng.random() < 0.5:
            data = copy.deepcopy(rng.choice(corpus))
            for _ in range(rng.randint(1, 3)):
                mutate(data, rng)
            try:
                path.write_text(yaml.safe_dump(data, allow_unicode=True))
            except (yaml.YAMLError, RecursionError, ValueError):
                continue  # not every mutant is writable as YAML (a cycle, a NaN key)
        else:
            path.write_text(text_mutant(rng.choice(texts), rng))
        tried += 1
        out, err = io.StringIO(), io.StringIO()
        try:
            call_command("check_config", str(path), stdout=out, stderr=err)
        except SystemExit as exit:
            assert exit.code == 1
            failed += 1
            assert f"{path}: error: " in err.getvalue(), err.getvalue()
        assert "Traceback" not in out.getvalue() + err.getvalue()
    assert tried >= 20 and failed > 0
