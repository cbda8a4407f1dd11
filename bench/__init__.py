"""Micro-benchmarks. ``python -m bench`` runs them all; ``--write`` updates BENCHMARKS.md.

A bench module lives in this package, is listed in ``bench.__main__.MODULES`` and has a
``main() -> str`` that prints its own progress and returns a markdown section (a table
and a line or two of context). ``--write`` puts that section in BENCHMARKS.md between
``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``, NAME being the module name without
its ``bench_`` prefix.
"""

from __future__ import annotations

import math
import os
import platform
import re
from collections.abc import Sequence
from pathlib import Path


def machine() -> str:
    """One line naming the machine: CPUs, CPU model, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"nproc {os.cpu_count()}, CPU {cpu}, "
        f"{platform.python_implementation()} {platform.python_version()} on {platform.system()}"
    )


def quantile_us(samples_ns: Sequence[int], q: float) -> float:
    """Nearest-rank quantile (``q`` in 0..1) of nanosecond samples, in microseconds."""
    ordered = sorted(samples_ns)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1] / 1000


def fmt_us(value: float) -> str:
    if value >= 1000:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table; the first column left-aligned, the others right-aligned."""
    align = [":--", *("--:" for _ in header[1:])]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def write_section(path: Path, name: str, body: str) -> None:
    """Replace the text between the ``bench:NAME`` markers (append them if absent)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.strip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + f"\n\n{block}\n"
    path.write_text(text, encoding="utf-8")
