"""Where a proxied request's CPU goes, by stage: daphne's floor against what the product adds.

``python -m bench.relay_stages [--seconds S] [--stream] [--rate HZ]`` (not part of
``make bench``; needs ``py-spy``: ``PY_SPY=/path/to/py-spy``, else ``py-spy`` on PATH).

Starts ``bench proxy``'s fifo server (one fake model), and ``bench/bare.py`` under daphne
(the stack's floor: an ASGI app with no framework), loads each with 16 keep-alive clients
for ``--seconds`` while py-spy samples the server's threads (only samples of running
threads count, so a sample is CPU time however loaded the machine is), and sorts every
sample by the innermost frame of a known stage on its stack. Prints, per stage, the share
of samples and the CPU µs per request it stands for (the process's utime + stime over the
window, divided by the requests answered, split by the shares), beside daphne alone's CPU
per request.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import machine, markdown_table
from bench.bench_proxy import (
    CHAT,
    PY,
    ROOT,
    Conn,
    Proc,
    Server,
    cpu_seconds,
    post_bytes,
    raise_nofile,
    rps,
)
from scheduler.testing import free_port

# (stage, substrings of a frame "function (file:line)"). A sample goes to the innermost frame
# of a stage on its stack; the generic stages (asyncio, Django's database layer) only when
# no other stage's frame encloses it: a socket write under proxy/upstream.py is the
# upstream send's, a select() under Twisted's reactor daphne's, as in daphne alone.
GENERIC = {"asyncio event loop (select, callbacks)", "Django database layer"}
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("garbage collection", ("collector.py",)),
    ("log lines (logging)", ("logging/__init__.py", "logfmt.py", "scheduler/proxylog.py")),
    (
        "activity log, journal, metrics observers",
        ("activity/", "observers.py", "prometheus"),
    ),
    (
        "dispatcher (admission, pick, grant, announcements)",
        ("scheduler/dispatch", "scheduler/core", "scheduler/lanes", "scheduler/tickets"),
    ),
    ("turn (proxy/turn.py)", ("proxy/turn.py",)),
    ("upstream request build, send, read (proxy/upstream.py)", ("proxy/upstream.py",)),
    ("httpx objects (URL, Request, Response, Headers)", ("httpx/",)),
    ("relay (proxy/relay.py)", ("proxy/relay.py",)),
    ("usage figures (proxy/usage.py)", ("proxy/usage.py",)),
    ("routing (proxy/routing.py)", ("proxy/routing.py",)),
    ("view: body parse, checks (proxy/views.py)", ("proxy/views.py", "web/cancel.py")),
    ("access check, CORS (web/access.py, web/cors.py)", ("web/access.py", "web/cors.py")),
    ("body read (read_body)", ("read_body",)),
    ("handler: tasks, disconnect watch (proxy/handler.py)", ("proxy/handler.py",)),
    (
        "Django request/response (ASGIRequest, HttpResponse, URL resolve, send)",
        ("django/core/handlers", "django/http", "django/urls", "django/utils", "django/views"),
    ),
    ("asgi router (llamaswap_site/asgi.py, channels)", ("llamaswap_site/asgi.py", "channels/")),
    ("daphne reply hooks (http_server.py)", ("http_server.py",)),
    ("Django database layer", ("django/db",)),
    ("asyncio event loop (select, callbacks)", ("asyncio/", "selectors.py")),
    ("daphne + Twisted", ("daphne/", "twisted/")),
]
SLEEPING = "sleeping (time.sleep: not CPU, left out)"


def py_spy() -> str:
    found = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not found:
        sys.exit(
            "py-spy not found: pip install --target /tmp/tools py-spy; PY_SPY=/tmp/tools/bin/py-spy"
        )
    return found


def stage_of(stack: list[str], root: Path = ROOT) -> str:
    """``stack``: frames outermost first (py-spy's raw format); ``root``: the copy of the
    repository the sampled server runs (its source lines tell a sleep)."""
    if stack and _sleeps(stack[-1], root):
        return SLEEPING
    generic = None
    for frame in reversed(stack):
        for stage, marks in STAGES:
            if any(mark in frame for mark in marks):
                if stage not in GENERIC:
                    return stage
                generic = generic or stage
                break
    return generic or "other"


def _sleeps(frame: str, root: Path = ROOT) -> bool:
    """Is ``frame`` (innermost) a ``time.sleep`` call of this repository's code? py-spy
    counts a thread in a short sleep as running."""
    where = frame.rpartition("(")[2].rstrip(")")
    path, _, line = where.rpartition(":")
    source = root / path
    if not line.isdigit() or not source.is_file():
        return False
    lines = _source(source)
    return 0 < int(line) <= len(lines) and "sleep(" in lines[int(line) - 1]


_SOURCES: dict[Path, list[str]] = {}


def _source(path: Path) -> list[str]:
    if path not in _SOURCES:
        _SOURCES[path] = path.read_text().splitlines()
    return _SOURCES[path]


def profile(
    port: int, pid: int, seconds: float, rate: int, out: Path, stream: bool, root: Path = ROOT
) -> dict:
    """16 clients on ``port`` for ``seconds`` while py-spy samples ``pid``."""
    spy = subprocess.Popen(
        [
            py_spy(),
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--nonblocking",
            "--threads",
            "--output",
            str(out),
            "--duration",
            str(int(seconds) + 2),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # py-spy attached
    cpu0 = cpu_seconds(pid)
    body = dict(CHAT, stream=True) if stream else CHAT
    result = rps(port, pid, seconds, body=body, warmup=0.0)
    cpu1 = cpu_seconds(pid)
    spy.wait(timeout=seconds + 30)
    counts: collections.Counter[str] = collections.Counter()
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if n.isdigit():  # a frame's text can hold a newline (py-spy shows source lines)
            counts[stage_of(stack.split(";"), root)] += int(n)
    return {"counts": counts, "cpu_s": cpu1 - cpu0, **result}


class Bare(Proc):
    """daphne serving ``bench/bare.py``: no framework at all."""

    def __init__(self, tmp: Path) -> None:
        port = free_port()
        cmd = [PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "bench.bare:app"]
        super().__init__(cmd, port, None, tmp / "bare.log")


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m bench.relay_stages")
    parser.add_argument("--seconds", type=float, default=6.0, help="per server per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", type=int, default=400)
    parser.add_argument("--stream", action="store_true", help="streaming chat (SSE) requests")
    parser.add_argument(
        "--before",
        type=Path,
        help="another copy of the repository (e.g. `git archive` of a commit): its server "
        "alternates with this one's, round by round, for a before/after table",
    )
    parser.add_argument("--keep", type=Path, help="copy py-spy's raw stacks into this folder")
    args = parser.parse_args(argv)
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="bench-relay-stages-"))
    procs: list[Server | Proc] = []
    sides: dict[str, tuple[int, int]] = {}
    results: dict[str, list[dict]] = {}
    try:
        roots = {"after": ROOT} if args.before is None else {"before": args.before, "after": ROOT}
        for name, root in roots.items():
            # A database each: one server's activity writer never waits on the other's lock.
            own = tmp / name
            own.mkdir()
            env = dict(os.environ, DATABASE_URL=f"sqlite:///{own / 'db.sqlite3'}")
            subprocess.run(
                [PY, "manage.py", "migrate", "-v", "0"], cwd=root, env=env, check=True, timeout=120
            )
            server = Server(own, name, "fifo", False, root=root)
            procs.append(server)
            server.wait_ready()
            with Conn(server.port, timeout=60) as c:
                c.send(post_bytes(server.port, CHAT))
            sides[name] = (server.port, server.pid)
        bare = Bare(tmp)
        procs.append(bare)
        bare.wait_ready("/")
        sides["daphne"] = (bare.port, bare.pid)
        order = list(sides)
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                port, pid = sides[name]
                out = tmp / f"{name}-{r}.txt"
                stream = args.stream and name != "daphne"
                print(f"  round {r + 1}/{args.rounds}: {name} ...", flush=True)
                results.setdefault(name, []).append(
                    profile(port, pid, args.seconds, args.rate, out, stream, roots.get(name, ROOT))
                )
    finally:
        for proc in reversed(procs):
            proc.stop()
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            for raw in tmp.glob("*.txt"):
                shutil.copy(raw, args.keep / raw.name)
        shutil.rmtree(tmp, ignore_errors=True)
    return report({name: merge(runs) for name, runs in results.items()}, args)


def merge(runs: list[dict]) -> dict:
    counts: collections.Counter[str] = collections.Counter()
    for run in runs:
        counts.update(run["counts"])
    return {
        "counts": counts,
        "cpu_s": sum(run["cpu_s"] for run in runs),
        "requests": sum(run["requests"] for run in runs),
        "errors": sum(run["errors"] for run in runs),
    }


def report(sides: dict[str, dict], args: argparse.Namespace) -> str:
    floor = sides.pop("daphne")
    floor_req = floor["cpu_s"] / max(floor["requests"], 1) * 1e6
    per_req, shares, asleep = {}, {}, {}
    for name, side in sides.items():
        per_req[name] = side["cpu_s"] / max(side["requests"], 1) * 1e6
        counts = side["counts"]
        asleep[name] = counts.pop(SLEEPING, 0)
        total = sum(counts.values()) or 1
        shares[name] = {stage: n / total for stage, n in counts.items()}
    names = list(sides)
    stages = sorted(
        {s for name in names for s in shares[name]}, key=lambda s: -shares["after"].get(s, 0)
    )
    header = ["stage (innermost known frame)"]
    for name in names:
        label = "" if len(names) == 1 else f"{name}: "
        header += [f"{label}share of samples", f"{label}CPU µs per request"]
    rows = []
    for stage in stages:
        row = [stage]
        for name in names:
            share = shares[name].get(stage, 0.0)
            row += [f"{share:.1%}", f"{per_req[name] * share:,.0f}"]
        rows.append(row)
    total_row = ["**whole request (utime + stime over the requests answered)**"]
    for name in names:
        total_row += ["100%", f"{per_req[name]:,.0f}"]
    rows.append(total_row)
    kind = "streaming chat (SSE)" if args.stream else "JSON chat"
    counts_text = "; ".join(
        f"{name}: {sides[name]['requests']:,} requests, {sum(sides[name]['counts'].values()):,} "
        f"samples on CPU ({asleep[name]:,} more in a `time.sleep`, left out), "
        f"{sides[name]['errors']} errors"
        for name in names
    )
    command = "python -m bench.relay_stages" + (" --stream" if args.stream else "")
    command += f" --rounds {args.rounds} --seconds {args.seconds:g}"
    if args.before is not None:
        command += " --before DIR"
    lines = [
        f"`{command}`. Machine: {machine()}; load average {Path('/proc/loadavg').read_text().split()[0]} "
        f"after. {kind}, 16 keep-alive clients, {args.rounds} rounds of {args.seconds:g} s per "
        f"server, the servers alternating (fifo, one fake model answering at once); py-spy at "
        f"{args.rate} Hz. {counts_text}. daphne alone (`bench/bare.py`, JSON): "
        f"{floor['requests']:,} requests, {floor_req:,.0f} µs CPU each.",
        "",
        markdown_table(header, rows),
        "",
        "CPU per request / daphne alone's: "
        + ", ".join(f"{name} {per_req[name] / floor_req:.2f}×" for name in names),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
