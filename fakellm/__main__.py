"""``python -m fakellm --port N``: serve :mod:`fakellm.app` with daphne, in this process.

Prints ``fakellm: listening on ...`` to stderr once the port accepts connections, then
``fakellm: model loaded`` when ``--load-seconds`` have passed (until then every request
but ``/fake/*`` gets llama-server's 503 "Loading model"). SIGTERM or SIGINT: exit 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

REQUEST_BUFFER_SIZE = 64 * 1024 * 1024
"""daphne hands the body over in pieces of this size: one piece for any sane request."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fakellm", description="A simulated llama-server (ASGI, on daphne)."
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--load-seconds", type=float, default=0.0)
    parser.add_argument("--tokens-per-second", type=float, default=0.0)
    parser.add_argument("--model-name", default="")
    parser.add_argument("--log-requests", action="store_true")
    parser.add_argument("--record-file", default="", help="append each request as a JSON line")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Every model swap in the tests waits for this start-up, most of it importing daphne
    # and Twisted. fakellm speaks neither WebSocket nor TLS, so two parts are skipped
    # (about 100 ms): autobahn's native extensions, with their cffi and pycparser
    # (AUTOBAHN_USE_NVX=0 is autobahn's own switch), and pyOpenSSL, without which Twisted
    # leaves TLS out.
    os.environ.setdefault("AUTOBAHN_USE_NVX", "0")
    sys.modules.setdefault("OpenSSL", None)  # type: ignore[arg-type]
    # daphne.server installs the asyncio Twisted reactor when imported: before Twisted.
    import daphne.server
    from daphne.server import Server

    from fakellm.app import State, create_app, log

    state = State(
        load_seconds=args.load_seconds,
        tokens_per_second=args.tokens_per_second,
        model_name=args.model_name,
        log_requests=args.log_requests,
        record_file=args.record_file,
    )
    listening = []

    class FakeLLMServer(Server):  # type: ignore[misc]  # daphne ships no types
        def listen_success(self, port: object) -> None:
            super().listen_success(port)
            listening.append(port)
            log(
                f"listening on http://{args.host}:{args.port} pid={os.getpid()} "
                f"model={args.model_name or '-'} load_seconds={args.load_seconds}"
            )

    # Twisted endpoint syntax escapes ':' (IPv6); its default backlog of 50 drops bursts.
    interface = args.host.replace(":", "\\:")
    server = FakeLLMServer(
        create_app(state),
        endpoints=[f"tcp:port={args.port}:interface={interface}:backlog=1024"],
        signal_handlers=False,
        verbosity=0,
        server_name="fakellm",
        request_buffer_size=REQUEST_BUFFER_SIZE,
    )
    loop = daphne.server.twisted_loop

    stopping = False

    def stop() -> None:
        from twisted.internet import reactor

        nonlocal stopping
        if not stopping:  # a second signal finds it stopping already
            stopping = True
            log("shutting down")
            core: Any = reactor  # its zope interfaces read as unbound methods to plain mypy
            core.stop()

    def ready() -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop)
        if args.load_seconds > 0:
            loop.call_later(args.load_seconds, log, "model loaded")
        else:
            log("model loaded")

    server.ready_callable = ready
    server.run()
    if not listening:
        log(f"could not listen on {args.host}:{args.port}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
