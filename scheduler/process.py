"""With :mod:`scheduler.spawn`, the only code that touches a model subprocess: start it,
health-check it, stop it, reap it.

One :class:`ModelProcess` per configured model. It runs at most one OS process at a time and
walks :class:`ModelState` like llama-swap's ``internal/process`` (the state machine is
:class:`scheduler.lifecycle.Lifecycle`, shared with the fake in :mod:`scheduler.testing`;
``ModelState`` and ``ModelStartError`` are importable from here too)::

    STOPPED --start()--> STARTING --healthy--> READY --stop()--> STOPPING --reaped--> STOPPED
                            |                    |
                            +--fails/stop()------+--exits on its own (on_exit)------> STOPPED

Process groups: each model runs in its own session (``start_new_session=True``), so a stop
signals the whole tree, e.g. a shell wrapper and the server it backgrounded. Once the leader
has been reaped, whatever is left in its group is SIGKILLed, and so is every process carrying
that spawn's environment marker (a descendant that left the group with ``setsid``); the
model counts as exited only once they are all dead (bounded by :data:`REAP_TIMEOUT`).

Parent death: on Linux each spawned process gets ``PR_SET_PDEATHSIG = SIGKILL`` (set by
``setpriv --pdeathsig KILL`` exec'ing the command when util-linux has it, else by a
``preexec_fn``), so if this server is SIGKILLed its model processes die with it. That
reaches only the direct child: a wrapper's grandchildren survive. For those, every spawned
process (and so every descendant that keeps its environment) carries
``LLAMASWAP_OWNER=<server pid>:<server start time>``, and each server instance keeps a
record of the process groups it started, one JSON file per instance in the state
directory (:func:`set_state_dir`; default ``$LLAMASWAP_STATE_DIR``,
else ``<project>/var/``). At start-up ``manage.py serve`` calls :func:`prepare_server`,
which makes the server a child subreaper and runs :func:`reap_leftovers`: the leftovers of
every *dead* instance are SIGKILLed; live instances are never touched. It then starts the
server's guard (:mod:`scheduler.guard`): a small process that reads EOF on a pipe the moment
the server dies, SIGKILLed or not, and sweeps the server's recorded groups and marked
processes at once, so a wrapped model dies with the server rather than at the next start.
The markers, records and sweep live in :mod:`scheduler.sweep` (standard library only, so
the guard starts light) and are re-exported here; spawning, the child's group and
:func:`prepare_server` in :mod:`scheduler.spawn`; the output in :mod:`scheduler.logbuffer`.

The kernel fires the parent-death signal when the *thread* that forked the child exits, not
the process: spawn only from the long-lived event loop that owns the models (asyncio spawns
from the loop's own thread), never from a loop running in a short-lived worker thread such
as one made by ``async_to_sync``.

Everything here must be used from one event loop; nothing is thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import httpx

from scheduler.config import ModelConfig
from scheduler.lifecycle import STOPPED_WHILE_STARTING, Lifecycle
from scheduler.lifecycle import ModelStartError as ModelStartError  # re-exported
from scheduler.lifecycle import ModelState as ModelState  # re-exported
from scheduler.logbuffer import LogBuffer as LogBuffer  # re-exported
from scheduler.spawn import LOG_DRAIN_TIMEOUT, Child, describe_exit, port_in_use, spawn
from scheduler.sweep import (  # noqa: F401  the supervision API is also the process layer's
    OWNER_ENV,
    SPAWN_ENV,
    owner_id,
    reap_leftovers,
    set_state_dir,
    state_dir,
)

logger = logging.getLogger(__name__)

HEALTH_POLL_INTERVAL = 0.1
"""The longest wait between two health checks (the backoff's ceiling)."""
HEALTH_FIRST_DELAY = 0.002
HEALTH_BACKOFF = 1.2
"""The first check is sent as soon as the process is spawned; the waits between checks start
at :data:`HEALTH_FIRST_DELAY` and grow by :data:`HEALTH_BACKOFF` up to
:data:`HEALTH_POLL_INTERVAL` (:func:`health_delays`): a server healthy after 0.1 s is found
within ~20 ms of it, a slow one every 0.1 s once the waits have grown (27 checks in its
first second)."""
HEALTH_OUTPUT_SPACING = 0.005
"""A starting server's output prompts a health check at once, at most one every this many
seconds (a server that writes without pause is checked 200 times a second at the most;
a line naming the check's path, a server logging the check itself, prompts none):
llama-server writes ``model loaded`` the moment its ``/health`` turns 200, fakellm too, so
the check finds it within a few ms however far the backoff has grown."""
HEALTH_REQUEST_TIMEOUT = 5.0


def health_delays(
    first: float = HEALTH_FIRST_DELAY,
    factor: float = HEALTH_BACKOFF,
    ceiling: float = HEALTH_POLL_INTERVAL,
) -> Iterator[float]:
    """The waits between health checks: ``first``, growing by ``factor``, capped at
    ``ceiling``, forever."""
    delay = first
    while True:
        yield min(delay, ceiling)
        delay = min(delay * factor, ceiling)


async def _http_ok(url: str, timeout: float) -> bool:
    """One plain-HTTP ``GET url``: True if it answered 200. A connection refused costs a
    connect attempt (no client, no TLS context), so a fast first schedule stays cheap."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, parts.port or 80)
            netloc = parts.netloc.rpartition("@")[2]
            writer.write(
                f"GET {target} HTTP/1.1\r\nHost: {netloc}\r\nConnection: close\r\n\r\n".encode()
            )
            status = (await reader.readline()).split(b" ", 2)
            return len(status) >= 2 and status[0].startswith(b"HTTP/") and status[1] == b"200"
    except (OSError, TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()


# -- the model process -----------------------------------------------------------------------

ExitCallback = Callable[["ModelProcess"], None]


class ModelProcessLike(Protocol):
    """What the dispatcher relies on (its ``process_factory`` returns one, and mypy checks
    the dispatcher against this, not against :class:`ModelProcess`);
    :class:`scheduler.testing.FakeModelProcess` has it too."""

    config: ModelConfig

    @property
    def state(self) -> ModelState: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def exited(self) -> asyncio.Event: ...
    @property
    def alive(self) -> bool: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


class ModelProcess(Lifecycle):
    """One model's server process. See the module docstring for states and signals.

    ``on_exit(self)`` is called (synchronously, on the loop) when a READY process exits on
    its own, after it has been reaped and its state set to STOPPED. It is not called for
    exits caused by :meth:`stop` or during a start: those are reported by their own return
    or exception. Nor is it called when :meth:`stop` was called after the process died but
    before its exit was reported (:attr:`alive` already False, state still READY): the stop
    wins, goes STOPPING at once, returns once the process is reaped, and ``returncode`` is
    the process's own.
    """

    def __init__(
        self,
        config: ModelConfig,
        logs: LogBuffer,
        *,
        http_client: httpx.AsyncClient | None = None,
        on_exit: ExitCallback | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.logs = logs
        self.on_exit = on_exit
        self._http_client = http_client
        self._child: Child | None = None

    def __repr__(self) -> str:
        return f"<ModelProcess {self.config.id} {self._state.value} pid={self.pid}>"

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def pid(self) -> int | None:
        """The pid of the current process, or of the last one once it has exited."""
        return self._child.pid if self._child is not None else None

    @property
    def alive(self) -> bool:
        """True while the current OS process exists and has not exited.

        It turns False the moment the process dies, before anything else changes: until
        asyncio has reaped it and this object has torn down its group (a few loop iterations,
        up to :data:`REAP_TIMEOUT` when a leftover will not die), ``state`` may still be READY
        and ``exited`` unset, and ``on_exit`` has not been called yet.
        """
        return self._child is not None and self._child.alive

    def _changed(self, old: ModelState, new: ModelState) -> None:
        logger.info(
            "model %s: %s -> %s",
            self.id,
            old.value,
            new.value,
            extra={"action": "state", "model": self.id, "old": old.value, "new": new.value},
        )

    # -- start (Lifecycle.start) ---------------------------------------------------------------

    async def _start(self) -> None:
        config = self.config
        if not config.cmd:
            self._exited.set()
            self._set_state(ModelState.STOPPED)
            raise ModelStartError(self.id, "cmd is empty")
        try:
            # Its health check must not be answered by a process it did not start.
            squatter = await port_in_use(config.proxy)
            if squatter is not None:
                host, port = squatter
                cause = (
                    f"port {host}:{port} is already in use by another process "
                    f"(something accepts connections at {config.proxy} before the model runs)"
                )
                logger.warning(
                    "model %s: %s",
                    self.id,
                    cause,
                    extra={"action": "port_in_use", "model": self.id, "host": host, "port": port},
                )
                raise ModelStartError(self.id, cause)
            if self._abort.is_set():
                raise ModelStartError(self.id, STOPPED_WHILE_STARTING)
            child = await spawn(config.cmd, config.env, self.id, self.logs)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self._exited.set()
            self._set_state(ModelState.STOPPED)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ModelStartError(self.id, f"could not run {config.cmd[0]!r}: {reason}") from exc
        except BaseException:  # the port check's error, a stop or a cancel: nothing runs
            self._exited.set()
            self._set_state(ModelState.STOPPED)
            raise
        self._child = child
        logger.info(
            "model %s: spawned pid %d",
            self.id,
            child.pid,
            extra={"action": "spawn", "model": self.id, "pid": child.pid, "cmd": config.cmd},
        )
        self._spawn_task(self._watch(child, self._exited), "watch")

        try:
            failure = await self._wait_healthy()
        except BaseException:
            await asyncio.shield(self._begin_stop())
            raise
        if failure is not None:
            logger.warning(
                "model %s: start failed: %s",
                self.id,
                failure,
                extra={"action": "start_failed", "model": self.id, "cause": failure},
            )
            await asyncio.shield(self._begin_stop())
            raise ModelStartError(self.id, failure)

    async def _wait_healthy(self) -> str | None:
        """None once healthy, else why not. Stop and exit win over a simultaneous success."""
        config = self.config
        waits: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self._abort.wait()),
            asyncio.ensure_future(self._exited.wait()),
        ]
        checker = None
        if config.check_endpoint is not None:
            url = config.proxy.rstrip("/") + "/" + config.check_endpoint.lstrip("/")
            checker = asyncio.ensure_future(self._poll_health(url))
            waits.append(checker)
        try:
            if checker is not None:
                await asyncio.wait(
                    waits,
                    timeout=config.health_check_timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            else:
                await asyncio.sleep(0)  # let an already-set abort or a spawn failure show
        finally:
            for task in waits:
                task.cancel()
        if self._abort.is_set():
            return STOPPED_WHILE_STARTING
        if self._exited.is_set():
            assert self._returncode is not None
            return f"process {describe_exit(self._returncode)} before becoming healthy"
        if checker is None:
            return None
        if checker.done() and not checker.cancelled():
            exc = checker.exception()
            if exc is None:
                return None
            return f"health check failed: {exc}"
        return f"health check timed out after {config.health_check_timeout:g}s"

    async def _poll_health(self, url: str) -> None:
        """Return once ``url`` answers 200; connection errors and other statuses are retried
        on the :func:`health_delays` schedule, and sooner when the server writes output
        (:data:`HEALTH_OUTPUT_SPACING`). Plain HTTP is checked with a bare GET (see
        :func:`_http_ok`); HTTPS, or an injected ``http_client``, through httpx."""
        client = self._http_client
        owned = client is None and not url.startswith("http://")
        if owned:
            client = httpx.AsyncClient(trust_env=False)
        child = self._child
        spoke = None
        if child is not None:
            spoke = child.protocol.spoke
            child.protocol.quiet = b" " + urllib.parse.urlsplit(url).path.encode()
        loop = asyncio.get_running_loop()
        try:
            for delay in health_delays():
                if spoke is not None:
                    spoke.clear()  # output from here on, the check's own time included
                if await self._health_once(client, url):
                    return
                if spoke is None:
                    await asyncio.sleep(delay)
                    continue
                checked = loop.time()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await spoke.wait()
                        rest = HEALTH_OUTPUT_SPACING - (loop.time() - checked)
                        if rest > 0:
                            await asyncio.sleep(rest)
        finally:
            if owned and client is not None:
                await client.aclose()

    async def _health_once(self, client: httpx.AsyncClient | None, url: str) -> bool:
        """One health check: True if ``url`` answered 200."""
        if client is None:
            return await _http_ok(url, HEALTH_REQUEST_TIMEOUT)
        try:
            response = await client.get(url, timeout=HEALTH_REQUEST_TIMEOUT)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def _watch(self, child: Child, exited: asyncio.Event) -> None:
        returncode = await child.wait()
        # The leader is reaped; anything left in its group (a wrapper's background child),
        # or carrying its marker, goes too: the model has exited once its whole tree is dead
        # (so its port is free for whatever starts next).
        try:
            await child.teardown(self.id)
        except Exception:  # never leave exited unset: stop() waits for it
            logger.exception("model %s: group teardown failed", self.id, extra={"model": self.id})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(child.protocol.output_closed), LOG_DRAIN_TIMEOUT)
        child.transport.close()
        if self._child is child:
            self._returncode = returncode
        exited.set()
        logger.info(
            "model %s: pid %d %s",
            self.id,
            child.pid,
            describe_exit(returncode),
            extra={"action": "exit", "model": self.id, "pid": child.pid, "returncode": returncode},
        )
        if self._child is child and self._state is ModelState.READY:
            logger.warning(
                "model %s: exited unexpectedly (%s)",
                self.id,
                describe_exit(returncode),
                extra={"action": "crash", "model": self.id, "returncode": returncode},
            )
            self._set_state(ModelState.STOPPED)
            if self.on_exit is not None:
                try:
                    self.on_exit(self)
                except Exception:
                    logger.exception("on_exit callback failed", extra={"model": self.id})

    # -- stop (Lifecycle.stop) ---------------------------------------------------------------

    async def _stop_process(self) -> None:
        child = self._child
        self._set_state(ModelState.STOPPING)
        try:
            if child is not None and child.running:
                await self._terminate(child)
            await self._exited.wait()
        finally:
            self._set_state(ModelState.STOPPED)

    async def _terminate(self, child: Child) -> None:
        """cmd_stop or SIGTERM to the group; SIGKILL to the group after ``unload_timeout``."""
        config = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.unload_timeout
        stopper = None
        if config.cmd_stop:
            argv = tuple(arg.replace("${PID}", str(child.pid)) for arg in config.cmd_stop)
            logger.info(
                "model %s: running cmd_stop",
                self.id,
                extra={"action": "cmd_stop", "model": self.id, "cmd": argv},
            )
            try:
                stopper = await spawn(argv, config.env, self.id, self.logs, role="cmd_stop")
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                logger.warning(
                    "model %s: cmd_stop failed (%s), sending SIGTERM",
                    self.id,
                    exc,
                    extra={"action": "cmd_stop_failed", "model": self.id},
                )
        if stopper is None:
            child.signal_tree(signal.SIGTERM)
        try:
            if stopper is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopper.wait(), max(0.0, deadline - loop.time()))
            try:
                await asyncio.wait_for(child.wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                logger.warning(
                    "model %s: still running after %gs, sending SIGKILL",
                    self.id,
                    config.unload_timeout,
                    extra={"action": "kill", "model": self.id, "pid": child.pid},
                )
                child.signal_tree(signal.SIGKILL)
                await child.wait()
        finally:
            if stopper is not None:
                stopper.signal_tree(signal.SIGKILL)
                await stopper.wait()
                try:
                    await stopper.teardown(self.id)
                except Exception:
                    logger.exception("model %s: cmd_stop teardown failed", self.id)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        asyncio.shield(stopper.protocol.output_closed), LOG_DRAIN_TIMEOUT
                    )
                stopper.transport.close()
