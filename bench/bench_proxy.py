"""The product against the simulated model server called directly, in one run.

Two real ``manage.py serve`` subprocesses are started, each with one model ``m`` running
the simulated model server (``python -m fakellm``):

* a fifo server (``routing.scheduler.use: fifo``, ``concurrencyLimit: 32``) for latency,
  throughput and a long stream. "Direct" is the same client code sending the same
  request to that model's own port, so both sides talk to the very same model process;
* a serial server (the default scheduler) for 10,000 requests waiting at once behind one
  long request (``fake_delay``).

Placement on this 2-core machine: the server is pinned to core 0 (``taskset -c 0``); the
model process (``taskset -c 1`` in its ``cmd``) and this bench process (the load
generator) share core 1. So the proxy's own cost lands on core 0 alone, and the direct
figures are what the model server and client do on core 1.

The client is lean on purpose (the load generator must cost little beside the server):
blocking sockets writing minimal HTTP/1.1 for the sequential measurements, raw asyncio
streams with keep-alive connections for the throughput, non-blocking sockets that only
connect and write for the 10,000 waiting requests. Every loop is bounded in count and
time; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench import machine, markdown_table, quantile_us
from scheduler.testing import descendants, free_port

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

SERVER_CPU = 0
CLIENT_CPU = 1
"""The model process and this bench share this core."""

WARMUP = 50
SAMPLES = 400
RPS_CLIENTS = 16
RPS_WARMUP_S = 1.0
RPS_SECONDS = 5.0
RPS_MAX_REQUESTS = 200_000
STREAM_TOKENS = 20_000
STREAM_RUNS = 3
WAITING = 10_000
CONNECT_BATCH = 40
BIG_WAITING = 200
BIG_BODY = 1_000_000
"""Connections opened at once, then wait until the server has queued them: below daphne's
listen backlog (Twisted's default, 50), whose overflow drops SYNs that the kernel retries
a second later."""
HEALTH_SAMPLES = 300
PHASE_TIMEOUT_S = 60.0

TARGETS = {
    "ttfb_p50_ms": 2.5,
    "ttfb_p99_ms": 5.0,
    "rps": 450.0,
    "chunks_per_s": 30_000.0,
    "kb_per_waiting": 25.0,
    "mb_per_big_waiting": 1.1,
    "health_p99_ms": 5.0,
}

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
PATH = "/v1/chat/completions"


# -- processes -------------------------------------------------------------------------------


def pinning() -> bool:
    """Pin only when both cores are ours to use."""
    return hasattr(os, "sched_setaffinity") and {SERVER_CPU, CLIENT_CPU} <= os.sched_getaffinity(0)


def raise_nofile(want: int = 65_536) -> int:
    """Raise RLIMIT_NOFILE as far as allowed; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
        except (ValueError, OSError):
            want = hard
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def proc_status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = value.strip()
    return out


def rss_kb(pid: int) -> int:
    return int(proc_status(pid)["VmRSS"].split()[0])


def threads(pid: int) -> int:
    return int(proc_status(pid)["Threads"])


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """``manage.py serve`` as a subprocess with one fake model ``m``."""

    def __init__(self, tmp: Path, name: str, scheduler: str, pin: bool) -> None:
        self.port = free_port()
        self.model_port = free_port()
        taskset = f"taskset -c {CLIENT_CPU} " if pin else ""
        model = {
            "cmd": f"{taskset}{PY} -m fakellm --host 127.0.0.1 --port {self.model_port}",
            "proxy": f"http://127.0.0.1:{self.model_port}",
            "concurrencyLimit": 32,
        }
        config = {
            "healthCheckTimeout": 15,
            "models": {"m": model},
            "routing": {"scheduler": {"use": scheduler}},
        }
        config_path = tmp / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / f"{name}.log"
        env = dict(os.environ)
        env["DATABASE_URL"] = f"sqlite:///{tmp / 'db.sqlite3'}"
        env["DEBUG"] = "false"
        env["PYTHONUNBUFFERED"] = "1"
        env["LLAMASWAP_STATE_DIR"] = str(tmp / f"state-{name}")
        cmd = [PY, "manage.py", "serve", "--config", str(config_path)]
        cmd += ["--listen", f"127.0.0.1:{self.port}", "--grace", "2"]
        if pin:
            cmd = ["taskset", "-c", str(SERVER_CPU), *cmd]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=raise_nofile,  # noqa: PLW1509 - only sets a limit
        )
        self.pid = self.proc.pid  # taskset execs: this is the server itself
        self.children: set[int] = set()

    def model_pid(self) -> int:
        """The model process (the server's only child once the model is loaded)."""
        self.children |= descendants(self.pid)
        live = [pid for pid in descendants(self.pid) if Path(f"/proc/{pid}").exists()]
        if len(live) != 1:
            raise RuntimeError(f"expected one model process, found {live}")
        return live[0]

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.log()}")
            try:
                with Conn(self.port, timeout=1) as c:
                    if c.get("/health").status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def queue(self) -> dict:
        with Conn(self.port, timeout=10) as c:
            return json.loads(c.get("/api/queue?limit=1").body)

    def wait_queue(self, ok: Callable[[dict], bool], timeout: float) -> tuple[dict, float]:
        started = time.monotonic()
        state = self.queue()
        while not ok(state) and time.monotonic() - started < timeout:
            time.sleep(0.05)
            state = self.queue()
        return state, time.monotonic() - started

    def stop(self) -> None:
        self.children |= descendants(self.pid)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._log.close()


