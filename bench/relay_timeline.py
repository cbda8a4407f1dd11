"""Where one relayed request's added time goes: a timeline, stage by stage.

``python -m bench.relay_timeline [--requests N] [--pause MS]``: the fifo server
of ``bench proxy`` (model ``m`` on ``bench/stampmodel.py``, which notes when each request
arrived and when its answer left) started through ``bench/stages.py`` with the request
path's stamps (``BENCH_STAGES_REQUEST_PATH``); one client on a keep-alive connection sends
a chat completion, waits for the whole answer, pauses (``--pause``, 1 ms: in ``bench versus``
the sides alternate, so the proxy is idle between its requests), and so on. Every clock is
``CLOCK_MONOTONIC``, shared by the three processes.

Each request's window (client send → client has the answer) is cut at the first stamp of
each stage, in the order a request passes them; a stage missing from a window drops that
request from the table. Printed: p50 and p90 µs of each step and the steps' sum.

Then the sides in turn, request by request (as in ``bench versus``, so each server starts
each request with caches the others used): the model directly, daphne alone
(``bench/bare.py``: an ASGI app with no framework that answers at once, no model behind
it: the fixed stack's floor), llama-swap (``$LLAMA_SWAP``, when present) and llamaswap in
front of the same model; p50, p99 and the added p50 (side − direct). Proxies pinned to
core 0, model and client to core 1, as in ``bench versus``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench import machine, quantile_us
from bench.bench_proxy import (
    CHAT,
    CLIENT_CPU,
    PY,
    ROOT,
    SERVER_CPU,
    Conn,
    Proc,
    Server,
    pinning,
    post_bytes,
)
from bench.bench_versus import LLAMA_SWAP, LlamaSwap, load
from scheduler.testing import free_port

ORDER = [
    ("rx", "client send → Twisted hands daphne the bytes"),
    ("parsed", "→ daphne has the whole request"),
    ("app", "→ the proxy's handler starts (daphne's application instance, router)"),
    ("submit", "→ the view puts the request in line (body, Django request, URL, view)"),
    ("arrived", "→ the dispatcher task takes the arrival"),
    ("grant", "→ the turn is granted"),
    ("resume", "→ the view resumes"),
    ("write", "→ the request's first byte goes to the model's socket"),
    ("model", "→ the model has the request (model's stamp)"),
    ("answered", "→ the model's answer left it (model's stamp)"),
    ("headers", "→ the proxy has read the answer's headers"),
    ("read", "→ the proxy has the whole answer (Turn.note)"),
    ("finish", "→ the turn's end is posted (Dispatcher.finish)"),
    ("reply", "→ daphne is given the response's start"),
    ("tx", "→ Twisted writes the answer to the client's socket"),
    ("done", "→ the client has the whole answer"),
]
BETWEEN = ("handle", "turned", "log0", "notify0", "record0", "gc0", "disp0", "body")
"""Stamps counted between ``reply`` and ``tx``: what runs before the answer goes out."""


def _client(port: int, raw: bytes, n: int, pause_s: float) -> list[tuple[int, int]]:
    windows = []
    with Conn(port, timeout=30) as c:
        for _ in range(n):
            t0 = time.monotonic_ns()
            r = c.send(raw)
            t1 = time.monotonic_ns()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {r.body[:200]!r}")
            windows.append((t0, t1))
            time.sleep(pause_s)
    return windows


def _stamps(model_port: int) -> list[list[int]]:
    with Conn(model_port, timeout=30) as c:
        return json.loads(c.get("/stamps").body)


def _timeline(
    windows: list[tuple[int, int]], rows: list[list[int]], events: list[tuple[str, int]]
) -> tuple[dict[str, list[int]], dict[str, int]]:
    steps: dict[str, list[int]] = {kind: [] for kind, _ in ORDER}
    between = dict.fromkeys(BETWEEN, 0)
    events.sort(key=lambda e: e[1])
    i = 0
    for (t0, t1), (arrived, answered, *_) in zip(windows, rows, strict=True):
        while i < len(events) and events[i][1] < t0:
            i += 1
        found = {"model": arrived, "answered": answered, "done": t1}
        j = i
        want = [k for k, _ in ORDER if k not in found]
        k = 0
        seen: list[str] = []
        while j < len(events) and events[j][1] <= t1:
            kind, ns = events[j]
            if k < len(want) and kind == want[k] and kind not in found:
                # the model's stamps sit between write and headers
                found[kind] = ns
                k += 1
            elif "reply" in found and "tx" not in found:
                seen.append(kind)
            j += 1
        if len(found) != len(ORDER):
            continue
        prev = t0
        for kind, _ in ORDER:
            steps[kind].append(found[kind] - prev)
            prev = found[kind]
        for kind in seen:
            if kind in between:
                between[kind] += 1
        if os.environ.get("TIMELINE_SHOW") and len(steps["done"]) % 200 == 1:
            base = t0
            print(" ".join(f"{kind}+{(ns - base) // 1000}" for kind, ns in events[i:j]))
    return steps, between


def _sides(ports: dict[str, int], n: int, pause_s: float) -> dict[str, list[int]]:
    """``n`` sequential requests per side, the sides in turn request by request (as in
    ``bench versus``), one keep-alive connection each: ns from send to the whole answer."""
    raws = {side: post_bytes(port, CHAT) for side, port in ports.items()}
    out: dict[str, list[int]] = {side: [] for side in ports}
    with contextlib.ExitStack() as stack:
        conns = {side: stack.enter_context(Conn(port)) for side, port in ports.items()}
        for i in range(50 + n):
            for side, conn in conns.items():
                t0 = time.monotonic_ns()
                r = conn.send(raws[side])
                t1 = time.monotonic_ns()
                if r.status != 200:
                    raise RuntimeError(f"{side}: HTTP {r.status}: {r.body[:200]!r}")
                if i >= 50:
                    out[side].append(t1 - t0)
                time.sleep(pause_s)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--pause", type=float, default=1.0, help="ms between requests")
    args = parser.parse_args()
    pin = pinning()
    if pin:
        os.sched_setaffinity(0, {CLIENT_CPU})
    pause = args.pause / 1000
    print(f"machine: {machine()}; load average {load()} before")
    have_ls = LLAMA_SWAP.is_file() and os.access(LLAMA_SWAP, os.X_OK)
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        out = tmp / "stages.jsonl"
        os.environ["BENCH_STAGES_REQUEST_PATH"] = "1"
        env = dict(os.environ, DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}")
        subprocess.run(  # the activity log writes its records, as on a served box
            [PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120
        )
        server = Server(
            tmp, "timeline", "fifo", pin, model_module="bench.stampmodel", stages_out=out
        )
        stack.callback(server.stop)
        server.wait_ready()
        bare_port = free_port()
        bare = Proc(
            [PY, "-m", "daphne", "-b", "127.0.0.1", "-p", str(bare_port), "bench.bare:app"],
            bare_port,
            SERVER_CPU if pin else None,
            tmp / "bare.log",
        )
        stack.callback(bare.stop)
        bare.wait_ready("/")
        raw = post_bytes(server.port, CHAT)
        _client(server.port, raw, 50, pause)  # loads the model
        ports = {"direct": server.model_port, "daphne alone": bare_port}
        if have_ls:
            theirs = LlamaSwap(tmp, server.model_port, pin)
            stack.callback(theirs.stop)
            theirs.wait_ready("/health")
            _client(theirs.port, post_bytes(theirs.port, CHAT), 50, pause)
            ports["llama-swap"] = theirs.port
        ports["llamaswap"] = server.port
        _stamps(server.model_port)
        windows = _client(server.port, raw, args.requests, pause)
        rows = _stamps(server.model_port)
        sides = _sides(ports, max(200, args.requests // 2), pause)
        stack.close()  # the server writes its stamps as it exits
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        events = [tuple(x) for x in lines if len(x) == 2]
    steps, between = _timeline(windows, rows, events)  # type: ignore[arg-type]
    counted = len(steps["done"])
    print(f"load average {load()} after; {counted} of {len(windows)} requests with every stamp\n")
    print("| step | p50 µs | p90 µs |\n| :-- | --: | --: |")
    total50 = 0.0
    for kind, label in ORDER:
        p50, p90 = quantile_us(steps[kind], 0.5), quantile_us(steps[kind], 0.9)
        total50 += p50
        print(f"| {label} | {p50:.0f} | {p90:.0f} |")
    proxy = [t1 - t0 for t0, t1 in windows]
    print(
        f"| sum of the steps' p50s / the whole request's p50 | {total50:.0f} | "
        f"{quantile_us(proxy, 0.5):.0f} |"
    )
    print("\nbetween reply and tx, stamps seen in all requests:", between)
    direct50 = quantile_us(sides["direct"], 0.5)
    print("\nSides alternated request by request (the whole answer, µs):\n")
    print("| side | p50 | p99 | added p50 (side − direct) |\n| :-- | --: | --: | --: |")
    for side, samples in sides.items():
        p50 = quantile_us(samples, 0.5)
        added = f"{p50 - direct50:.0f}" if side != "direct" else "–"
        print(f"| {side} | {p50:.0f} | {quantile_us(samples, 0.99):.0f} | {added} |")


if __name__ == "__main__":
    main()
