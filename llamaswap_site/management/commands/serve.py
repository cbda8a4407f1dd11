"""``llamaswap serve`` (``manage.py serve``): the whole app under daphne in this process, with the dispatcher.

The dispatcher starts when the server starts (daphne has no ASGI lifespan, and
``AppConfig.ready()`` runs for every management command). SIGINT/SIGTERM: stop accepting,
let running requests finish for up to ``--grace`` seconds, stop every model process, exit.
A second signal exits at once (still stopping the model processes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

if TYPE_CHECKING:
    from scheduler.dispatcher import Dispatcher

log = logging.getLogger("llamaswap.serve")

REQUEST_BUFFER_SIZE = 16 * 1024 * 1024


ALL_INTERFACES = "0.0.0.0"


def parse_listen(value: str) -> tuple[str, int]:
    """``--listen`` as llama-swap (Go) reads it: ``HOST:PORT``, ``[IPv6]:PORT``, ``:PORT``.

    ``:PORT`` means every interface, as Go's ``net.Listen`` does; here IPv4 ``0.0.0.0``
    (``[::]:PORT`` listens on IPv6 too, dual stack where the OS allows it).
    """
    host, sep, port = value.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise CommandError(
            f"--listen must be HOST:PORT, [IPV6]:PORT or :PORT (every interface), got {value!r}"
        )
    if host.startswith("[") != host.endswith("]"):
        raise CommandError(f"--listen: unbalanced brackets in {value!r}")
    return (host.strip("[]") or ALL_INTERFACES), int(port)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ``::1``); any other
    name counts as reachable from outside."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, port: int, keys: bool = False) -> str | None:
    """The start-up warning for a listener beyond loopback without API keys."""
    if is_loopback(host) or keys:
        return None
    where = "every interface" if host in (ALL_INTERFACES, "::") else host
    return (
        f"listening on {url_host(host)}:{port} ({where}) without API keys: anyone who can "
        "reach this port can use the models and unload them. Set apiKeys in the config (or "
        "issue keys in the admin), listen on 127.0.0.1:PORT, or put a firewall in front."
    )


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def allowed_hosts_for(host: str) -> list[str]:
    """The Host headers to accept when ALLOWED_HOSTS is not given: the names of the
    listen address (loopback: localhost, 127.0.0.1, [::1]); every interface: any
    (``*``), since the names it is reached by cannot be known."""
    if host in (ALL_INTERFACES, "::"):
        return ["*"]
    names = list(settings.LOOPBACK_HOSTS) if is_loopback(host) else []
    name = url_host(host).lower()
    return names if name in names else [*names, name]


ANY_HOST_WARNING = (
    "listening on every interface without ALLOWED_HOSTS: any Host header is accepted, so "
    "nothing stops DNS rebinding (a web page reaching this port through its own name). "
    "Set ALLOWED_HOSTS=name1,name2 to the names clients use."
)


def tls_files(cert: str, key: str) -> tuple[str, str] | None:
    """``--tls-cert-file``/``--tls-key-file`` (llama-swap's ``-tls-*``): both or neither."""
    if bool(cert) != bool(key):
        raise CommandError("both --tls-cert-file and --tls-key-file must be provided for TLS")
    for name, file in (("--tls-cert-file", cert), ("--tls-key-file", key)):
        if file and not os.path.isfile(file):
            raise CommandError(f"{name}: no such file {file!r}")
    return (cert, key) if cert else None


def endpoint(host: str, port: int, tls: tuple[str, str] | None) -> str:
    """The Twisted endpoint daphne listens on: ``tcp:``, or ``ssl:`` with the PEM files.
    Endpoint syntax escapes ``:`` (IPv6, paths) and ``=``; Twisted's default backlog of
    50 drops connections in a burst."""

    def esc(text: str) -> str:
        return text.replace("\\", "\\\\").replace(":", "\\:").replace("=", "\\=")

    common = f"port={port}:interface={esc(host)}:backlog=1024"
    if tls is None:
        return f"tcp:{common}"
    cert, key = tls
    return f"ssl:{common}:certKey={esc(os.path.abspath(cert))}:privateKey={esc(os.path.abspath(key))}"


class Command(BaseCommand):
    help = "Serve llamaswap (proxy, dashboard, metrics) with daphne."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--config", default="", help="llama-swap config.yaml (or LLAMASWAP_CONFIG)")
        parser.add_argument(
            "--config-dir",
            default="",
            help="a directory of *.yml/*.yaml fragments merged into the config (llama-swap's -config-dir)",
        )
        parser.add_argument(
            "--watch-config",
            action="store_true",
            help="reload when a config file changes (polled every 2 s); SIGHUP reloads too",
        )
        parser.add_argument(
            "--listen",
            default="",
            help="HOST:PORT, [IPV6]:PORT, or :PORT for every interface "
            "(default 127.0.0.1:8080, 127.0.0.1:8443 with TLS)",
        )
        parser.add_argument("--tls-cert-file", default="", help="serve HTTPS: the certificate (PEM)")
        parser.add_argument("--tls-key-file", default="", help="serve HTTPS: the private key (PEM)")
        parser.add_argument("--grace", type=float, default=30.0, help="seconds running requests get at shutdown")
        parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
        parser.add_argument(
            "--node",
            default="",
            help="this server's name in a fleet (or LLAMASWAP_NODE); with REDIS_URL: fleet mode (docs/fleet.md)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # daphne.server installs the asyncio Twisted reactor: import it first.
        import daphne.server
        from daphne.server import Server

        from llamaswap_site import http_server

        http_server.install()  # protocol-level refusals (Twisted, daphne) as JSON errors

        from llamaswap_site import ws_limits
        from llamaswap_site.logfmt import apply_log_config
        from llamaswap_site.reload import Reloader
        from proxy.collector import collector
        from proxy.upstream import Upstreams
        from scheduler import runtime
        from scheduler.config import ConfigError
        from scheduler.dispatcher import Dispatcher
        from scheduler.keys import KeyRing
        from scheduler.sources import load_sources
        from scheduler.spawn import prepare_server

        tls = tls_files(options["tls_cert_file"], options["tls_key_file"])
        path = options["config"] or (settings.LLAMASWAP_CONFIG if not options["config_dir"] else "")
        config_dir = options["config_dir"]
        if not path and not config_dir:
            raise CommandError("no config: pass --config FILE (or set LLAMASWAP_CONFIG) and/or --config-dir DIR")
        try:
            config = load_sources(path, config_dir)
        except ConfigError as error:
            raise CommandError(f"config {path or config_dir}: {error}") from None
        apply_log_config(config)  # logLevel, logTimeFormat, logToStdout: from the first line on
        from scheduler import proxylog

        proxylog.install()  # /logs/stream/proxy and the logs page keep llamaswap's own lines
        reloader = Reloader(path, config_dir)
        prepare_server()  # state dir, subreaper, kill what dead instances left (scheduler.spawn)
        http_server.install_limits(config.limits)  # slow or oversized clients, per connection
        ws_limits.install_websocket_limits()  # websocket floods and clients that do not read
        for warning in config.warnings:
            self.stderr.write(f"warning: {warning}")
        host, port = parse_listen(options["listen"] or ("127.0.0.1:8443" if tls else "127.0.0.1:8080"))
        # The Host names to accept, before the app is built (the websocket route reads them).
        if not os.getenv("ALLOWED_HOSTS", "").strip():
            settings.ALLOWED_HOSTS = allowed_hosts_for(host)
            if settings.ALLOWED_HOSTS == ["*"]:
                self.stderr.write(f"warning: {ANY_HOST_WARNING}")
                log.warning(ANY_HOST_WARNING)
        exposed = exposure_warning(host, port, keys=bool(config.api_keys))
        if exposed:
            self.stderr.write(f"warning: {exposed}")
            log.warning(exposed)

        # Admin edits of the scheduler settings survive a restart unless the config
        # file's value for that key changed since the last start (scheduler.core.settings.merge_at_start).
        from control.keys import reload_at_start as reload_issued_keys
        from control.settings_store import apply_at_start_or_config
        from fleet.wiring import node_name

        # A named node merges its config file under the fleet's and its own edits (docs/fleet.md).
        stored = apply_at_start_or_config(config.scheduler, node_name(options["node"]))
        config = dataclasses.replace(config, scheduler=stored.settings)

        from llamaswap_site.observers import build_observers, replay_activity_journals

        replay_activity_journals()  # records a killed server journaled, before serving
        observers = build_observers(config)
        dispatcher = Dispatcher(config, observers=observers)
        apply_log_config(config, dispatcher.logs)  # logToStdout, logTimeFormat
        dispatcher.settings_source = stored.source
        upstreams = Upstreams()
        runtime.install(
            runtime.Runtime(
                config=config,
                dispatcher=dispatcher,
                upstreams=upstreams,
                keys=KeyRing(config.api_keys),
                reloader=reloader,
            )
        )
        from fleet.wiring import from_settings as fleet_from_settings

        fleet_node = fleet_from_settings(options["node"], dispatcher, host, port, tls is not None)
        reload_issued_keys()  # the admin-issued API keys (control.keys); no table: logged
        from dashboard.management.commands.ensure_admin import account_hint

        admin_hint = account_hint()  # here: the ORM refuses to run inside the event loop
        from llamaswap_site.asgi import application

        loop = daphne.server.twisted_loop
        ports: list[Any] = []

        class LlamaswapServer(Server):  # type: ignore[misc]  # daphne has no types
            def listen_success(self, port_obj: Any) -> None:
                ports.append(port_obj)
                super().listen_success(port_obj)

        server = LlamaswapServer(
            application,
            endpoints=[endpoint(host, port, tls)],
            signal_handlers=False,
            action_logger=_access_log if options["access_log"] else None,
            verbosity=0,
            application_close_timeout=options["grace"] + 5,
            # Daphne hands the body to the app in pieces of this size, all at once. One
            # piece (bodies up to 16 MiB) is the body itself: no join, no copy. Measured
            # with 200 waiting 1 MB requests: 0.98 MB each, against 1.08 MB with daphne's
            # 8 KiB pieces (freed pieces the heap keeps).
            request_buffer_size=REQUEST_BUFFER_SIZE,
        )
        stopping = False

        async def shutdown() -> None:
            log.info("shutting down", extra={"grace": options["grace"]})
            for task in list(background):  # --watch-config, a reload in progress
                task.cancel()
            for port_obj in ports:
                port_obj.stopListening()
            try:
                if fleet_node is not None:  # out of the fleet first: nothing more is placed here
                    await fleet_node.stop()
                await dispatcher.stop(grace=options["grace"])
                await upstreams.aclose()
                for obs in observers:  # e.g. the recorder saves what it buffered
                    stopper = getattr(obs, "stop", None)
                    if stopper is not None:
                        await stopper()
            finally:
                runtime.install(None)
                _stop_reactor()

        def on_signal(signum: int) -> None:
            nonlocal stopping
            if stopping:  # second signal: models down, out now
                loop.create_task(_hard_stop(dispatcher))
                return
            stopping = True
            loop.create_task(shutdown())

        background: set[asyncio.Task[Any]] = set()

        def spawn(coro: Coroutine[Any, Any, Any]) -> None:
            task = loop.create_task(coro)
            background.add(task)
            task.add_done_callback(settled)

        def settled(task: asyncio.Task[Any]) -> None:
            # Logged here, not lost as "Task exception was never retrieved" at exit.
            background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("background task %s failed", task.get_name(), exc_info=task.exception())

        def on_hangup() -> None:  # SIGHUP: reload the config in place (llama-swap's signal for it)
            if not stopping:
                spawn(reloader.reload("SIGHUP"))

        def ready() -> None:
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, on_signal, signum)
            loop.add_signal_handler(signal.SIGHUP, on_hangup)
            if options["watch_config"]:
                spawn(reloader.watch())
            loop.create_task(dispatcher.start())
            if fleet_node is not None:
                loop.create_task(fleet_node.start())
            # Full garbage collections while a model works, or on a timer (proxy/collector.py).
            collector.install()
            spawn(collector.pace())
            for obs in observers:
                starter = getattr(obs, "start", None)
                if starter is not None:
                    loop.create_task(starter())
            base = f"{'https' if tls else 'http'}://{url_host(host)}:{port}/"
            self.stdout.write(
                f"llamaswap serving {len(config.models)} model(s) from {path or config_dir} on {base} "
                f"(scheduler: {config.scheduler.use.value})"
            )
            self.stdout.write(
                f"dashboard: {base}  admin: {base}admin/"
                + (f" ({admin_hint})" if admin_hint else "")
            )
            self.stdout.flush()

        server.ready_callable = ready
        server.run()
        if not ports:
            raise CommandError(f"could not listen on {host}:{port}")
        sys.stdout.flush()


async def _hard_stop(dispatcher: Dispatcher) -> None:
    await dispatcher.stop(grace=0)
    _stop_reactor()


def _stop_reactor() -> None:
    from twisted.internet import reactor

    core: Any = reactor  # its zope interfaces read as unbound methods to mypy
    if core.running:
        core.stop()


def _access_log(protocol: str, action: str, details: dict[str, Any]) -> None:
    if protocol == "http" and action == "complete":
        log.info(
            "%s %s %s %s",
            details.get("client", ""),
            details.get("method"),
            details.get("path"),
            details.get("status"),
        )
