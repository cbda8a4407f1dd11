"""The GPU's idle time between serial jobs, measured at the model, 1,000 waiting.

A real ``manage.py serve`` (serial scheduler, the product's defaults) relays to
``bench.stampmodel``, a raw asyncio model server that answers at once and notes when each
request arrived and when the last byte of its answer was handed to the kernel
(CLOCK_MONOTONIC, which both processes read). The gap of job n+1 is its arrival at the model
minus the end of job n's answer: time the GPU would sit idle although 1,000 requests wait.

1,001 keep-alive client connections keep a request each in flight (one running, 1,000
waiting): as an answer comes back its connection sends the next request, so new arrivals
compete with the job change exactly as under steady load. Priorities mix 100/0/-100.

The breakdown comes from a second server, the same code started through
``bench/stages.py`` (a wrapper that notes the clock at each stage), in the same run: end of
the upstream answer (model) -> read by the proxy -> ``finish`` -> dispatcher task runs ->
pick -> grant -> the dispatcher's step done -> view resumes -> first write to the model's
socket -> arrival at the model. Modes alternate in rounds on fresh servers.

The stack's floor comes from a third server in the same rounds, with the same client and
pinning: ``bench/bare_relay.py``, daphne with no framework relaying one request at a time
in arrival order over one raw keep-alive connection. Its gap is what daphne and the event
loop leave when the relay does nothing else; the product's gap is reported as a ratio to it.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import machine, markdown_table
from bench.bench_proxy import (
    CLIENT_CPU,
    PHASE_TIMEOUT_S,
    PY,
    ROOT,
    SERVER_CPU,
    Conn,
    Floor,
    Proc,
    Server,
    _read_response,
    cpu_seconds,
    pinning,
    raise_nofile,
)
from scheduler.testing import free_port

WAITING = 1_000
WARMUP_JOBS = 500
JOBS = 2_000
ROUNDS = 2
SERVICE_S = (0.0, 0.005)
"""Job lengths at the model: answered at once, and a short (embedding-sized) job."""
TARGET_P50_MS = 0.5
TARGET_P99_MS = 2.0
PRIORITIES = ("100", "0", "-100")

STAGES = [
    ("read", "the proxy has read the model's whole answer"),
    ("finish", "`Dispatcher.finish` called (turn closed)"),
    ("handle", "dispatcher task takes the event"),
    ("pick", "pick starts"),
    ("picked", "pick returns"),
    ("grant", "`_grant`: the ticket's future resolved"),
    ("turned", "`_start_turn` returns (dispatch log line, observers)"),
    ("resume", "the granted view resumes (`Turn.wait` returns)"),
    ("write", "first write of the request to the model's socket"),
]


def _post(port: int, priority: str, service_s: float = 0.0) -> bytes:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nX-LlamaSwap-Priority: {priority}\r\n"
        f"X-Stamp-Delay: {service_s:g}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _load(
    port: int, jobs: int, service_s: float, pid: int | None = None, connections: int = WAITING + 1
) -> dict:
    """WAITING + 1 connections, each sending its next request as its answer arrives,
    until ``jobs`` answers came back. With ``pid``: that process's CPU time per answer
    after the warm-up (``cpu_ms``), and answers per second (``rps``)."""
    done = {"ok": 0, "errors": 0}
    finished = asyncio.Event()
    marks: list[tuple[float, float, int]] = []

    def mark() -> None:
        if pid is not None:
            marks.append((time.perf_counter(), cpu_seconds(pid), done["ok"] + done["errors"]))

    async def client(i: int) -> None:
        raw = _post(port, PRIORITIES[i % 3], service_s)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        try:
            while not finished.is_set():
                writer.write(raw)
                status = await _read_response(reader)
                done["ok" if status == 200 else "errors"] += 1
                if done["ok"] + done["errors"] == min(WARMUP_JOBS, jobs // 4):
                    mark()
                if done["ok"] + done["errors"] >= jobs and not finished.is_set():
                    mark()
                    finished.set()
        finally:
            writer.close()

    tasks = []
    for start in range(0, connections, 40):  # under the listen backlog
        tasks += [
            asyncio.create_task(client(i)) for i in range(start, min(start + 40, connections))
        ]
        await asyncio.sleep(0.02)
    async with asyncio.timeout(PHASE_TIMEOUT_S * 3):
        await finished.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if len(marks) == 2:
        (t0, c0, n0), (t1, c1, n1) = marks
        done["cpu_ms"] = (c1 - c0) * 1000 / (n1 - n0)
        done["rps"] = (n1 - n0) / (t1 - t0)
    return done


def _stamps(model_port: int) -> list[list[int]]:
    with Conn(model_port, timeout=30) as c:
        return json.loads(c.get("/stamps").body)


def _gaps(rows: list[list[int]]) -> list[int]:
    """Arrival of each job minus the end of the answer before it, in ns."""
    rows = [r for r in rows if r[1]]
    return [b[0] - a[1] for a, b in zip(rows, rows[1:], strict=False) if b[0] >= a[1]]


DURATIONS = [
    ("log", 'the dispatcher\'s log calls (`log.info("dispatch")`, `log.debug("finished")`)'),
    ("fields", "`Dispatcher._fields`: the log line's fields, built even for a DEBUG line"),
    ("notify", "observer callbacks (`on_finish`, `on_dispatch`, `on_enqueue`)"),
    ("add", "new arrivals filed in the queue (its `add`) before the pick"),
    ("gc", "cyclic garbage collection"),
    (
        "snapshot",
        "the dashboard's live snapshot (every 0.1 s while a dashboard is open; none is in this bench)",
    ),
    ("record", "activity-log batch written (Django's worker thread; holds the GIL in parts)"),
]


def _intervals(events: list[tuple[str, int]]) -> dict[str, list[tuple[int, int]]]:
    """``kind0``/``kind1`` stamp pairs as (start, end) per kind, in time order."""
    kinds = {kind for kind, _ in DURATIONS}
    open_at: dict[str, int] = {}
    out: dict[str, list[tuple[int, int]]] = {kind: [] for kind in kinds}
    for name, ns in events:
        kind, edge = name[:-1], name[-1:]
        if kind not in kinds:
            continue
        if edge == "0":
            open_at[kind] = ns
        elif kind in open_at:
            out[kind].append((open_at.pop(kind), ns))
    return out


def _overlap(spans: list[tuple[int, int]], starts: list[int], lo: int, hi: int) -> int:
    """Nanoseconds of ``spans`` (sorted by start) inside [lo, hi]."""
    total = 0
    i = max(0, bisect.bisect_left(starts, lo) - 1)
    while i < len(spans) and spans[i][0] < hi:
        a, b = spans[i]
        total += max(0, min(b, hi) - max(a, lo))
        i += 1
    return total


def _breakdown(rows: list[list[int]], events: list[tuple[str, int]]) -> dict[str, list[int]]:
    """Per gap, the time from the previous stage to each stage (ns), matched on the clock:
    the stages that follow the end of job n's answer, up to job n+1's arrival; and per
    gap the time spent in each of DURATIONS inside it (``dur:KIND``)."""
    rows = [r for r in rows if r[1]]
    spans = _intervals(events)
    starts = {kind: [a for a, _ in v] for kind, v in spans.items()}
    events = [e for e in events if e[0][-1:] not in "01"]
    per: dict[str, list[int]] = {kind: [] for kind, _ in STAGES}
    per["arrive"] = []
    per["total"] = []
    for kind, _ in DURATIONS:
        per[f"dur:{kind}"] = []
    i = 0
    for a, b in zip(rows, rows[1:], strict=False):
        end, arrive = a[1], b[0]
        while i < len(events) and events[i][1] < end:
            i += 1
        found: dict[str, int] = {}
        j = i
        order = [kind for kind, _ in STAGES]
        k = 0
        while j < len(events) and events[j][1] <= arrive and k < len(order):
            kind, ns = events[j]
            if kind == order[k]:
                found[kind] = ns
                k += 1
            j += 1
        if len(found) != len(order):
            continue
        prev = end
        for kind in order:
            per[kind].append(found[kind] - prev)
            prev = found[kind]
        per["arrive"].append(arrive - prev)
        per["total"].append(arrive - end)
        for kind, _ in DURATIONS:  # inside the proxy's part: up to the write
            per[f"dur:{kind}"].append(_overlap(spans[kind], starts[kind], end, found["write"]))
    return per


def _relay_run(tmp: Path, pin: bool, n: int, service_s: float) -> tuple[list[int], dict]:
    """The gaps behind ``bench/bare_relay.py`` (the stack's floor) under the same load."""
    model_port, port = free_port(), free_port()
    model = Proc(
        [PY, "-m", "bench.stampmodel", "--host", "127.0.0.1", "--port", str(model_port)],
        model_port,
        CLIENT_CPU if pin else None,
        tmp / f"relaymodel-{n}.log",
    )
    relay = None
    try:
        model.wait_ready()
        relay = Proc(
            [PY, "-m", "bench.bare_relay", "--port", str(port)]
            + ["--upstream", f"127.0.0.1:{model_port}"],
            port,
            SERVER_CPU if pin else None,
            tmp / f"relay-{n}.log",
        )
        relay.wait_ready()
        with Conn(port, timeout=PHASE_TIMEOUT_S) as c:
            for _ in range(20):
                if (r := c.send(_post(port, "0"))).status != 200:
                    raise RuntimeError(f"relay warm-up: HTTP {r.status} {r.body[:300]!r}")
        _stamps(model_port)
        load = asyncio.run(_load(port, WARMUP_JOBS + JOBS, service_s, relay.pid))
        rows = _stamps(model_port)[WARMUP_JOBS:]
    finally:
        if relay is not None:
            relay.stop()
        model.stop()
    return _gaps(rows), load


def _run(
    tmp: Path, pin: bool, staged: bool, n: int, service_s: float
) -> tuple[list[int], dict | None, dict]:
    out = tmp / f"stages-{n}.jsonl" if staged else None
    server = Server(
        tmp,
        f"gap{n}{'s' if staged else ''}",
        "serial",
        pin,
        model_module="bench.stampmodel",
        stages_out=out,
    )
    try:
        server.wait_ready()
        with Conn(server.port, timeout=PHASE_TIMEOUT_S) as c:  # loads the model
            for _ in range(20):
                if (r := c.send(_post(server.port, "0"))).status != 200:
                    raise RuntimeError(f"warm-up: HTTP {r.status} {r.body[:300]!r}")
        _stamps(server.model_port)
        load = asyncio.run(_load(server.port, WARMUP_JOBS + JOBS, service_s, server.pid))
        rows = _stamps(server.model_port)[WARMUP_JOBS:]
    finally:
        server.stop()
    breakdown = None
    if out is not None:
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        events = [tuple(x) for x in lines if len(x) == 2]
        breakdown = _breakdown(rows, events)  # type: ignore[arg-type]
        for name, count, total in (x for x in lines if len(x) == 3):
            breakdown[f"gcstats:{name[-1]}"] = [count, total]
    return _gaps(rows), breakdown, load


REFERENCES = [
    ("bare", "daphne alone: an ASGI app with no framework answering at once (`bench/bare.py`)"),
    (
        "floor",
        "the minimal relay (`bench/floor.py`: Django view + httpx) in front of the same model",
    ),
]


REF_CONNECTIONS = 16
"""The references' clients: their best case. At 1,001 connections the minimal relay's httpx
pool queues the requests and its CPU time per request grows 20-fold."""


def _reference(tmp: Path, pin: bool, kind: str, connections: int = REF_CONNECTIONS) -> dict:
    """CPU time per request of a reference server under the gap's client (keep-alive
    connections, each sending its next request when its answer came; answered at once)."""
    server_cpu = SERVER_CPU if pin else None
    procs: list[Proc] = []
    try:
        if kind == "bare":
            port = free_port()
            ref: Proc = Proc(
                [PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "bench.bare:app"],
                port,
                server_cpu,
                tmp / "bare.log",
            )
            procs.append(ref)
            ref.wait_ready("/")
        else:
            model_port = free_port()
            model = Proc(
                [PY, "-m", "bench.stampmodel", "--host", "127.0.0.1", "--port", str(model_port)],
                model_port,
                CLIENT_CPU if pin else None,
                tmp / "stampmodel.log",
            )
            procs.append(model)
            model.wait_ready()
            ref = Floor(tmp, model_port, pin)
            procs.append(ref)
            ref.wait_ready()
        return asyncio.run(_load(ref.port, WARMUP_JOBS + JOBS, 0.0, ref.pid, connections))
    finally:
        for proc in reversed(procs):
            proc.stop()


def ms(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered)) - 1))] / 1e6


