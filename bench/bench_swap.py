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

``python -m bench.bench_swap --llama-server [PATH] [--models DIR] [--write]`` runs the same
alternated comparison with both models llama.cpp's own ``llama-server`` (the build and the two
tiny models of ``make e2e``, ``scripts/real-llama/build.sh``; section ``swap-llama-server``).
It stamps nothing, so what is measured is seen from outside: the client's time of a request
with a swap minus one without (the whole swap), llama-server's own spawn-to-healthy time
(spawned alone between the rounds, ``/health`` polled every 2 ms), and the product's own
stages from its log lines. Not part of ``make bench`` (``python -m bench swap`` is unchanged).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from bench import machine, markdown_table, write_section
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


def _config(stamps: Path, pin: bool) -> tuple[dict[str, Any], dict[str, int]]:
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

    def __init__(self, tmp: Path, pin: bool, config: dict[str, Any] | None = None) -> None:
        self.stamps = tmp / "product.stamps"
        config = config or _config(self.stamps, pin)[0]
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

    def __init__(self, tmp: Path, pin: bool, config: dict[str, Any] | None = None) -> None:
        self.stamps = tmp / "llama-swap.stamps"
        config = config or _config(self.stamps, pin)[0]
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


def _verdict(ours: Mapping[str, list[int]], theirs: Mapping[str, list[int]] | None) -> list[str]:
    """Issue 23's target for a swap table: the proxy's share at most half of llama-swap's,
    p50 and p99."""
    if not theirs:
        return ["", f"llama-swap not measured: no executable at `{LLAMA_SWAP}`."]
    share = "the proxy's share"
    r50 = ms(ours[share], 0.5) / ms(theirs[share], 0.5)
    r99 = ms(ours[share], 0.99) / ms(theirs[share], 0.99)
    met = r50 <= 0.5 and r99 <= 0.5
    return [
        "",
        f"Target (the proxy's share at most half of llama-swap's, p50 and p99): "
        f"{r50:.2f}× / {r99:.2f}× — {'met' if met else 'not met'}.",
    ]


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
    return "\n".join(lines + _verdict(ours, theirs))


# -- with llama.cpp's own llama-server ---------------------------------------------------------
# `python -m bench.bench_swap --llama-server`: the same alternated comparison, both models real
# `llama-server` processes (the build `make e2e` uses). llama-server stamps nothing, so the
# stages are what can be seen from outside: the client's times, the product's own log lines
# and llama-server's own spawn-to-healthy time, timed alone between the rounds.

