"""A request that swaps models: each stage, the product beside llama-swap, in one run.

Two proxies, each with two models ``a`` and ``b`` that cannot be loaded together (the
default for both: one model at a time) and whose server is ``bench/swapmodel.py``: healthy
as soon as its interpreter runs (~0.05-0.15 s after spawn here), stamping each stage of its
life on the shared monotonic clock. One
client alternates requests to ``a`` and ``b`` on one keep-alive connection, so every request
is a swap. The rounds alternate the proxies (product, llama-swap, product, ...); each proxy
has its own two model ports. Stages, from the stamps of the old and the new model server:

* last byte of the previous answer → stop signal (SIGTERM) received by the old server;
* stop signal → the old server exits (its own: it exits at once);
* old server's exit → the new server's first instruction (the proxy reaps the old process,
  spawns the new one; the interpreter's start-up is in this stage too);
* new server's first instruction → listening (its own "loading": DELAY);
* listening → first health answer (how soon the proxy's health check finds it);
* health answer → the request arrives at the new server.

Whole swap = last byte of the previous answer → request at the new server. The proxy's
share = whole swap − the new server's own start-to-listening time.

``llama-swap`` is ``../shared/tools/llama-swap/llama-swap`` (or ``$LLAMA_SWAP``); where it is
absent, the product is measured alone and the section says so.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

from bench import machine, markdown_table
from bench.bench_proxy import CLIENT_CPU, PY, ROOT, SERVER_CPU, Conn, Proc, pinning, post_bytes
from scheduler.testing import free_port

LLAMA_SWAP = Path(
    os.environ.get("LLAMA_SWAP", ROOT.parent / "shared" / "tools" / "llama-swap" / "llama-swap")
)
MODEL = ROOT / "bench" / "swapmodel.py"
DELAY = 0.0
"""The model server's own loading: it listens this long after its first instruction (0: an
instantly-starting server, healthy once its interpreter has started, ~0.1 s after spawn on
a busy 2-core machine)."""
CALIBRATION = 8
"""Spawns per round timed from ``Popen`` to the server's first instruction (same command,
same core): the interpreter's start-up, which is the model's own time, not the proxy's."""
ROUNDS = 6
SWAPS = 20
"""Swaps per proxy per round (ROUNDS × SWAPS per proxy in all)."""

STAGES = [
    ("last byte → stop signal", "answered", "term"),
    ("stop signal → old server exits", "term", "exit"),
    ("exit → new server's first instruction", "exit", "start"),
    ("first instruction → listening (the model's own)", "start", "listen"),
    ("listening → first health answer", "listen", "health"),
    ("health answer → request arrives", "health", "arrive"),
]


def _config(stamps: Path, pin: bool) -> tuple[dict, dict[str, int]]:
    taskset = f"taskset -c {CLIENT_CPU} " if pin else ""
    ports = {name: free_port() for name in ("a", "b")}
    models = {
        name: {
            "cmd": f"{taskset}{PY} -I -S {MODEL} {port} {stamps} {DELAY}",
            "proxy": f"http://127.0.0.1:{port}",
            "checkEndpoint": "/health",
        }
        for name, port in ports.items()
    }
    return {"healthCheckTimeout": 15, "models": models}, ports


class Product(Proc):
    stamps: Path

    def __init__(self, tmp: Path, pin: bool) -> None:
        self.stamps = tmp / "product.stamps"
        config, _ = _config(self.stamps, pin)
        path = tmp / "product.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        env = {
            "DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}",
            "DEBUG": "false",
            "LLAMASWAP_STATE_DIR": str(tmp / "state"),
        }
        cmd = [PY, "manage.py", "serve", "--config", str(path)]
        cmd += ["--listen", f"127.0.0.1:{port}", "--grace", "2"]
        super().__init__(cmd, port, SERVER_CPU if pin else None, tmp / "product.log", env=env)


class LlamaSwap(Proc):
    stamps: Path

    def __init__(self, tmp: Path, pin: bool) -> None:
        self.stamps = tmp / "llama-swap.stamps"
        config, _ = _config(self.stamps, pin)
        path = tmp / "llama-swap.yaml"
        path.write_text(yaml.safe_dump(config))
        port = free_port()
        cmd = [str(LLAMA_SWAP), "-config", str(path), "-listen", f"127.0.0.1:{port}"]
        super().__init__(cmd, port, SERVER_CPU if pin else None, tmp / "llama-swap.log")


def _startup(pin: bool, stamps: Path) -> list[int]:
    """``CALIBRATION`` spawns of the model's command (PORT 0: it exits after its first
    stamp); each: ``Popen`` called → first instruction, ns."""
    taskset = ["taskset", "-c", str(CLIENT_CPU)] if pin else []
    out = []
    for _ in range(CALIBRATION):
        stamps.write_text("")
        before = time.monotonic_ns()
        subprocess.run([*taskset, PY, "-I", "-S", str(MODEL), "0", str(stamps)], check=True)
        out.append(int(stamps.read_text().split()[2]) - before)
    return out


def _swaps(proxy: Proc, count: int, first: str) -> str:
    """``count`` swaps on one connection, starting with a request to ``first``; returns the
    model loaded at the end."""
    names = ["a", "b"] if first == "a" else ["b", "a"]
    with Conn(proxy.port, timeout=30) as conn:
        for i in range(count):
            model = names[i % 2]
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            response = conn.send(post_bytes(proxy.port, body))
            if response.status != 200:
                raise RuntimeError(f"{model}: {response.status} {response.body[:300]!r}")
    return names[(count - 1) % 2]


