"""The product against the minimal relay and the model server called directly, in one run.

Two real ``manage.py serve`` subprocesses are started, each with one model ``m`` running
the simulated model server (``python -m fakellm``):

* a fifo server (``routing.scheduler.use: fifo``, ``concurrencyLimit: 64``) for latency,
  throughput, a long stream, 64 paced streams and a 50 MiB upload. "Direct" is the same
  client code sending the same request to that model's own port; the "minimal relay"
  (``bench/floor.py``: a plain Django view relaying with httpx, the floor of this stack)
  relays to the same port, so all three sides talk to the very same model process;
* a serial server (the default scheduler) for 10,000 requests waiting at once behind one
  long request (``fake_delay``).

Placement on this 2-core machine: the server and the minimal relay are pinned to core 0
(``taskset -c 0``; they are measured in turn, never both under load at once); the model
process (``taskset -c 1`` in its ``cmd``) and this bench process (the load
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
from scheduler.sweep import SPAWN_ENV
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
PACED_STREAMS = 64
PACED_RATE = 100.0
PACED_TOKENS = 800
PACED_WARMUP_S = 1.5
PACED_SECONDS = 4.0
"""Every stream runs from before the window to after it (8 s each)."""
BIG_UPLOAD = 50 * 1024 * 1024
BIG_RUNS = 3
PHASE_TIMEOUT_S = 60.0

TARGETS = {
    "ttfb_p50_ms": 2.5,
    "ttfb_p99_ms": 5.0,
    "rps": 450.0,
    "chunks_per_s": 30_000.0,
    "kb_per_waiting": 25.0,
    "mb_per_big_waiting": 1.1,
    "health_p99_ms": 5.0,
    "stream_vs_floor": 1.0,
    "upload_copies": 1.0,
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


def _spawned_model(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"\0{SPAWN_ENV}=".encode() in b"\0" + f.read()
    except OSError:  # gone
        return False


class Server:
    """``manage.py serve`` as a subprocess with one fake model ``m``."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        scheduler: str,
        pin: bool,
        *,
        model_module: str = "fakellm",
        stages_out: Path | None = None,
        root: Path = ROOT,
    ) -> None:
        self.port = free_port()
        self.model_port = free_port()
        taskset = f"taskset -c {CLIENT_CPU} " if pin else ""
        model = {
            "cmd": f"{taskset}{PY} -m {model_module} --host 127.0.0.1 --port {self.model_port}",
            "proxy": f"http://127.0.0.1:{self.model_port}",
            "concurrencyLimit": 64,  # every paced stream at once
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
        if stages_out is not None:  # the same server, with stage stamps (bench/stages.py)
            env["BENCH_STAGES_OUT"] = str(stages_out)
            cmd = [PY, "-m", "bench.stages", "--config", str(config_path)]
        else:
            cmd = [PY, "manage.py", "serve", "--config", str(config_path)]
        cmd += ["--listen", f"127.0.0.1:{self.port}", "--grace", "2"]
        if pin:
            cmd = ["taskset", "-c", str(SERVER_CPU), *cmd]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=root,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=raise_nofile,  # noqa: PLW1509 - only sets a limit
        )
        self.pid = self.proc.pid  # taskset execs: this is the server itself
        self.children: set[int] = set()

    def model_pid(self) -> int:
        """The model process: the server's only descendant marked as a model's spawn
        (``LLAMASWAP_SPAWN`` in its environment; the server's guard, scheduler/guard.py,
        is not) once the model is loaded."""
        self.children |= descendants(self.pid)
        live = [pid for pid in descendants(self.pid) if _spawned_model(pid)]
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


class Proc:
    """A server as a subprocess in a session of its own, pinned to ``cpu``, its output in
    ``log``; ready once ``GET path`` answers 200."""

    def __init__(
        self,
        cmd: list[str],
        port: int,
        cpu: int | None,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port
        self.log_path = log
        if cpu is not None:
            cmd = ["taskset", "-c", str(cpu), *cmd]
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=raise_nofile,  # noqa: PLW1509 - only sets a limit
        )
        self.pid = self.proc.pid

    def wait_ready(self, path: str = "/health", timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.log_path.name} exited:\n{self.log_path.read_text()[-3000:]}"
                )
            try:
                with Conn(self.port, timeout=1) as c:
                    if c.get(path).status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{self.log_path.name}: not ready:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self._log.close()


