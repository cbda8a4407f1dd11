"""Config reload while serving: SIGHUP and ``--watch-config`` (``llamaswap serve``).

Better than llama-swap, which builds a new server and stops every model: the dispatcher
takes the new config in place (:meth:`scheduler.dispatcher.Dispatcher.reload`: nothing
waiting is lost, unchanged models keep running). A config with errors is refused and the
old one stays in force; the refusal is logged and shown on the dashboard
(:attr:`ConfigStatus`). The scheduler settings follow the same rule as at a start
(``scheduler.core.settings.merge_at_start``, applied to the stored record by
``control.settings_store``): an admin edit stays in force unless the config file's value
for that key changed.

Needs a restart: ``limits`` (applied per connection by the HTTP server). The logging keys
apply at once (``logLevel`` and ``logTimeFormat`` as in llama-swap; ``logToStdout`` too,
which llama-swap only takes at a restart).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from llamaswap_site.logfmt import apply_log_config
from scheduler import runtime
from scheduler.config import Config, ConfigError
from scheduler.dispatcher import ReloadReport
from scheduler.sources import fingerprint, load_sources

log = logging.getLogger("llamaswap.reload")

WATCH_EVERY = 2.0
"""Seconds between two looks at the config files (llama-swap polls every 2 s too)."""


@dataclass
class ConfigStatus:
    """The last reload, for the dashboard."""

    loaded_at: float = field(default_factory=time.time)
    source: str = ""
    error: str = ""
    """Why the last reload was refused ("" when it was not); the old config stays."""
    error_at: float | None = None
    warnings: tuple[str, ...] = ()
    reloads: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Reloader:
    """Reloads ``runtime.current()``'s config from its sources; one reload at a time."""

    def __init__(self, config: str = "", config_dir: str = "") -> None:
        self.config = config
        self.config_dir = config_dir
        self.status = ConfigStatus(source=", ".join(p for p in (config, config_dir) if p))
        self._lock = asyncio.Lock()
        self._seen = fingerprint(config, config_dir)

    async def reload(self, reason: str) -> ReloadReport | None:
        """Load the sources and put them in force; None when they have errors.

        Never raises (but for cancellation): it runs as a SIGHUP task and in the watcher,
        where an exception would be lost ("Task exception was never retrieved") or end the
        watching. Whatever goes wrong, the old config stays in force and the error is
        logged and shown on the dashboard.
        """
        async with self._lock:
            self._seen = fingerprint(self.config, self.config_dir)
            try:
                new = await asyncio.to_thread(load_sources, self.config, self.config_dir)
                new, source = await asyncio.to_thread(_with_stored_settings, new)
            except ConfigError as error:
                self._refused(reason, f"{error}")
                return None
            except Exception as error:  # load_sources raises ConfigError only; the database may not
                log.debug("config reload failed", exc_info=True)
                self._refused(reason, f"{self.status.source}: {type(error).__name__}: {error}")
                return None
            rt = runtime.current()
            try:
                report = await rt.dispatcher.reload(new, source)
            except Exception as error:
                log.debug("config reload failed in the dispatcher", exc_info=True)
                self._refused(reason, f"{self.status.source}: {type(error).__name__}: {error}")
                return None
            rt.config = new  # views resolve names with it from now on
            rt.keys.set_config_keys(new.api_keys)
            if rt.profile and rt.profile not in new.profiles:  # kept while it exists
                log.warning(
                    "the active profile %r is gone from the config; none is active", rt.profile
                )
                rt.profile = ""
            self.status = ConfigStatus(
                source=self.status.source,
                warnings=new.warnings,
                reloads=self.status.reloads + 1,
            )
            for warning in new.warnings:
                log.warning("config: %s", warning)
            log.info(
                "config reload applied",
                extra={
                    "reason": reason,
                    **{k: list(v) for k, v in dataclasses.asdict(report).items()},
                },
            )
            apply_log_config(new, rt.dispatcher.logs)  # after the line above: in the old format
            return report

    def _refused(self, reason: str, error: str) -> None:
        self.status.error = error
        self.status.error_at = time.time()
        log.error(
            "config reload refused; the old config stays in force",
            extra={"reason": reason, "error": error},
        )

    async def watch(self, every: float = WATCH_EVERY) -> None:
        """``--watch-config``: reload when a source changes (or one appears or goes).

        Keeps watching whatever a reload meets: the next edit is applied if it is valid."""
        while True:
            await asyncio.sleep(every)
            try:
                now = fingerprint(self.config, self.config_dir)
                if now != self._seen:
                    await self.reload("watch-config")
            except Exception:  # reload() does not raise; a bug here must not end the watching
                log.exception("config watch: the check failed; still watching")


def _with_stored_settings(config: Config) -> tuple[Config, str | None]:
    """The config with the scheduler settings in force (admin edits kept where the config
    file's value did not change: ``scheduler.core.settings.merge_at_start``)."""
    from control.settings_store import apply_at_start_or_config

    stored = apply_at_start_or_config(config.scheduler)
    return dataclasses.replace(config, scheduler=stored.settings), stored.source