E2E_CACHE = Path(
    os.environ.get("LLAMASWAP_E2E_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llamaswap-e2e"
)
"""Where ``scripts/real-llama/build.sh`` (``make e2e``) builds llama-server and its models."""
LLAMA_ROUNDS = 8
LLAMA_SWAPS = 15
"""Swaps per proxy per round; each swap is followed by a request that needs none."""
LLAMA_CALIBRATION = 6
"""llama-server spawned alone per round, timed from ``Popen`` to its first healthy answer."""
HEALTH_POLL = 0.002
"""How often the calibration polls ``/health``: finer than either proxy's polling."""
LLAMA_FLAGS = ["--threads", "1", "--no-webui", "-c", "512"]
"""As the e2e suite runs it: one thread (proxy, client and model share two cores)."""


def _llama_argv(server: Path, model: Path, port: int) -> list[str]:
    return [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *LLAMA_FLAGS]


def _llama_config(server: Path, models: Path, pin: bool) -> dict[str, Any]:
    taskset = f"taskset -c {CLIENT_CPU} " if pin else ""
    config = {}
    for name in ("a", "b"):
        port = free_port()
        argv = _llama_argv(server, models / f"tiny-{name}.gguf", port)
        config[name] = {
            "cmd": taskset + " ".join(argv),
            "proxy": f"http://127.0.0.1:{port}",
            "checkEndpoint": "/health",
        }
    return {"healthCheckTimeout": 30, "models": config}


def _healthy(port: int, proc: subprocess.Popen[bytes]) -> int:
    """Poll ``GET /health`` every :data:`HEALTH_POLL` until it answers 200; its time, ns."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} while starting")
        try:
            with Conn(port, timeout=5) as conn:
                if conn.get("/health").status == 200:  # 503 while the model loads
                    return time.monotonic_ns()
        except OSError:
            pass
        time.sleep(HEALTH_POLL)
    raise RuntimeError("llama-server: not healthy within 30 s")


def _llama_startup(server: Path, models: Path, pin: bool) -> tuple[list[int], list[int]]:
    """:data:`LLAMA_CALIBRATION` spawns of llama-server alone (same flags and core, the two
    models in turn): ``Popen`` → first healthy answer, and SIGTERM → exit, ns."""
    taskset = ["taskset", "-c", str(CLIENT_CPU)] if pin else []
    up, down = [], []
    for i in range(LLAMA_CALIBRATION):
        port = free_port()
        model = models / f"tiny-{'ab'[i % 2]}.gguf"
        before = time.monotonic_ns()
        proc = subprocess.Popen(
            [*taskset, *_llama_argv(server, model, port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            up.append(_healthy(port, proc) - before)
            # One request before the SIGTERM, as a swapped-out server has served: /health
            # answers 200 before llama-server's task loop runs, and a SIGTERM in between is
            # lost (its terminate() is undone when the loop starts; it then runs on).
            with Conn(port, timeout=30) as conn:
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
                if conn.send(post_bytes(port, body)).status != 200:
                    raise RuntimeError("llama-server: the calibration's request failed")
            before = time.monotonic_ns()
            proc.terminate()
            proc.wait(timeout=10)
            down.append(time.monotonic_ns() - before)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return up, down


def _timed_swaps(proxy: Proc, count: int, loaded: str) -> tuple[list[int], list[int], str]:
    """A request to the model ``loaded`` (no swap), then ``count`` times: a request to the
    other model (a swap) and a second one to it (none). Client send → whole answer, ns:
    (with a swap, without one, the model loaded at the end)."""
    swapped, plain = [], []
    with Conn(proxy.port, timeout=60) as conn:

        def request(model: str) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
            raw = post_bytes(proxy.port, {**body, "max_tokens": 4})
            before = time.monotonic_ns()
            response = conn.send(raw)
            took = time.monotonic_ns() - before
            if response.status != 200:
                raise RuntimeError(f"{model}: {response.status} {response.body[:300]!r}")
            return took

        request(loaded)
        for _ in range(count):
            loaded = "b" if loaded == "a" else "a"
            swapped.append(request(loaded))
            plain.append(request(loaded))
    return swapped, plain, loaded


_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ \S+ model (\w+): (.*)$")
PRODUCT_STAGES = [
    ("stop begins → old server reaped", "stopping", "stopped"),
    ("old server reaped → new one spawned", "stopped", "spawned"),
    ("spawned → healthy (its health checks)", "spawned", "ready"),
]
"""The product's own stages of a swap, from its log lines (millisecond timestamps)."""


def _product_stages(log: Path, offset: int) -> dict[str, list[int]]:
    """Per swap in the product's log from byte ``offset`` on (a model stopped, then the other
    started): each stage of :data:`PRODUCT_STAGES`, ns (the log's clock has millisecond
    steps)."""
    events: list[tuple[str, str, int]] = []
    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    for line in text.splitlines():
        match = _LOG_LINE.match(line)
        if not match:
            continue
        stamp, model, text = match.groups()
        when = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        ns = round(when * 1e9)
        if text.startswith("ready -> stopping"):
            events.append(("stopping", model, ns))
        elif text.startswith("stopping -> stopped"):
            events.append(("stopped", model, ns))
        elif text.startswith("spawned pid"):
            events.append(("spawned", model, ns))
        elif text.startswith("starting -> ready"):
            events.append(("ready", model, ns))
    out: dict[str, list[int]] = {label: [] for label, _, _ in PRODUCT_STAGES}
    kinds = [kind for kind, _, _ in events]
    for i in range(len(events) - 3):
        if kinds[i : i + 4] != ["stopping", "stopped", "spawned", "ready"]:
            continue
        old, new = events[i][1], events[i + 2][1]
        if old == new or events[i + 1][1] != old or events[i + 3][1] != new:
            continue
        at = {kind: ns for kind, _, ns in events[i : i + 4]}
        for label, a, b in PRODUCT_STAGES:
            out[label].append(at[b] - at[a])
    return out


def main_llama(server: Path, models: Path) -> str:
    """The alternated comparison with both models a real ``llama-server``."""
    for path in (server, models / "tiny-a.gguf", models / "tiny-b.gguf"):
        if not path.exists():
            raise SystemExit(f"missing {path}: run scripts/real-llama/build.sh (`make e2e`)")
    pin = pinning()
    have_ls = LLAMA_SWAP.is_file() and os.access(LLAMA_SWAP, os.X_OK)
    load_before = load()
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="bench-swap-llama-"))
    proxies: dict[str, Product | LlamaSwap] = {}
    swapped: dict[str, list[int]] = defaultdict(list)
    plain: dict[str, list[int]] = defaultdict(list)
    up: list[int] = []
    down: list[int] = []
    try:
        proxies["llamaswap"] = Product(tmp, pin, _llama_config(server, models, pin))
        if have_ls:
            proxies["llama-swap"] = LlamaSwap(tmp, pin, _llama_config(server, models, pin))
        for proxy in proxies.values():
            proxy.wait_ready()
        loaded = dict.fromkeys(proxies, "b")
        for name, proxy in proxies.items():  # warm up: both models started once
            loaded[name] = _timed_swaps(proxy, 2, "b")[2]
        # The product's stages count from here: the warm-up's first spawns read cold files.
        log_start = proxies["llamaswap"].log_path.stat().st_size
        for r in range(LLAMA_ROUNDS):
            more_up, more_down = _llama_startup(server, models, pin)
            up += more_up
            down += more_down
            for name, proxy in proxies.items():
                with_swap, without, loaded[name] = _timed_swaps(proxy, LLAMA_SWAPS, loaded[name])
                swapped[name] += with_swap
                plain[name] += without
                print(f"round {r + 1}/{LLAMA_ROUNDS}: {name} {LLAMA_SWAPS} swaps", flush=True)
        product_stages = _product_stages(proxies["llamaswap"].log_path, log_start)
    finally:
        for proxy in proxies.values():
            proxy.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results = {}
    for name in proxies:
        base = int(statistics.median(plain[name]))
        whole = [t - base for t in swapped[name]]
        results[name] = {
            "request, no swap (client)": plain[name],
            "request with a swap (client)": swapped[name],
            "whole swap (the two's difference)": whole,
            "the proxy's share": [t - int(statistics.median(up)) for t in whole],
        }
    return report_llama(
        results, product_stages, up, down, have_ls, pin,
        (load_before, load(), time.monotonic() - started),
    )  # fmt: skip


