"""``llamaswap simulate TRACE --nodes``: a trace replayed on a fleet before placement is
deployed, through the real command (a subprocess, as an operator runs it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def crossed(tmp_path) -> Path:
    """Two models, and a round robin in front of two nodes that hands each node qwen and
    llama in turn: where it arrives, every request is a cold load."""
    path = tmp_path / "crossed.jsonl"
    models = ("qwen", "llama", "llama", "qwen")
    path.write_text(
        "".join(
            json.dumps({"arrival": i * 2.0, "model": models[i % 4], "priority": 0, "service": 1})
            + "\n"
            for i in range(120)
        )
    )
    return path


def simulate(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "manage.py", "simulate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


def test_a_fleet_replay_shows_what_placement_buys(crossed):
    out = simulate(str(crossed), "--nodes", "box-a,box-b", "--load-seconds", "qwen=3")
    assert "120 requests on 2 nodes (box-a, box-b" in out
    for row in ("interactive wait p95", "normal wait p95", "swaps (cold loads)"):
        assert row in out
    assert (
        "where it arrives: requests run per node: box-a 60, box-b 60; placed on another "
        "node than they arrived at: 0" in out
    )
    placed = re.search(
        r"^placement: requests run per node: box-a (\d+), box-b (\d+); "
        r"placed on another node than they arrived at: (\d+)$",
        out,
        re.M,
    )
    assert placed, out
    a, b, moved = map(int, placed.groups())
    assert a + b == 120 and moved > 0  # some requests went to the node their model is warm on


def test_the_json_report_names_each_node(crossed):
    out = StringIO()
    call_command("simulate", str(crossed), "--nodes", "3", "--json", stdout=out)
    report = json.loads(out.getvalue())
    assert report["nodes"] == ["node-1", "node-2", "node-3"]
    where, placed = report["runs"]
    assert where["placement"] is False and where["placed"] == 0
    assert where["per_node"] == {"node-1": 40, "node-2": 40, "node-3": 40}
    assert placed["placement"] is True and sum(placed["per_node"].values()) == 120
    assert placed["result"]["swaps"] < where["result"]["swaps"]


@pytest.mark.parametrize(
    "nodes, problem",
    [
        ("box-a,,box-b", "distinct names"),
        ("a,a", "distinct names"),
        ("0", "1 to 64"),
        ("65", "1 to 64"),
    ],
)
def test_bad_nodes_are_named(crossed, nodes, problem):
    with pytest.raises(CommandError, match=problem):
        call_command("simulate", str(crossed), "--nodes", nodes, stdout=StringIO())
    with pytest.raises(CommandError, match="one lane per node"):
        call_command(
            "simulate", str(crossed), "--nodes", "2", "--lanes", "g=qwen", stdout=StringIO()
        )
