"""Before and after on the same machine: ``python -m bench.ab REV [--rounds N]``.

These machines drift by 2x between runs, so a figure from an earlier session says little
about a change. This runs the proxy benchmark's latency, stream and waiting-memory phases
for the code at ``REV`` (a git worktree in a temporary folder) and for the working tree,
interleaved round by round, each in a fresh server, and prints the medians side by side:
latency as time added over calling the model server directly (each tree with its own
simulated model server), the stream as a ratio to direct and to the minimal relay
(``bench/floor.py``), CPU per event of 64 paced streams over the relay's, the peak memory
of a 50 MiB upload in copies of the body, memory per waiting request, and the dispatch gap
at the model (5 ms jobs, 1,000 waiting: bench/bench_gap.py); ``--gap-only``: the gap alone, with both
job lengths and its CPU pinning, quantiles p50/p99/p99.9. Both trees are measured by
the working tree's ``bench/`` (copied into the worktree of ``REV``): the same client code
on both sides, only the product differs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs inside the tree under test, with that tree's bench/bench_proxy.py.
PROBE = r"""
import asyncio, gc, json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import subprocess
from bench import bench_gap as g, bench_proxy as b
b.WAITING = 4000
out = {}
tmp = Path(tempfile.mkdtemp())
subprocess.run([b.PY, "manage.py", "migrate", "-v", "0"], cwd=b.ROOT, check=True,
               env=dict(__import__("os").environ, DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}"))
s = b.Server(tmp, "fifo", "fifo", False)
f = None
try:
    s.wait_ready()
    with b.Conn(s.port, timeout=60) as c:
        c.send(b.post_bytes(s.port, b.CHAT))
    f = b.Floor(tmp, s.model_port, False)
    f.wait_ready()
    gc.disable()
    for stream in (False, True):
        lat = b.latency(s, stream=stream)
        key = "sse" if stream else "json"
        for q in (0.5, 0.99):
            out[f"{key}_added_p{round(q * 100)}_ms"] = lat.ms("proxy", q) - lat.ms("direct", q)
    gc.enable()
    rates = b.stream_rates({"direct": s.model_port, "floor": f.port, "proxy": s.port})
    out["stream_proxy_over_direct"] = rates["proxy"]["chunks_s"] / rates["direct"]["chunks_s"]
    out["stream_proxy_over_relay"] = rates["proxy"]["chunks_s"] / rates["floor"]["chunks_s"]
    relay = b.paced(f.port, f.pid)["cpu_us_per_event"]
    proxy = b.paced(s.port, s.pid)["cpu_us_per_event"]
    out["paced_cpu_per_event_over_relay"] = proxy / relay
    body, ctype = b._multipart(b.BIG_UPLOAD)
    out["upload_50mib_peak_copies"] = b.upload(s.port, s.pid, body, ctype, runs=2)["copies"]
finally:
    if f is not None:
        f.stop()
    s.stop()
gaps, _, _ = g._run(tmp, False, False, 1, 0.005)
out["gap_5ms_jobs_p50_ms"] = g.ms(gaps, 0.5)
out["gap_5ms_jobs_p99_ms"] = g.ms(gaps, 0.99)
s = b.Server(tmp, "serial", "serial", False)
try:
    s.wait_ready()
    with b.Conn(s.port, timeout=60) as c:
        for _ in range(50):
            c.send(b.post_bytes(s.port, b.CHAT))
    w = asyncio.run(b._waiting(s))
    out["kb_per_waiting"] = (w["rss_during"] - w["rss_before"]) / w["waiting"]
finally:
    s.stop()
print("AB " + json.dumps(out))
"""

GAP_PROBE = r"""
import json, os, subprocess, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from bench import bench_gap as g, bench_proxy as b
b.raise_nofile()
tmp = Path(tempfile.mkdtemp())
subprocess.run([b.PY, "manage.py", "migrate", "-v", "0"], cwd=b.ROOT, check=True,
               env=dict(os.environ, DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}"))
pin = g.pinning()
if pin:
    os.sched_setaffinity(0, {b.CLIENT_CPU})
out = {}
for n, (label, service) in enumerate((("5ms_jobs", 0.005), ("jobs_at_once", 0.0))):
    gaps, _, _ = g._run(tmp, pin, False, n, service)
    for q in (0.5, 0.99, 0.999):
        out[f"gap_{label}_p{q * 100:g}_ms"] = g.ms(gaps, q)
print("AB " + json.dumps(out))
"""


def probe(tree: Path, gap_only: bool = False) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", GAP_PROBE if gap_only else PROBE, str(tree)],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in done.stdout.splitlines():
        if line.startswith("AB "):
            return json.loads(line[3:])
    raise RuntimeError(f"probe failed in {tree}: {done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__)
    parser.add_argument("rev", help="the git revision to compare with, e.g. HEAD~5")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--gap-only",
        action="store_true",
        help="only the dispatch gap (5 ms jobs and jobs answered at once, pinned as in bench gap)",
    )
    args = parser.parse_args()
    before = Path(tempfile.mkdtemp(prefix="bench-ab-")) / "tree"
    subprocess.run(
        ["git", "worktree", "add", "-f", str(before), args.rev],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    # The same measuring code on both sides: the working tree's bench/.
    shutil.rmtree(before / "bench", ignore_errors=True)
    shutil.copytree(ROOT / "bench", before / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    try:
        for n in range(args.rounds):
            for name, tree in (("before", before), ("after", ROOT)):
                print(f"round {n + 1}: {name} ...", flush=True)
                results[name].append(probe(tree, args.gap_only))
                print(
                    "  " + ", ".join(f"{k} {v:.2f}" for k, v in results[name][-1].items()),
                    flush=True,
                )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT)
    print(f"\n| measure (median of {args.rounds}) | {args.rev} | working tree | after/before |")
    print("| --- | --: | --: | --: |")
    for key in results["before"][0]:
        b = statistics.median(r[key] for r in results["before"])
        a = statistics.median(r[key] for r in results["after"])
        print(f"| {key} | {b:,.2f} | {a:,.2f} | {a / b:.2f}× |")


if __name__ == "__main__":
    main()