def main() -> str:
    print(f"== gap: idle time at the model between serial jobs, {WAITING:,} waiting ==")
    started = time.perf_counter()
    pin = pinning()
    old_affinity = os.sched_getaffinity(0) if pin else None
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gap-"))
    results: dict[float, Result] = {s: Result() for s in SERVICE_S}
    refs: dict[str, list[tuple[float, float]]] = {}
    errors = 0
    loads: list[float] = []  # the 1-minute load average before each run: shared cores
    try:
        if pin:
            os.sched_setaffinity(0, {CLIENT_CPU})
        env = dict(os.environ, DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}")
        subprocess.run(
            [PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120
        )
        n = 0
        for r in range(ROUNDS):
            for service in SERVICE_S:
                res = results[service]
                modes = ("product", "staged", "floor")
                for what in modes if r % 2 == 0 else modes[::-1]:
                    n += 1
                    loads.append(os.getloadavg()[0])
                    print(
                        f"  round {r + 1}, {service * 1000:g} ms jobs: {what} "
                        f"(load {loads[-1]:.1f}) ...",
                        flush=True,
                    )
                    if what == "floor":
                        g, load = _relay_run(tmp, pin, n, service)
                        res.floor += g
                        if "cpu_ms" in load:
                            res.floor_cpu.append((load["cpu_ms"], load["rps"]))
                    else:
                        g, b, load = _run(tmp, pin, what == "staged", n, service)
                        if what == "staged":
                            res.staged += g
                            for kind, values in (b or {}).items():
                                res.per.setdefault(kind, []).extend(values)
                        else:
                            res.gaps += g
                            if "cpu_ms" in load:
                                res.cpu.append((load["cpu_ms"], load["rps"]))
                    res.errors += load["errors"]
                    print(f"    gap p50 {ms(g, 0.5):.2f} ms, p99 {ms(g, 0.99):.2f} ms ({len(g)})")
            for kind, _ in REFERENCES:
                print(f"  round {r + 1}, reference: {kind} ...", flush=True)
                load = _reference(tmp, pin, kind)
                refs.setdefault(kind, []).append((load["cpu_ms"], load["rps"]))
                errors += load["errors"]
                print(f"    {load['cpu_ms']:.3f} ms CPU per request, {load['rps']:.0f}/s")
    finally:
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return report(results, refs, errors, time.perf_counter() - started, pin, loads)


@dataclass
class Result:
    gaps: list[int] = field(default_factory=list)
    staged: list[int] = field(default_factory=list)
    per: dict[str, list[int]] = field(default_factory=dict)
    errors: int = 0
    cpu: list[tuple[float, float]] = field(default_factory=list)
    """Per product round: (the server's CPU ms per job, jobs per second)."""
    floor: list[int] = field(default_factory=list)
    """The gaps behind ``bench/bare_relay.py``, the stack's floor."""
    floor_cpu: list[tuple[float, float]] = field(default_factory=list)


def _job(service: float) -> str:
    return f"{service * 1000:g} ms jobs" if service else "jobs answered at once"


def report(
    results: dict[float, Result],
    refs: dict[str, list[tuple[float, float]]],
    ref_errors: int,
    elapsed: float,
    pin: bool,
    loads: list[float] | None = None,
) -> str:
    rows = []
    verdicts = []
    for service, res in results.items():
        gaps, staged = res.gaps, res.staged
        p50, p99 = ms(gaps, 0.5), ms(gaps, 0.99)
        rows.append(
            [
                f"{_job(service)}: product",
                f"{p50:.3f}",
                f"{p99:.3f}",
                f"{ms(gaps, 0.999):.3f}",
                f"{len(gaps):,}",
            ]
        )
        rows.append(
            [
                f"{_job(service)}: the same code with stage stamps",
                f"{ms(staged, 0.5):.3f}",
                f"{ms(staged, 0.99):.3f}",
                f"{ms(staged, 0.999):.3f}",
                f"{len(staged):,}",
            ]
        )
        floor = res.floor
        if floor:
            rows.append(
                [
                    f"{_job(service)}: the stack's floor (`bench/bare_relay.py`)",
                    f"{ms(floor, 0.5):.3f}",
                    f"{ms(floor, 0.99):.3f}",
                    f"{ms(floor, 0.999):.3f}",
                    f"{len(floor):,}",
                ]
            )
            rows.append(
                [
                    f"{_job(service)}: product ÷ floor",
                    *(f"{ms(gaps, q) / (ms(floor, q) or 1e-9):.1f}×" for q in (0.5, 0.99, 0.999)),
                    "",
                ]
            )
        ok50, ok99 = p50 <= TARGET_P50_MS, p99 <= TARGET_P99_MS
        verdicts.append(
            f"{_job(service)}: p50 {p50:.2f} ms {'met' if ok50 else '**missed**'}, "
            f"p99 {p99:.2f} ms {'met' if ok99 else '**missed**'}"
            + (
                f" (the floor: {ms(floor, 0.5):.2f} / {ms(floor, 0.99):.2f} ms; the product "
                f"{p50 / (ms(floor, 0.5) or 1e-9):.1f}× / {p99 / (ms(floor, 0.99) or 1e-9):.1f}× it)"
                if floor
                else ""
            )
        )
    labels = dict(STAGES)
    labels["arrive"] = "job n+1 arrives at the model"
    stage_rows = []
    prev = "end of job n's answer (model)"
    for kind in labels:
        cells = [f"→ {labels[kind]}"]
        for res in results.values():
            values = res.per.get(kind) or [0]
            total = statistics.fmean(res.per.get("total") or [1])
            mean = statistics.fmean(values)
            cells += [
                f"{ms(values, 0.5) * 1000:.0f}",
                f"{ms(values, 0.99) * 1000:.0f}",
                f"{mean / total * 100:.0f}%",
            ]
        stage_rows.append(cells)
        prev = labels[kind]
    del prev
    stage_header = ["from the stage above (first: end of job n's answer at the model)"]
    for service in results:
        stage_header += [f"{_job(service)}: p50 µs", "p99 µs", "share of mean"]
    dur_header = ["inside the gaps (staged server)"]
    for service in results:
        dur_header += [
            f"{_job(service)}: mean µs per gap",
            "share of mean gap",
            "slowest 1% of gaps: share",
            "touched",
        ]
    dur_rows = []
    for kind, label in DURATIONS:
        cells = [label]
        for res in results.values():
            values = res.per.get(f"dur:{kind}") or []
            totals = res.per.get("total") or []
            if not values or not totals:
                cells += ["", "", "", ""]
                continue
            cut = sorted(totals)[int(len(totals) * 0.99)]
            slow = [i for i, t in enumerate(totals) if t >= cut]
            slow_total = sum(totals[i] for i in slow) or 1
            cells += [
                f"{statistics.fmean(values) / 1000:.1f}",
                f"{sum(values) / (sum(totals) or 1) * 100:.1f}%",
                f"{sum(values[i] for i in slow) / slow_total * 100:.0f}%",
                f"{sum(1 for i in slow if values[i]) / max(len(slow), 1) * 100:.0f}%",
            ]
        dur_rows.append(cells)
    gc_notes = []
    for service, res in results.items():
        parts = []
        for generation in (0, 1, 2):
            values = res.per.get(f"gcstats:{generation}") or []
            count, total = sum(values[0::2]), sum(values[1::2])
            if count:
                parts.append(
                    f"generation {generation}: {count:,} collections, "
                    f"{total / count / 1000:,.0f} µs each"
                )
        if parts:
            gc_notes.append(f"{_job(service)}: " + "; ".join(parts))
    errors = sum(r.errors for r in results.values())
    cpu_rows = []
    floor_cpu = statistics.fmean(c for c, _ in refs["floor"]) if refs.get("floor") else 0.0
    for kind, label in REFERENCES:
        values = refs.get(kind) or []
        if values:
            cpu = statistics.fmean(c for c, _ in values)
            rate = statistics.fmean(r for _, r in values)
            cpu_rows.append(
                [
                    label,
                    f"{cpu:.3f}",
                    f"{cpu / floor_cpu:.2f}×" if floor_cpu else "",
                    f"{rate:,.0f}",
                ]
            )
    for service, res in results.items():
        if res.floor_cpu:
            cpu = statistics.fmean(c for c, _ in res.floor_cpu)
            rate = statistics.fmean(r for _, r in res.floor_cpu)
            cpu_rows.append(
                [
                    f"the stack's floor (`bench/bare_relay.py`), {_job(service)}, "
                    f"{WAITING + 1:,} connections",
                    f"{cpu:.3f}",
                    f"{cpu / floor_cpu:.2f}×" if floor_cpu else "",
                    f"{rate:,.0f}",
                ]
            )
    for service, res in results.items():
        if res.cpu:
            cpu = statistics.fmean(c for c, _ in res.cpu)
            rate = statistics.fmean(r for _, r in res.cpu)
            cpu_rows.append(
                [
                    f"the product, {_job(service)} (all of the server's threads)",
                    f"{cpu:.3f}",
                    f"{cpu / floor_cpu:.2f}×" if floor_cpu else "",
                    f"{rate:,.0f}",
                ]
            )
    placement = "proxy on core 0, model and clients on core 1" if pin else "no CPU pinning"
    load = (
        f"; load average (1 min) {min(loads):.1f}–{max(loads):.1f} over the runs, "
        "the cores shared with other work"
        if loads
        else ""
    )
    lines = [
        "`.venv/bin/python -m bench gap` (`make bench` runs all benches). "
        f"Machine: {machine()}. One run, {elapsed:.0f} s; {placement}{load}.",
        "",
        markdown_table(["gap at the model, ms", "p50", "p99", "p99.9", "gaps"], rows),
        "",
        f"Serial scheduler, product defaults, {WAITING:,} requests waiting throughout "
        f"({WAITING + 1:,} keep-alive connections, each sending its next request when its answer "
        f"arrives; priorities 100/0/-100), {JOBS:,} jobs per round after {WARMUP_JOBS} warm-up, "
        f"{ROUNDS} rounds per server and job length, servers alternating, {errors} errors. The "
        "model is `bench/stampmodel.py` (raw asyncio): it answers after the job's length; gap = "
        "arrival of job n+1 at the model minus the moment the last byte of job n's answer left "
        "it (CLOCK_MONOTONIC in both processes). With jobs answered at once the proxy has no "
        "idle time to do the rest of its work in (the client's answer, the next arrival), so "
        "that gap is its whole CPU time per job; with real jobs that work overlaps the next job. "
        "The stack's floor: `bench/bare_relay.py`, daphne with no framework (as "
        "`bench/bare.py`) relaying the requests one at a time in arrival order (an "
        "`asyncio.Queue` and one worker task) over one raw asyncio keep-alive connection to "
        "the same model, no httpx, no Django, no scheduler; started in the same rounds with "
        "the same client, job lengths and pinning.",
        "",
        "CPU time per request under the same load (the server process's user + system time "
        f"over the {JOBS:,} answers after the warm-up, divided by them; means of {ROUNDS} rounds; "
        f"references: the same client with {REF_CONNECTIONS} connections, their best case, and "
        f"the same pinning, answered at once, {ref_errors} errors):",
        "",
        markdown_table(
            ["server", "CPU ms per request", "× the minimal relay", "answers/s"], cpu_rows
        ),
        "",
        "Where the gap goes (the same server started through `bench/stages.py`, which notes "
        "the clock at each stage; gaps with every stage seen):",
        "",
        markdown_table(stage_header, stage_rows),
        "",
        "Time spent inside the gaps, across stages, from the end of job n's answer to the "
        'write of job n+1 (the same staged runs; "touched": the share of the slowest 1% of '
        "gaps that overlap it at all):",
        "",
        markdown_table(dur_header, dur_rows),
        "",
        "Garbage collections in the staged server over its whole run: "
        + (". ".join(gc_notes) or "none")
        + ".",
        "",
        f"Target (p50 ≤ {TARGET_P50_MS:g} ms, p99 ≤ {TARGET_P99_MS:g} ms): "
        + "; ".join(verdicts)
        + ".",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
