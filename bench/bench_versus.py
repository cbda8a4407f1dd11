"""The proxy figures beside llama-swap itself: direct, the minimal relay, llamaswap and
llama-swap on the very same model process, in alternated rounds, in one run.

``bench proxy``'s fifo server (``manage.py serve``, ``routing.scheduler.use: fifo``, model
``m`` on ``python -m fakellm``), the minimal relay (``bench/floor.py``) relaying to that model's
port, and llama-swap (``../shared/tools/llama-swap/llama-swap`` or ``$LLAMA_SWAP``) whose
model ``m`` points at the same port (its ``cmd`` only sleeps: the model is already there, so
its health check passes at once). Each proxy is pinned to core 0 in turn under load; the
model and this client share core 1 (as in ``bench proxy``). Measured, with every side in
each round (sides alternate request by request for latency, run by run for the rest):

* added time to the whole JSON answer and to the first SSE event (side − direct), p50/p99;
* requests/s with 16 clients on keep-alive connections and the proxy's CPU per 1,000;
* events/s on one 20,000-event stream (best run of each side).

Where llama-swap is absent the section says so and the other sides are measured alone.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from bench import machine, markdown_table, quantile_us
from bench.bench_proxy import (
    CHAT,
    CLIENT_CPU,
    PY,
    ROOT,
    SERVER_CPU,
    STREAM_TOKENS,
    Conn,
    Floor,
    Proc,
    Server,
    pinning,
    post_bytes,
    raise_nofile,
    rps,
    stream_rates,
)
from scheduler.testing import free_port

LLAMA_SWAP = Path(
    os.environ.get("LLAMA_SWAP", ROOT.parent / "shared" / "tools" / "llama-swap" / "llama-swap")
)
ROUNDS = 3
LAT_WARMUP = 30
LAT_SAMPLES = 200
"""Per side per round, for JSON and for SSE."""
RPS_SECONDS = 3.0
STREAM_RUNS = 3
PROXIES = ("floor", "llamaswap", "llama-swap")
LABELS = {
    "direct": "direct",
    "floor": "minimal relay",
    "llamaswap": "llamaswap",
    "llama-swap": "llama-swap (Go)",
}


class LlamaSwap(Proc):
    """llama-swap with one model ``m`` whose upstream is ``model_port`` (already running)."""

    def __init__(self, tmp: Path, model_port: int, pin: bool) -> None:
        config = {
            "healthCheckTimeout": 15,
            "models": {
                "m": {
                    "cmd": "sleep 86400",
                    "proxy": f"http://127.0.0.1:{model_port}",
                    "checkEndpoint": "/health",
                    "concurrencyLimit": 64,
                }
            },
        }
        path = tmp / "llama-swap.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        cmd = [str(LLAMA_SWAP), "-config", str(path), "-listen", f"127.0.0.1:{port}"]
        super().__init__(cmd, port, SERVER_CPU if pin else None, tmp / "llama-swap.log")


def latency(ports: dict[str, int], stream: bool, samples: dict[str, list[int]]) -> None:
    """LAT_SAMPLES sequential requests per side, the sides in turn request by request, one
    keep-alive connection each; appends ns to ``samples`` (JSON: whole answer read; SSE:
    first body piece holding an event)."""
    req = dict(CHAT, stream=True) if stream else CHAT
    raws = {side: post_bytes(port, req) for side, port in ports.items()}
    with contextlib.ExitStack() as stack:
        conns = {side: stack.enter_context(Conn(port)) for side, port in ports.items()}
        for i in range(LAT_WARMUP + LAT_SAMPLES):
            for side, conn in conns.items():
                t0 = time.perf_counter_ns()
                r = conn.send(raws[side])
                if r.status != 200:
                    raise RuntimeError(f"{side}: HTTP {r.status}: {r.body[:200]!r}")
                end = r.first_event_ns if stream else r.done_ns
                if i >= LAT_WARMUP:
                    samples[side].append(end - t0)


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main() -> str:
    print("== versus: direct, minimal relay, llamaswap, llama-swap on one model ==")
    started = time.perf_counter()
    pin = pinning()
    have_ls = LLAMA_SWAP.is_file() and os.access(LLAMA_SWAP, os.X_OK)
    load_before = load()
    old_affinity = os.sched_getaffinity(0) if pin else None
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="bench-versus-"))
    procs: list[Proc | Server] = []
    try:
        if pin:
            os.sched_setaffinity(0, {CLIENT_CPU})
        env = dict(os.environ, DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}")
        subprocess.run(
            [PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120
        )
        ours = Server(tmp, "fifo", "fifo", pin)
        procs.append(ours)
        ours.wait_ready()
        with Conn(ours.port, timeout=60) as c:  # loads the model
            if (resp := c.send(post_bytes(ours.port, CHAT))).status != 200:
                raise RuntimeError(f"first request: HTTP {resp.status} {resp.body[:300]!r}")
        floor = Floor(tmp, ours.model_port, pin)
        procs.append(floor)
        floor.wait_ready()
        ports = {"direct": ours.model_port, "floor": floor.port, "llamaswap": ours.port}
        pids = {"floor": floor.pid, "llamaswap": ours.pid}
        if have_ls:
            theirs = LlamaSwap(tmp, ours.model_port, pin)
            procs.append(theirs)
            theirs.wait_ready("/health")
            with Conn(theirs.port, timeout=60) as c:  # starts its (sleeping) model
                if (resp := c.send(post_bytes(theirs.port, CHAT))).status != 200:
                    raise RuntimeError(f"llama-swap: HTTP {resp.status} {resp.body[:300]!r}")
            ports["llama-swap"] = theirs.port
            pids["llama-swap"] = theirs.pid
        proxies = [p for p in PROXIES if p in ports]
        lat: dict[str, dict[str, list[int]]] = {
            kind: {side: [] for side in ports} for kind in ("json", "sse")
        }
        rates: dict[str, list[dict]] = {side: [] for side in proxies}
        events: dict[str, list[float]] = {side: [] for side in ports}
        for r in range(ROUNDS):
            print(f"  round {r + 1}/{ROUNDS}: latency ...", flush=True)
            gc.disable()  # a collection in the client is noise on every side
            latency(ports, False, lat["json"])
            latency(ports, True, lat["sse"])
            gc.enable()
            gc.collect()
            order = proxies if r % 2 == 0 else proxies[::-1]
            for side in order:
                print(f"  round {r + 1}/{ROUNDS}: requests/s, {side} ...", flush=True)
                rates[side].append(rps(ports[side], pids[side], RPS_SECONDS))
            print(f"  round {r + 1}/{ROUNDS}: one long stream ...", flush=True)
            for side, result in stream_rates(ports, runs=1).items():
                events[side] += result["runs_s"]
    finally:
        for proc in reversed(procs):
            proc.stop()
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
        shutil.rmtree(tmp, ignore_errors=True)
    return report(lat, rates, events, have_ls, pin, load_before, time.perf_counter() - started)


def _ratio(mine: float, other: float) -> str:
    return f"{mine / other:.2f}×" if other > 0 else "–"


def report(
    lat: dict[str, dict[str, list[int]]],
    rates: dict[str, list[dict]],
    events: dict[str, list[float]],
    have_ls: bool,
    pin: bool,
    load_before: str,
    elapsed: float,
) -> str:
    sides = [s for s in ("direct", *PROXIES) if s in lat["json"]]
    proxies = [s for s in PROXIES if s in sides]
    header = ["measure", *(LABELS[s] for s in sides)]
    if have_ls:
        header.append("llamaswap / llama-swap")
    rows = []

    def add(label: str, values: dict[str, float], fmt: str) -> None:
        row = [label] + [fmt.format(values[s]) if s in values else "–" for s in sides]
        if have_ls:
            row.append(_ratio(values["llamaswap"], values["llama-swap"]))
        rows.append(row)

    for kind, what in (("json", "whole JSON answer"), ("sse", "first SSE event")):
        for q, name in ((0.5, "p50"), (0.99, "p99")):
            direct = quantile_us(lat[kind]["direct"], q) / 1000
            added = {s: quantile_us(lat[kind][s], q) / 1000 - direct for s in proxies}
            added_row = {"direct": direct, **added}
            label = f"added time to the {what}, {name}, ms (direct: the time itself)"
            add(label, added_row, "{:+.2f}")
            rows[-1][1] = f"{direct:.2f}"

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    add(
        "requests/s, 16 clients (median of rounds)",
        {s: median([x["rps"] for x in rates[s]]) for s in proxies},
        "{:,.0f}",
    )
    add(
        "proxy CPU s per 1,000 requests (median of rounds)",
        {s: median([x["cpu_ms"] for x in rates[s]]) for s in proxies},
        "{:.2f}",
    )
    add(
        f"events/s, one {STREAM_TOKENS:,}-event stream (best of rounds)",
        {s: max(events[s]) for s in sides},
        "{:,.0f}",
    )
    n = len(lat["json"]["direct"])
    lines = [
        f"`.venv/bin/python -m bench versus`. Machine: {machine()}; load average {load_before} "
        f"before, {load()} after (other agents' test suites share the machine). One run, "
        f"{elapsed:.0f} s, {ROUNDS} rounds; latency {n} samples per side and kind, sides "
        f"alternating request by request; requests/s {RPS_SECONDS:g} s per proxy per round, "
        "the order reversed every other round; "
        + ("proxies pinned to core 0, the model and the client to core 1." if pin else "unpinned."),
        "",
        markdown_table(header, rows),
        "",
        "Same model process for every side (`python -m fakellm`, answers at once); llama-swap's "
        "`concurrencyLimit` 64 like the product's (its default would refuse 16 clients). "
        "The product is ahead where the ratio is below 1× for times and CPU, above 1× for "
        "requests/s and events/s.",
    ]
    if not have_ls:
        lines += ["", f"llama-swap not measured: no executable at `{LLAMA_SWAP}`."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