class Floor(Proc):
    """The minimal relay (``bench/floor.py``) as a subprocess on the server's core, relaying
    to ``model_port``: the floor every proxy figure is compared with."""

    def __init__(self, tmp: Path, model_port: int, pin: bool) -> None:
        port = free_port()
        cmd = [PY, "-m", "bench.floor", "--port", str(port)]
        cmd += ["--upstream", f"http://127.0.0.1:{model_port}"]
        super().__init__(cmd, port, SERVER_CPU if pin else None, tmp / "floor.log")


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
    floor: list[int] = field(default_factory=list)

    def ms(self, side: str, q: float) -> float:
        return quantile_us(getattr(self, side), q) / 1000


def latency(server: Server, stream: bool, floor_port: int | None = None) -> Latency:
    """Sequential requests, direct, through the floor (if given) and proxied in turn, on
    one keep-alive connection each.

    JSON: time until the whole (short) response is read. SSE: time until the first body
    piece holding an event arrives.
    """
    out = Latency()
    req = dict(CHAT, stream=True) if stream else CHAT
    ports = {"direct": server.model_port, "proxy": server.port}
    if floor_port is not None:
        ports["floor"] = floor_port
    raws = {side: post_bytes(port, req) for side, port in ports.items()}
    with contextlib.ExitStack() as stack:
        conns = {side: stack.enter_context(Conn(port)) for side, port in ports.items()}
        for i in range(WARMUP + SAMPLES):
            for side in ports:
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


async def _rps(
    port: int, clients: int, warmup: float, seconds: float, pid: int, body: dict = CHAT
) -> dict:
    raw = post_bytes(port, body)
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


def rps(
    port: int, pid: int, seconds: float, body: dict = CHAT, warmup: float = RPS_WARMUP_S
) -> dict:
    return asyncio.run(_rps(port, RPS_CLIENTS, warmup, seconds, pid, body))


def stream_rate(port: int) -> dict:
    """One stream of STREAM_TOKENS chunks, best of a few runs (one warm-up first)."""
    return stream_rates({"one": port})["one"]


def stream_rates(ports: dict[str, int], runs: int = STREAM_RUNS) -> dict[str, dict]:
    """One stream of STREAM_TOKENS chunks per side, the sides in turn, ``runs`` times after
    a warm-up each; the best run per side, and every run's rate (``runs_s``)."""
    req = dict(CHAT, stream=True, fake_tokens=STREAM_TOKENS, fake_tokens_per_second=0)
    best: dict[str, dict] = {side: {"runs_s": []} for side in ports}
    with contextlib.ExitStack() as stack:
        conns = {
            side: stack.enter_context(Conn(port, timeout=PHASE_TIMEOUT_S))
            for side, port in ports.items()
        }
        for run in range(runs + 1):
            for side, port in ports.items():
                t0 = time.perf_counter_ns()
                r = conns[side].send(post_bytes(port, req))
                if r.status != 200:
                    raise RuntimeError(f"stream ({side}): HTTP {r.status}")
                seconds = (r.done_ns - t0) / 1e9
                events = r.body.count(b"data: ")
                if events < STREAM_TOKENS:
                    raise RuntimeError(f"stream ({side}): only {events} events")
                result = {"chunks_s": events / seconds, "mb_s": len(r.body) / seconds / 1e6}
                result["events"] = events
                if run:
                    best[side]["runs_s"].append(result["chunks_s"])
                    if result["chunks_s"] > best[side].get("chunks_s", 0):
                        best[side].update(result)
    return best