# -- a minimal blocking HTTP/1.1 client ------------------------------------------------------


@dataclass
class Response:
    status: int
    body: bytes
    first_event_ns: int = 0
    """When the first body bytes containing ``data:`` arrived (SSE), else 0."""
    done_ns: int = 0


def post_bytes(port: int, obj: dict, path: str = PATH) -> bytes:
    body = json.dumps(obj).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class Conn:
    """One keep-alive connection; reads Content-Length and chunked bodies."""

    def __init__(self, port: int, timeout: float = 30.0) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def _fill(self) -> None:
        data = self.sock.recv(1 << 18)
        if not data:
            raise ConnectionError("closed by peer")
        self.buf += data

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def get(self, path: str) -> Response:
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n\r\n".encode())
        return self.read()

    def send(self, raw: bytes) -> Response:
        self.sock.sendall(raw)
        return self.read()

    def read(self) -> Response:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            self._fill()
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        del self.buf[: end + 4]
        status = int(head[0].split()[1])
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        first = 0
        if "content-length" in headers:
            body = self._exact(int(headers["content-length"]))
            if b"data:" in body:
                first = time.perf_counter_ns()
        elif "chunked" in headers.get("transfer-encoding", ""):
            pieces = []
            while True:
                size = int(self._line().split(b";")[0], 16)
                if size == 0:
                    while self._line():  # trailers, then the empty line
                        pass
                    break
                piece = self._exact(size + 2)[:-2]
                if not first and b"data:" in piece:
                    first = time.perf_counter_ns()
                pieces.append(piece)
            body = b"".join(pieces)
        else:
            raise ValueError("response without length (Connection: close?) is not expected")
        return Response(status, body, first, time.perf_counter_ns())


# -- measurements ----------------------------------------------------------------------------


@dataclass
class Latency:
    direct: list[int] = field(default_factory=list)
    proxy: list[int] = field(default_factory=list)

    def ms(self, side: str, q: float) -> float:
        return quantile_us(getattr(self, side), q) / 1000