def report_llama(
    results: dict[str, dict[str, list[int]]],
    product_stages: dict[str, list[int]],
    up: list[int],
    down: list[int],
    have_ls: bool,
    pin: bool,
    run: tuple[str, str, float],
) -> str:
    load_before, load_after, elapsed = run
    ours, theirs = results["llamaswap"], results.get("llama-swap")
    header = ["ms", "llamaswap p50", "p99"]
    if theirs:
        header += ["llama-swap p50", "p99", "ratio p50", "ratio p99"]
    rows = []
    for label, samples in ours.items():
        row = [label, *(f"{ms(samples, q):.1f}" for q in (0.5, 0.99))]
        if theirs:
            row += [f"{ms(theirs[label], q):.1f}" for q in (0.5, 0.99)]
            row += [f"{ms(samples, q) / ms(theirs[label], q):.2f}×" for q in (0.5, 0.99)]
        rows.append(row)
    for label, samples in product_stages.items():
        if samples:
            rows.append(
                [f"product's log: {label}", *(f"{ms(samples, q):.0f}" for q in (0.5, 0.99))]
            )
            rows[-1] += ["", "", "", ""] if theirs else []
    n = len(ours["whole swap (the two's difference)"])
    lines = [
        "`.venv/bin/python -m bench.bench_swap --llama-server`. Machine: "
        f"{machine()}; load average {load_before} before, {load_after} after (other agents' "
        f"work shares the machine). One run, {elapsed:.0f} s; {n} swaps per proxy, "
        f"{LLAMA_ROUNDS} alternated rounds of {LLAMA_SWAPS}; "
        f"{'proxies pinned to core 0, models and client to core 1' if pin else 'unpinned'}.",
        "",
        markdown_table(header, rows),
        "",
        f"Both models llama.cpp's `llama-server` (`{' '.join(LLAMA_FLAGS)}`, the tiny "
        "random-weight models `tiny-a.gguf`/`tiny-b.gguf` of `make e2e`), `checkEndpoint: "
        "/health`; `max_tokens` 4. Each swap (a request to the other model) is followed by a "
        "request to the same model, which needs none; whole swap = a request with a swap − "
        "the median request without. llama-server alone, same flags and core, spawned "
        f"{len(up)} times between rounds and `/health` polled every "
        f"{HEALTH_POLL * 1000:g} ms: spawn → healthy p50 {ms(up, 0.5):.1f} ms, p99 "
        f"{ms(up, 0.99):.1f} ms (its median is subtracted: the proxy's share = whole swap − "
        f"that); SIGTERM → exit p50 {ms(down, 0.5):.1f} ms, p99 {ms(down, 0.99):.1f} ms (left "
        "in both proxies' share). The product's log rows: from its own log lines "
        "(millisecond clock).",
    ]
    return "\n".join(lines + _verdict(ours, theirs))


def cli(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_swap",
        description="Swaps beside llama-swap (see the docstring).",
    )
    parser.add_argument(
        "--llama-server",
        nargs="?",
        const="",
        metavar="PATH",
        help="swap real llama-servers (default: the `make e2e` build in LLAMASWAP_E2E_CACHE)",
    )
    parser.add_argument("--models", type=Path, help="directory of tiny-a.gguf and tiny-b.gguf")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args(argv)
    if args.llama_server is None:
        section, name = main(), "swap"
    else:
        builds = sorted(E2E_CACHE.glob("build-*/bin/llama-server"))
        given = args.llama_server or os.environ.get("LLAMASWAP_E2E_LLAMA_SERVER")
        server = Path(given) if given else builds[-1] if builds else E2E_CACHE / "llama-server"
        models = args.models or Path(os.environ.get("LLAMASWAP_E2E_MODELS") or E2E_CACHE / "models")
        section, name = main_llama(server, models), "swap-llama-server"
    print(section)
    if args.write:
        write_section(ROOT / "BENCHMARKS.md", name, section)


if __name__ == "__main__":
    cli()