async def _paced(port: int, pid: int) -> dict:
    """PACED_STREAMS streams at once, each PACED_RATE llama-server-sized events a second:
    events delivered a second and the CPU time ``pid`` spent per event, over a window
    after a warm-up (every stream is running throughout the window)."""
    req = dict(CHAT, stream=True, fake_tokens=PACED_TOKENS, fake_tokens_per_second=PACED_RATE)
    raw = post_bytes(port, req)
    state = {"counting": False, "events": 0, "bytes": 0, "errors": 0}

    async def one(i: int) -> None:
        await asyncio.sleep(i / PACED_RATE / PACED_STREAMS)  # phases spread over a period
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            if head[9:12] != b"200" or b"chunked" not in head.lower():
                state["errors"] += 1
                return
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    return
                data = await reader.readexactly(size + 2)
                if state["counting"]:
                    state["events"] += data.count(b"data: ")
                    state["bytes"] += size
        finally:
            writer.close()

    async with asyncio.timeout(PACED_TOKENS / PACED_RATE + 30):
        tasks = [asyncio.create_task(one(i)) for i in range(PACED_STREAMS)]
        await asyncio.sleep(PACED_WARMUP_S)
        t0, cpu0 = time.perf_counter(), cpu_seconds(pid)
        state["counting"] = True
        await asyncio.sleep(PACED_SECONDS)
        state["counting"] = False
        t1, cpu1 = time.perf_counter(), cpu_seconds(pid)
        await asyncio.gather(*tasks)
    events = max(state["events"], 1)
    return {
        "events_s": state["events"] / (t1 - t0),
        "cpu_us_per_event": (cpu1 - cpu0) / events * 1e6,
        "cpu_share": (cpu1 - cpu0) / (t1 - t0),
        "event_bytes": state["bytes"] / events,
        "errors": state["errors"],
    }


def paced(port: int, pid: int) -> dict:
    return asyncio.run(_paced(port, pid))