def latency(server: Server, stream: bool) -> Latency:
    """Sequential requests, direct and proxied alternately, on one keep-alive connection each.

    JSON: time until the whole (short) response is read. SSE: time until the first body
    piece holding an event arrives.
    """
    out = Latency()
    req = dict(CHAT, stream=True) if stream else CHAT
    raws = {"direct": post_bytes(server.model_port, req), "proxy": post_bytes(server.port, req)}
    with Conn(server.model_port) as direct, Conn(server.port) as proxy:
        conns = {"direct": direct, "proxy": proxy}
        for i in range(WARMUP + SAMPLES):
            for side in ("direct", "proxy"):
                t0 = time.perf_counter_ns()
                r = conns[side].send(raws[side])
                if r.status != 200:
                    raise RuntimeError(f"{side}: HTTP {r.status}: {r.body[:200]!r}")
                end = r.first_event_ns if stream else r.done_ns
                if stream and not end:
                    raise RuntimeError(f"{side}: no SSE event in {r.body[:200]!r}")
                if i >= WARMUP:
                    getattr(out, side).append(end - t0)
    return out


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    at = lower.find(b"content-length:")
    if at >= 0:
        await reader.readexactly(int(lower[at + 15 : lower.index(b"\r\n", at)]))
        return status
    while True:  # chunked
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass
            return status
        await reader.readexactly(size + 2)


async def _rps(port: int, clients: int, warmup: float, seconds: float, pid: int) -> dict:
    raw = post_bytes(port, CHAT)
    counts = {"ok": 0, "errors": 0}
    window: dict[str, float] = {}
    measuring = False
    loop = asyncio.get_running_loop()
    start = loop.time()
    stop_at = start + warmup + seconds

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        try:
            while loop.time() < stop_at and counts["ok"] < RPS_MAX_REQUESTS:
                writer.write(raw)
                status = await _read_response(reader)
                if measuring:
                    counts["ok" if status == 200 else "errors"] += 1
        finally:
            writer.close()

    async def clock() -> None:
        nonlocal measuring
        await asyncio.sleep(warmup)
        window["t0"], window["cpu0"] = time.perf_counter(), cpu_seconds(pid)
        measuring = True
        await asyncio.sleep(seconds)
        measuring = False
        window["t1"], window["cpu1"] = time.perf_counter(), cpu_seconds(pid)

    async with asyncio.timeout(warmup + seconds + 30):
        await asyncio.gather(clock(), *(worker() for _ in range(clients)))
    elapsed = window["t1"] - window["t0"]
    total = counts["ok"] + counts["errors"]
    return {
        "rps": counts["ok"] / elapsed,
        "errors": counts["errors"],
        "cpu_ms": (window["cpu1"] - window["cpu0"]) / max(total, 1) * 1000,
        "requests": total,
    }


def rps(port: int, pid: int, seconds: float) -> dict:
    return asyncio.run(_rps(port, RPS_CLIENTS, RPS_WARMUP_S, seconds, pid))


def stream_rate(port: int) -> dict:
    """One stream of STREAM_TOKENS chunks, best of a few runs (one warm-up first)."""
    req = dict(CHAT, stream=True, fake_tokens=STREAM_TOKENS, fake_tokens_per_second=0)
    raw = post_bytes(port, req)
    best: dict = {}
    with Conn(port, timeout=PHASE_TIMEOUT_S) as c:
        for run in range(STREAM_RUNS + 1):
            t0 = time.perf_counter_ns()
            r = c.send(raw)
            if r.status != 200:
                raise RuntimeError(f"stream: HTTP {r.status}")
            seconds = (r.done_ns - t0) / 1e9
            events = r.body.count(b"data: ")
            if events < STREAM_TOKENS:
                raise RuntimeError(f"stream: only {events} events")
            result = {"chunks_s": events / seconds, "mb_s": len(r.body) / seconds / 1e6}
            result["events"] = events
            if run and result["chunks_s"] > best.get("chunks_s", 0):
                best = result
    return best


