"""Run the benchmarks: ``python -m bench [NAME ...] [--write]``."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from bench import machine, write_section

# Add a module here to have `make bench` run it (see bench/__init__.py).
MODULES = [
    "bench.bench_queue",
    "bench.bench_lanes",
    "bench.bench_dispatch_gap",
    "bench.bench_gap",
    "bench.bench_proxy",
    "bench.bench_overload",
    "bench.bench_journal",
    "bench.bench_swap",
    "bench.bench_versus",
    "bench.bench_dashboard",
]

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def section_name(module: str) -> str:
    return module.rsplit(".", 1)[-1].removeprefix("bench_")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("names", nargs="*", help="run only these (e.g. queue); default all")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md sections")
    args = parser.parse_args(argv)
    known = {section_name(m): m for m in MODULES}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown bench {', '.join(unknown)} (known: {', '.join(known)})")
    print(f"machine: {machine()}\n")
    for name in args.names or list(known):
        section = importlib.import_module(known[name]).main()
        print(f"\n{section}\n")
        if args.write:
            write_section(BENCHMARKS_MD, name, section)
            print(f"wrote section {name!r} of {BENCHMARKS_MD.name}")


if __name__ == "__main__":
    main()