def _multipart(size: int) -> tuple[bytes, str]:
    boundary = "benchboundary7MA4YWxkTrZu0gW"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.wav"\r\n'
        "Content-Type: audio/wav\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()
    block = bytes(range(256)) * 4096  # 1 MiB of every byte value
    payload = (block * (size // len(block) + 1))[:size]
    return head + payload + tail, f"multipart/form-data; boundary={boundary}"


def peak_rss_kb(pid: int) -> int:
    return int(proc_status(pid)["VmHWM"].split()[0])


def reset_peak(pid: int) -> bool:
    """Reset the kernel's peak RSS (VmHWM) of ``pid`` to its RSS now."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def upload(port: int, pid: int, body: bytes, content_type: str, runs: int = BIG_RUNS) -> dict:
    """POST ``body`` (multipart, a model field and one file) to the transcription endpoint:
    the best time to the whole answer, and the peak RSS above the RSS before (VmHWM reset
    before every run), the lowest of the runs, in MB and in copies of the body."""
    head = (
        f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    best_s, peaks = float("inf"), []
    for _ in range(runs):
        gc.collect()
        time.sleep(0.3)
        resettable = reset_peak(pid)
        before = rss_kb(pid)
        with Conn(port, timeout=PHASE_TIMEOUT_S) as c:
            t0 = time.perf_counter()
            c.sock.sendall(head)
            c.sock.sendall(body)
            r = c.read()
            seconds = time.perf_counter() - t0
        if r.status != 200:
            raise RuntimeError(f"upload: HTTP {r.status} {r.body[:300]!r}")
        best_s = min(best_s, seconds)
        if resettable:
            peaks.append((peak_rss_kb(pid) - before) / 1024)
    peak_mb = min(peaks) if peaks else float("nan")
    return {
        "seconds": best_s,
        "peak_mb": peak_mb,
        "copies": peak_mb * 1024 * 1024 / len(body),
        "mb": len(body) / 1e6,
    }


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
    print("== proxy: manage.py serve vs the minimal relay vs the model server called directly ==")
    started = time.perf_counter()
    pin = pinning()
    old_affinity = os.sched_getaffinity(0) if pin else None
    nofile = raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    gc_was_enabled = gc.isenabled()
    servers: list[Server | Floor] = []
    r: dict = {}
    try:
        if pin:
            os.sched_setaffinity(0, {CLIENT_CPU})
        env = dict(os.environ, DATABASE_URL=f"sqlite:///{tmp / 'db.sqlite3'}")
        subprocess.run(
            [PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120
        )

        # -- fifo server and the minimal relay: latency, throughput, streams, a big upload
        fifo = Server(tmp, "fifo", "fifo", pin)
        servers.append(fifo)
        fifo.wait_ready()
        with Conn(fifo.port, timeout=PHASE_TIMEOUT_S) as c:  # loads the model
            if (resp := c.send(post_bytes(fifo.port, CHAT))).status != 200:
                raise RuntimeError(f"first request: HTTP {resp.status} {resp.body[:300]!r}")
        floor = Floor(tmp, fifo.model_port, pin)
        servers.append(floor)
        floor.wait_ready()
        model_pid = fifo.model_pid()
        pids = {"direct": model_pid, "floor": floor.pid, "proxy": fifo.pid}
        ports = {"direct": fifo.model_port, "floor": floor.port, "proxy": fifo.port}
        gc.disable()  # a collection in the client is noise on every side
        print("  latency: JSON ...")
        r["lat_json"] = latency(fifo, stream=False, floor_port=floor.port)
        print("  latency: first SSE event ...")
        r["lat_sse"] = latency(fifo, stream=True, floor_port=floor.port)
        gc.enable()
        gc.collect()
        r["rps"] = {}
        for side in ("direct", "floor", "proxy"):
            print(f"  requests/s, {RPS_CLIENTS} clients: {side} ...")
            r["rps"][side] = rps(ports[side], pids[side], 3.0 if side == "direct" else RPS_SECONDS)
        print("    " + ", ".join(f"{v['rps']:,.0f} {k}" for k, v in r["rps"].items()))
        print(f"  one stream of {STREAM_TOKENS:,} chunks, sides in turn ...")
        r["stream"] = stream_rates(ports)
        print("    " + ", ".join(f"{v['chunks_s']:,.0f} {k}" for k, v in r["stream"].items()))
        print(f"  {PACED_STREAMS} streams at {PACED_RATE:g} events/s each ...")
        r["paced"] = {"direct": paced(ports["direct"], pids["direct"])}
        runs: dict[str, list[dict]] = {"floor": [], "proxy": []}
        for side in ("floor", "proxy", "proxy", "floor"):
            runs[side].append(paced(ports[side], pids[side]))
        for side, results in runs.items():
            merged = {k: sum(x[k] for x in results) / len(results) for k in results[0]}
            merged["runs_us"] = [x["cpu_us_per_event"] for x in results]
            r["paced"][side] = merged
        print(
            "    CPU µs/event: "
            + ", ".join(f"{v['cpu_us_per_event']:.0f} {k}" for k, v in r["paced"].items())
        )
        print(f"  one {BIG_UPLOAD >> 20} MiB upload ...")
        body, content_type = _multipart(BIG_UPLOAD)
        r["upload"] = {
            side: upload(ports[side], pids[side], body, content_type)
            for side in ("direct", "floor", "proxy")
        }
        del body
        print(
            "    "
            + ", ".join(
                f"{k} {v['seconds']:.2f} s, peak +{v['peak_mb']:.0f} MB"
                for k, v in r["upload"].items()
            )
        )
        floor.stop()
        servers.remove(floor)
        fifo.stop()
        servers.remove(fifo)

        # -- serial server: 10,000 waiting
        print(f"  {WAITING:,} waiting behind one long request (serial) ...")
        serial = Server(tmp, "serial", "serial", pin)
        servers.append(serial)
        serial.wait_ready()
        with Conn(serial.port, timeout=PHASE_TIMEOUT_S) as c:
            for _ in range(WARMUP):
                if (resp := c.send(post_bytes(serial.port, CHAT))).status != 200:
                    raise RuntimeError(f"warm-up: HTTP {resp.status} {resp.body[:300]!r}")
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
    r["wait"] = wait
    elapsed = time.perf_counter() - started
    return report(r, elapsed, pin, nofile)


def report(r: dict, elapsed: float, pin: bool, nofile: int) -> str:
    t = TARGETS
    rows: list[list[str]] = []
    checks: list[tuple[str, bool]] = []
    for label, lat in (
        ("JSON chat completion, whole response", r["lat_json"]),
        ("streaming, first SSE event", r["lat_sse"]),
    ):
        for q, key in ((0.5, "ttfb_p50_ms"), (0.99, "ttfb_p99_ms")):
            d, f, p = lat.ms("direct", q), lat.ms("floor", q), lat.ms("proxy", q)
            ok = p - d <= t[key]
            name = f"{label}, p{int(q * 100)}, ms (added: minus direct)"
            rows.append(
                [
                    name,
                    f_ms(d),
                    f"{f_ms(f)} (+{f - d:.2f})",
                    f"{f_ms(p)} (+{p - d:.2f})",
                    f"{(p - d) / max(f - d, 1e-9):.2f}× added",
                    f"≤ +{t[key]:g}",
                    verdict(ok),
                ]
            )
            checks.append((name, ok))
    rps_ = r["rps"]
    ok = rps_["proxy"]["rps"] >= t["rps"] and not rps_["proxy"]["errors"]
    rows.append(
        [
            f"requests/s, {RPS_CLIENTS} clients, fifo, non-streaming",
            f_int(rps_["direct"]["rps"]),
            f_int(rps_["floor"]["rps"]),
            f_int(rps_["proxy"]["rps"]),
            f"{rps_['proxy']['rps'] / rps_['floor']['rps']:.2f}×",
            f"≥ {t['rps']:g}",
            verdict(ok),
        ]
    )
    checks.append(("requests/s", ok))
    rows.append(
        [
            "CPU per request at that load, ms",
            f_ms(rps_["direct"]["cpu_ms"]),
            f_ms(rps_["floor"]["cpu_ms"]),
            f_ms(rps_["proxy"]["cpu_ms"]),
            f"{rps_['proxy']['cpu_ms'] / rps_['floor']['cpu_ms']:.2f}×",
            "",
            "",
        ]
    )
    st = r["stream"]
    ratio = st["proxy"]["chunks_s"] / st["floor"]["chunks_s"]
    ok = st["proxy"]["chunks_s"] >= t["chunks_per_s"] and ratio >= t["stream_vs_floor"]
    rows.append(
        [
            f"one stream of {STREAM_TOKENS:,} chunks, SSE events/s (best of {STREAM_RUNS})",
            f_int(st["direct"]["chunks_s"]),
            f_int(st["floor"]["chunks_s"]),
            f_int(st["proxy"]["chunks_s"]),
            f"{ratio:.2f}×",
            f"≥ {t['stream_vs_floor']:g}× relay, ≥ {t['chunks_per_s']:,.0f}",
            verdict(ok),
        ]
    )
    checks.append(("stream", ok))
    rows.append(
        [
            "same stream, MB/s",
            f"{st['direct']['mb_s']:.1f}",
            f"{st['floor']['mb_s']:.1f}",
            f"{st['proxy']['mb_s']:.1f}",
            f"{st['proxy']['mb_s'] / st['floor']['mb_s']:.2f}×",
            "",
            "",
        ]
    )
    pc = r["paced"]
    for key, label in (
        ("events_s", f"{PACED_STREAMS} streams × {PACED_RATE:g} events/s, events/s delivered"),
        ("cpu_us_per_event", "same, CPU per event, µs (model server / relay / proxy)"),
        ("cpu_share", "same, CPU used, share of one core"),
    ):
        ratio = pc["proxy"][key] / pc["floor"][key]
        fmt = (lambda v: f"{v:.2f}") if key == "cpu_share" else f_int
        cells = [label, fmt(pc["direct"][key]), fmt(pc["floor"][key]), fmt(pc["proxy"][key])]
        if key == "cpu_us_per_event":
            ok = ratio <= 1.0
            rows.append([*cells, f"{ratio:.2f}×", "≤ 1× relay", verdict(ok)])
            checks.append(("paced streams, CPU per event", ok))
        else:
            rows.append([*cells, f"{ratio:.2f}×", "", ""])
    up = r["upload"]
    rows.append(
        [
            f"one {BIG_UPLOAD >> 20} MiB multipart upload, seconds to the answer",
            f"{up['direct']['seconds']:.2f}",
            f"{up['floor']['seconds']:.2f}",
            f"{up['proxy']['seconds']:.2f}",
            f"{up['proxy']['seconds'] / up['floor']['seconds']:.2f}×",
            "",
            "",
        ]
    )
    ok = up["proxy"]["copies"] <= t["upload_copies"]
    rows.append(
        [
            "same, peak memory above idle, MB (copies of the body)",
            f"{up['direct']['peak_mb']:.0f} ({up['direct']['copies']:.1f})",
            f"{up['floor']['peak_mb']:.0f} ({up['floor']['copies']:.1f})",
            f"{up['proxy']['peak_mb']:.0f} ({up['proxy']['copies']:.1f})",
            f"{up['proxy']['peak_mb'] / up['floor']['peak_mb']:.2f}×",
            f"≤ {t['upload_copies']:g} copy",
            verdict(ok),
        ]
    )
    checks.append(("upload memory", ok))
    header = [
        "measure",
        "direct",
        "minimal relay",
        "product",
        "product / relay",
        "target",
        "",
    ]
    wait = r["wait"]
    rps_proxy = rps_["proxy"]
    lines_note = (
        f"Direct = the same client code sending the same request to the model process's own "
        f"port (the one the proxy relays to). Minimal relay = `bench/floor.py`: a plain async "
        "Django view relaying with one httpx `AsyncClient`, Django's stock ASGI handler, daphne's "
        "defaults, on the server's core, relaying to the same model process. Latency: "
        f"{SAMPLES} sequential requests per side after {WARMUP} warm-up, the three sides in "
        "turn, one keep-alive connection each; added = quantile minus direct's. Requests/s: "
        f"{RPS_CLIENTS} keep-alive raw-socket clients, `routing.scheduler.use: fifo`, "
        f"`concurrencyLimit: 64`, {RPS_SECONDS:g} s after {RPS_WARMUP_S:g} s warm-up "
        f"({rps_proxy['requests']:,} proxied, {rps_proxy['errors']} errors); CPU per request "
        "is the process's utime+stime over the window. Stream: `fake_tokens: "
        f"{STREAM_TOKENS}`, no pacing, the sides in turn, best of {STREAM_RUNS} after a warm-up "
        f"(every run, events/s: relay {', '.join(f_int(x) for x in st['floor']['runs_s'])}; "
        f"product {', '.join(f_int(x) for x in st['proxy']['runs_s'])}). Paced streams: "
        f"{PACED_STREAMS} at once, `fake_tokens_per_second: {PACED_RATE:g}`, events of "
        f"{pc['proxy']['event_bytes']:.0f} bytes (llama-server's chat chunks are the same "
        f"size), CPU over {PACED_SECONDS:g} s after {PACED_WARMUP_S:g} s, relay and product "
        "twice each (relay, product, product, relay; CPU µs per event, relay "
        f"{', '.join(f'{x:.0f}' for x in pc['floor']['runs_us'])}, product "
        f"{', '.join(f'{x:.0f}' for x in pc['proxy']['runs_us'])}). Upload: a multipart body "
        f"(a `model` field and one {BIG_UPLOAD >> 20} MiB file) to `/v1/audio/transcriptions`, "
        f"best time of {BIG_RUNS}; peak memory = the kernel's peak RSS (VmHWM, reset before "
        "each run) minus the RSS before, the lowest of the runs."
    )
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
        f"the server and the minimal relay pinned to core {SERVER_CPU} (`taskset -c "
        f"{SERVER_CPU}`, never both under load at once), the model process and this load "
        f"generator sharing core {CLIENT_CPU}"
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
        lines_note,
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