async def _waiting(server: Server) -> dict:
    """WAITING requests queued behind one long request; /health meanwhile; then cancel."""
    loop = asyncio.get_running_loop()
    raw = post_bytes(server.port, CHAT)
    long_raw = post_bytes(server.port, dict(CHAT, fake_delay=PHASE_TIMEOUT_S * 3))
    out: dict = {}

    def health_samples() -> list[int]:
        samples = []
        with Conn(server.port) as c:
            for i in range(WARMUP + HEALTH_SAMPLES):
                t0 = time.perf_counter_ns()
                if c.get("/health").status != 200:
                    raise RuntimeError("/health failed")
                if i >= WARMUP:
                    samples.append(time.perf_counter_ns() - t0)
        return samples

    out["health_idle"] = health_samples()
    gc.collect()
    long = socket.create_connection(("127.0.0.1", server.port))
    long.sendall(long_raw)
    state, _ = await asyncio.to_thread(
        server.wait_queue, lambda s: len(s["running"]) == 1, PHASE_TIMEOUT_S
    )
    if len(state["running"]) != 1:
        raise RuntimeError(f"the long request is not running: {state}")
    await asyncio.sleep(0.5)
    out["threads_before"] = threads(server.pid)
    out["rss_before"] = rss_kb(server.pid)

    socks: list[socket.socket] = []
    failures = 0

    async def one() -> None:
        nonlocal failures
        s = socket.socket()
        s.setblocking(False)
        try:
            await loop.sock_connect(s, ("127.0.0.1", server.port))
            await loop.sock_sendall(s, raw)
        except OSError:
            failures += 1
            s.close()
            return
        socks.append(s)

    poll = Conn(server.port, timeout=10)
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(PHASE_TIMEOUT_S):
            for start in range(0, WAITING, CONNECT_BATCH):
                await asyncio.gather(*(one() for _ in range(min(CONNECT_BATCH, WAITING - start))))
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    if json.loads(poll.get("/api/queue?limit=1").body)["depth"] >= len(socks):
                        break
                    time.sleep(0.002)
        out["connect_s"] = time.perf_counter() - t0
        out["failures"] = failures
        state, waited = await asyncio.to_thread(
            server.wait_queue, lambda s: s["depth"] >= len(socks), PHASE_TIMEOUT_S
        )
        out["depth"] = state["depth"]
        out["queued_s"] = time.perf_counter() - t0
        await asyncio.sleep(0.5)
        out["threads_during"] = threads(server.pid)
        out["health_busy"] = await asyncio.to_thread(health_samples)
        out["rss_during"] = rss_kb(server.pid)
        out["threads_after_health"] = threads(server.pid)
    finally:
        poll.sock.close()
        for s in socks:
            s.close()
        t1 = time.perf_counter()
        long.close()
    state, _ = await asyncio.to_thread(
        server.wait_queue, lambda s: s["depth"] == 0 and not s["running"], PHASE_TIMEOUT_S
    )
    out["drained_depth"] = state["depth"]
    out["drained_running"] = len(state["running"])
    out["drain_s"] = time.perf_counter() - t1
    out["waiting"] = len(socks)
    return out


async def _waiting_big(server: Server) -> dict:
    """BIG_WAITING requests with a 1 MB body each, queued behind one long request: the
    memory a waiting request holds should be one copy of its body, not two."""
    loop = asyncio.get_running_loop()
    padding = "A" * BIG_BODY  # a base64 image, say
    raw = post_bytes(server.port, dict(CHAT, messages=[{"role": "user", "content": padding}]))
    long = socket.create_connection(("127.0.0.1", server.port))
    long.sendall(post_bytes(server.port, dict(CHAT, fake_delay=PHASE_TIMEOUT_S * 3)))
    await asyncio.to_thread(server.wait_queue, lambda s: len(s["running"]) == 1, PHASE_TIMEOUT_S)
    gc.collect()
    await asyncio.sleep(0.5)
    out = {"rss_before": rss_kb(server.pid), "body_bytes": len(raw)}
    socks: list[socket.socket] = []
    try:
        for _ in range(BIG_WAITING):
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", server.port))
            await loop.sock_sendall(s, raw)
            socks.append(s)
        state, _ = await asyncio.to_thread(
            server.wait_queue, lambda s: s["depth"] >= len(socks), PHASE_TIMEOUT_S
        )
        out["depth"] = state["depth"]
        await asyncio.sleep(1.0)
        out["rss_during"] = rss_kb(server.pid)
    finally:
        for s in socks:
            s.close()
        long.close()
    await asyncio.to_thread(
        server.wait_queue, lambda s: s["depth"] == 0 and not s["running"], PHASE_TIMEOUT_S
    )
    out["waiting"] = len(socks)
    return out