def _read_stamps(path: Path) -> list[dict[str, list[int]]]:
    """One dict per model process (in start order): event → its stamps."""
    per_pid: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for line in path.read_text().splitlines():
        event, pid, ns = line.split()
        per_pid[int(pid)][event].append(int(ns))
    return sorted(per_pid.values(), key=lambda p: min(min(v) for v in p.values()))


def swap_stages(processes: list[dict[str, list[int]]]) -> list[dict[str, int]]:
    """Per swap (a process after the one before it): each stage's end stamp, the previous
    answer's last byte as ``answered``."""
    swaps = []
    for old, new in zip(processes, processes[1:], strict=False):
        if not (old["answered"] and old["term"] and new["start"] and new["arrive"]):
            continue
        swaps.append(
            {
                "answered": old["answered"][-1],
                "term": old["term"][0],
                "exit": old["exit"][0],
                "start": new["start"][0],
                "listen": new["listen"][0],
                "health": new["health"][0],
                "arrive": new["arrive"][0],
            }
        )
    return swaps


def ms(samples: list[int], q: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))] / 1e6


def summary(swaps: list[dict[str, int]], startup: int) -> dict[str, list[int]]:
    """Each stage's samples; the proxy's share = whole swap − the new server's own time
    (``startup``, the interpreter's, + its first instruction → listening)."""
    out = {label: [s[b] - s[a] for s in swaps] for label, a, b in STAGES}
    out["whole swap"] = [s["arrive"] - s["answered"] for s in swaps]
    out["the proxy's share"] = [
        s["arrive"] - s["answered"] - startup - (s["listen"] - s["start"]) for s in swaps
    ]
    return out


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def main() -> str:
    pin = pinning()
    have_ls = LLAMA_SWAP.is_file() and os.access(LLAMA_SWAP, os.X_OK)
    load_before = load()
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    proxies: dict[str, Product | LlamaSwap] = {}
    try:
        proxies["llamaswap"] = Product(tmp, pin)
        if have_ls:
            proxies["llama-swap"] = LlamaSwap(tmp, pin)
        for proxy in proxies.values():
            proxy.wait_ready()
        loaded = dict.fromkeys(proxies, "b")
        for name, proxy in proxies.items():  # warm up: both models started once
            loaded[name] = _swaps(proxy, 3, "a")
        for proxy in proxies.values():
            proxy.stamps.write_text("")
        startup: list[int] = []
        for r in range(ROUNDS):
            startup += _startup(pin, tmp / "calibration.stamps")
            for name, proxy in proxies.items():
                # The first request goes to the model loaded (no swap: the swaps of one round
                # never span the other proxy's round), then SWAPS swaps.
                loaded[name] = _swaps(proxy, SWAPS + 1, loaded[name])
                print(f"round {r + 1}/{ROUNDS}: {name} {SWAPS} swaps", flush=True)
        results = {
            name: summary(swap_stages(_read_stamps(proxy.stamps)), int(statistics.median(startup)))
            for name, proxy in proxies.items()
        }
    finally:
        for proxy in proxies.values():
            proxy.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return report(results, startup, have_ls, pin, load_before, load(), time.monotonic() - started)


def report(
    results: dict[str, dict[str, list[int]]],
    startup: list[int],
    have_ls: bool,
    pin: bool,
    load_before: str,
    load_after: str,
    elapsed: float,
) -> str:
    ours = results["llamaswap"]
    theirs = results.get("llama-swap")
    header = ["stage, ms", "llamaswap p50", "p99"]
    if theirs:
        header += ["llama-swap p50", "p99", "ratio p50", "ratio p99"]
    rows = []
    for label in [*(s[0] for s in STAGES), "whole swap", "the proxy's share"]:
        row = [label, *(f"{ms(ours[label], q):.1f}" for q in (0.5, 0.99))]
        if theirs:
            row += [f"{ms(theirs[label], q):.1f}" for q in (0.5, 0.99)]
            for q in (0.5, 0.99):
                mine, other = ms(ours[label], q), ms(theirs[label], q)
                row.append(f"{mine / other:.2f}×" if other > 0.05 else "–")
        rows.append(row)
    n = len(ours["whole swap"])
    lines = [
        f"`.venv/bin/python -m bench swap`. Machine: {machine()}; load average "
        f"{load_before} before, {load_after} after (other agents' work shares the machine). "
        f"One run, {elapsed:.0f} s; {n} swaps per proxy, {ROUNDS} alternated rounds of "
        f"{SWAPS}; {'proxies pinned to core 0, models and client to core 1' if pin else 'unpinned'}.",
        "",
        markdown_table(header, rows),
        "",
        "Model server `bench/swapmodel.py` (stdlib, `python -I -S`): listens "
        f"{DELAY:g} s after its first instruction, answers at once, exits on SIGTERM. Stages "
        "from its stamps (CLOCK_MONOTONIC). The new server's own time = its interpreter's "
        f"start-up (`Popen` → first instruction, same command and core, {len(startup)} spawns "
        f"between rounds: p50 {ms(startup, 0.5):.1f} ms, p99 {ms(startup, 0.99):.1f} ms; its "
        "median is used) + first instruction → listening; the proxy's share = whole swap − "
        "that.",
    ]
    if theirs:
        share = "the proxy's share"
        r50 = ms(ours[share], 0.5) / ms(theirs[share], 0.5)
        r99 = ms(ours[share], 0.99) / ms(theirs[share], 0.99)
        met = r50 <= 0.5 and r99 <= 0.5
        lines += [
            "",
            f"Target (the proxy's share at most half of llama-swap's, p50 and p99): "
            f"{r50:.2f}× / {r99:.2f}× — {'met' if met else 'not met'}.",
        ]
    else:
        lines += ["", f"llama-swap not measured: no executable at `{LLAMA_SWAP}`."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
