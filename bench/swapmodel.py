"""A model server that starts in ~0.1 s and notes each stage of its life, for ``bench swap``.

``python -I -S bench/swapmodel.py PORT STAMPS [DELAY]``: standard library only, run as a
script (no package import, so the interpreter's start-up is as short as it gets). It stamps
``start`` first thing (and exits there if PORT is 0), sleeps DELAY seconds (default 0.1: a
model "loading"), listens and
stamps ``listen``; then answers ``GET /health`` 200 (the first one stamped ``health``) and any
``POST`` with a short chat-completion JSON, stamping ``arrive`` (its request line read) and
``answered`` (the last byte of the answer handed to the kernel). SIGTERM stamps ``term`` and
the process stamps ``exit`` just before it exits. Stamps are ``time.monotonic_ns()``
(CLOCK_MONOTONIC, comparable across processes), appended to STAMPS as ``EVENT PID NS`` lines.
"""

import os
import signal
import socket
import sys
import threading
import time

START = time.monotonic_ns()
PORT = int(sys.argv[1])
STAMPS = os.open(sys.argv[2], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
DELAY = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
PID = os.getpid()
ANSWER = (
    b'{"id":"chatcmpl-swap","object":"chat.completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
    b'"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,'
    b'"total_tokens":2}}'
)
_first_health = [True]


def stamp(event: str, ns: int | None = None) -> None:
    os.write(STAMPS, f"{event} {PID} {ns if ns is not None else time.monotonic_ns()}\n".encode())


def on_term(signum: int, frame: object) -> None:
    stamp("term")
    stamp("exit")
    os._exit(0)


def serve(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    try:
        while True:
            while b"\r\n\r\n" not in buf:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            arrived = time.monotonic_ns()
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path = lines[0].split(b" ")[:2]
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(buf) < length:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
            buf = buf[length:]
            body = b'{"status":"ok"}' if method == b"GET" else ANSWER
            if method == b"GET" and path == b"/health" and _first_health[0]:
                _first_health[0] = False
                stamp("health")  # before the answer: stamped before the proxy can see it
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            if method == b"POST":
                stamp("arrive", arrived)
                stamp("answered")
    except OSError:
        return
    finally:
        conn.close()


def main() -> None:
    signal.signal(signal.SIGTERM, on_term)
    stamp("start", START)
    if PORT == 0:  # bench swap's calibration: how long a spawn takes to run its first line
        return
    time.sleep(DELAY)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", PORT))
    listener.listen(64)
    stamp("listen")
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