# -- the report ------------------------------------------------------------------------------


def f_ms(value: float) -> str:
    return f"{value:.2f}"


def f_int(value: float) -> str:
    return f"{value:,.0f}"


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def main() -> str:
    print("== proxy: manage.py serve vs the model server called directly ==")
    started = time.perf_counter()
    pin = pinning()
    old_affinity = os.sched_getaffinity(0) if pin else None
    nofile = raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    gc_was_enabled = gc.isenabled()
    servers: list[Server] = []
    try:
        if pin:
            os.sched_setaffinity(0, {CLIENT_CPU})
        env = dict(os.environ, DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}")
        subprocess.run(
            [PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120
        )

        # -- fifo server: latency, throughput, stream
        fifo = Server(tmp, "fifo", "fifo", pin)
        servers.append(fifo)
        fifo.wait_ready()
        with Conn(fifo.port, timeout=PHASE_TIMEOUT_S) as c:  # loads the model
            if (r := c.send(post_bytes(fifo.port, CHAT))).status != 200:
                raise RuntimeError(f"first request: HTTP {r.status} {r.body[:300]!r}")
        gc.disable()  # a collection in the client is noise on both sides
        print("  latency: JSON ...")
        lat_json = latency(fifo, stream=False)
        print("  latency: first SSE event ...")
        lat_sse = latency(fifo, stream=True)
        gc.enable()
        gc.collect()
        print("  requests/s, 16 clients: direct ...")
        rps_direct = rps(fifo.model_port, fifo.model_pid(), 3.0)
        print("  requests/s, 16 clients: proxy ...")
        rps_proxy = rps(fifo.port, fifo.pid, RPS_SECONDS)
        print(f"    {rps_direct['rps']:,.0f} direct, {rps_proxy['rps']:,.0f} proxied")
        print("  one stream of 20,000 chunks ...")
        stream_direct = stream_rate(fifo.model_port)
        stream_proxy = stream_rate(fifo.port)
        print(
            f"    {stream_direct['chunks_s']:,.0f} direct, {stream_proxy['chunks_s']:,.0f} proxied"
        )
        fifo.stop()
        servers.remove(fifo)

        # -- serial server: 10,000 waiting
        print(f"  {WAITING:,} waiting behind one long request (serial) ...")
        serial = Server(tmp, "serial", "serial", pin)
        servers.append(serial)
        serial.wait_ready()
        with Conn(serial.port, timeout=PHASE_TIMEOUT_S) as c:
            for _ in range(WARMUP):
                if (r := c.send(post_bytes(serial.port, CHAT))).status != 200:
                    raise RuntimeError(f"warm-up: HTTP {r.status} {r.body[:300]!r}")
        wait = asyncio.run(_waiting(serial))
        print(
            f"    {wait['waiting']:,} queued in {wait['queued_s']:.1f} s; drained in "
            f"{wait['drain_s']:.1f} s"
        )
        print(f"  {BIG_WAITING} waiting with a 1 MB body each ...")
        wait["big"] = asyncio.run(_waiting_big(serial))
        serial.stop()
        servers.remove(serial)
    finally:
        for server in servers:
            server.stop()
        if gc_was_enabled:
            gc.enable()
        if old_affinity is not None:
            os.sched_setaffinity(0, old_affinity)
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - started
    return report(
        lat_json,
        lat_sse,
        rps_direct,
        rps_proxy,
        stream_direct,
        stream_proxy,
        wait,
        elapsed,
        pin,
        nofile,
    )


def report(
    lat_json: Latency,
    lat_sse: Latency,
    rps_direct: dict,
    rps_proxy: dict,
    stream_direct: dict,
    stream_proxy: dict,
    wait: dict,
    elapsed: float,
    pin: bool,
    nofile: int,
) -> str:
    t = TARGETS
    rows: list[list[str]] = []
    checks: list[tuple[str, bool]] = []
    for label, lat in (
        ("JSON chat completion, whole response", lat_json),
        ("streaming, first SSE event", lat_sse),
    ):
        for q, key in ((0.5, "ttfb_p50_ms"), (0.99, "ttfb_p99_ms")):
            d, p = lat.ms("direct", q), lat.ms("proxy", q)
            ok = p - d <= t[key]
            name = f"{label}, p{int(q * 100)} ms"
            rows.append(
                [
                    name,
                    f_ms(d),
                    f_ms(p),
                    f"+{p - d:.2f} ({p / d:.1f}×)",
                    f"≤ +{t[key]:g}",
                    verdict(ok),
                ]
            )
            checks.append((name, ok))
    ok = rps_proxy["rps"] >= t["rps"] and not rps_proxy["errors"]
    rows.append(
        [
            f"requests/s, {RPS_CLIENTS} clients, fifo, non-streaming",
            f_int(rps_direct["rps"]),
            f_int(rps_proxy["rps"]),
            f"{rps_proxy['rps'] / rps_direct['rps']:.2f}×",
            f"≥ {t['rps']:g}",
            verdict(ok),
        ]
    )
    checks.append(("requests/s", ok))
    rows.append(
        [
            "CPU per request at that load, ms (model server / proxy server)",
            f_ms(rps_direct["cpu_ms"]),
            f_ms(rps_proxy["cpu_ms"]),
            f"{rps_proxy['cpu_ms'] / rps_direct['cpu_ms']:.1f}×",
            "",
            "",
        ]
    )
    ok = stream_proxy["chunks_s"] >= t["chunks_per_s"]
    rows.append(
        [
            f"one stream of {STREAM_TOKENS:,} chunks, SSE events/s",
            f_int(stream_direct["chunks_s"]),
            f_int(stream_proxy["chunks_s"]),
            f"{stream_proxy['chunks_s'] / stream_direct['chunks_s']:.2f}×",
            f"≥ {t['chunks_per_s']:,.0f}",
            verdict(ok),
        ]
    )
    checks.append(("stream", ok))
    rows.append(
        [
            "same stream, MB/s",
            f"{stream_direct['mb_s']:.1f}",
            f"{stream_proxy['mb_s']:.1f}",
            f"{stream_proxy['mb_s'] / stream_direct['mb_s']:.2f}×",
            "",
            "",
        ]
    )
    header = ["measure", "direct", "through the proxy", "added (ratio)", "target", ""]

    big = wait["big"]
    big_mb = (big["rss_during"] - big["rss_before"]) / 1024 / max(big["waiting"], 1)
    n = wait["waiting"]
    per_kb = (wait["rss_during"] - wait["rss_before"]) / max(n, 1)
    h_idle = [quantile_us(wait["health_idle"], q) / 1000 for q in (0.5, 0.99)]
    h_busy = [quantile_us(wait["health_busy"], q) / 1000 for q in (0.5, 0.99)]
    extra_threads = wait["threads_during"] - wait["threads_before"]
    q_rows = [
        ["requests waiting (GET /api/queue depth)", "0", f"{wait['depth']:,}", "", ""],
        [
            "server OS threads (/proc Threads)",
            str(wait["threads_before"]),
            str(wait["threads_during"]),
            "no thread per waiting request",
            verdict(extra_threads < 16),
        ],
        [
            "server RSS, MB",
            f"{wait['rss_before'] / 1024:.0f}",
            f"{wait['rss_during'] / 1024:.0f}",
            "",
            "",
        ],
        [
            "memory per waiting request, KB (RSS delta / waiting)",
            "",
            f"{per_kb:.1f}",
            f"≤ {t['kb_per_waiting']:g}",
            verdict(per_kb <= t["kb_per_waiting"]),
        ],
        [
            f"memory per waiting request with a {big['body_bytes'] / 1e6:.1f} MB body, MB "
            f"({big['waiting']} waiting)",
            "",
            f"{big_mb:.2f}",
            f"≤ {t['mb_per_big_waiting']:g}",
            verdict(big_mb <= t["mb_per_big_waiting"]),
        ],
        ["`/health` p50 ms", f_ms(h_idle[0]), f_ms(h_busy[0]), "", ""],
        [
            "`/health` p99 ms",
            f_ms(h_idle[1]),
            f_ms(h_busy[1]),
            f"≤ {t['health_p99_ms']:g}",
            verdict(h_busy[1] <= t["health_p99_ms"]),
        ],
        [
            "after closing every client: depth / running",
            "",
            f"{wait['drained_depth']} / {wait['drained_running']} after {wait['drain_s']:.1f} s",
            "0 / 0",
            verdict(wait["drained_depth"] == 0 and wait["drained_running"] == 0),
        ],
    ]
    checks += [
        ("threads", extra_threads < 16),
        ("memory", per_kb <= t["kb_per_waiting"]),
        ("memory, 1 MB bodies", big_mb <= t["mb_per_big_waiting"]),
        ("/health", h_busy[1] <= t["health_p99_ms"]),
        ("drain", wait["drained_depth"] == 0 and wait["drained_running"] == 0),
    ]
    missed = [name for name, ok in checks if not ok]
    placement = (
        f"the server pinned to core {SERVER_CPU} (`taskset -c {SERVER_CPU}`), the model "
        f"process and this load generator sharing core {CLIENT_CPU}"
        if pin
        else "no CPU pinning (fewer than two usable cores)"
    )
    lines = [
        "`.venv/bin/python -m bench proxy` (`make bench` runs all benches). "
        f"Machine: {machine()}. One run, {elapsed:.0f} s, on a noisy 2-core machine: "
        "read the added time and the ratios to direct, not the absolute figures. "
        f"Placement: {placement}.",
        "",
        markdown_table(header, rows),
        "",
        f"Direct = the same client code sending the same request to the model process's own "
        f"port (the one the proxy relays to). Latency: {SAMPLES} sequential requests per side "
        f"after {WARMUP} warm-up, direct and proxied alternately, one keep-alive connection "
        "each; added = proxy quantile minus direct quantile. Requests/s: "
        f"{RPS_CLIENTS} keep-alive raw-socket clients, `routing.scheduler.use: fifo`, "
        f"`concurrencyLimit: 32`, {RPS_SECONDS:g} s after {RPS_WARMUP_S:g} s warm-up "
        f"({rps_proxy['requests']:,} proxied, {rps_proxy['errors']} errors); CPU per request "
        "is the server's (or model server's) utime+stime over the window. Stream: "
        f"`fake_tokens: {STREAM_TOKENS}`, no pacing, best of {STREAM_RUNS} after a warm-up.",
        "",
        f"{n:,} requests waiting at once (serial scheduler; one request with `fake_delay` "
        f"holds the model), opened as raw sockets that write one POST each, "
        f"{CONNECT_BATCH} at a time, each batch once the last is queued "
        f"(RLIMIT_NOFILE raised to {nofile:,} in the bench and the server), queued in "
        f"{wait['queued_s']:.1f} s, {wait['failures']} connect failures; "
        f"`/health` sampled {HEALTH_SAMPLES} times sequentially while they wait:",
        "",
        markdown_table(["measure", "before", f"with {n:,} waiting", "target", ""], q_rows),
        "",
        "Targets: " + ("all met." if not missed else "missed: " + ", ".join(missed) + "."),
    ]
    return "\n".join(lines)
