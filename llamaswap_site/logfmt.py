"""Log formatting, and applying the config's ``logToStdout``/``logTimeFormat``.

:class:`KeyValueFormatter` prints the structured ``extra=`` fields as key=value pairs; its
timestamp is Python's default unless :func:`apply_log_config` sets a Go layout name (what
llama-swap's ``logTimeFormat`` accepts, :data:`scheduler.config.LOG_TIME_FORMATS`).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.config import Config
    from scheduler.process import LogBuffer

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip


def _zone(t: datetime.datetime, colon: bool) -> str:
    """Go's ``-0700`` (or ``-07:00``)."""
    offset = t.utcoffset() or datetime.timedelta(0)
    minutes = int(offset.total_seconds()) // 60
    sign = "-" if minutes < 0 else "+"
    hours, mins = divmod(abs(minutes), 60)
    return f"{sign}{hours:02d}{':' if colon else ''}{mins:02d}"


def _abbrev(t: datetime.datetime) -> str:
    """Go's ``MST``: the zone's abbreviation, else its offset as Go prints it (``-0700``)."""
    name = t.tzname() or ""
    return name if name.isalpha() else _zone(t, colon=False)


def go_time(layout: str, t: datetime.datetime) -> str:
    """``t`` as Go's ``time.Format`` writes it for the named layout (``rfc3339``, ...).

    ``t`` must be aware. Names and month/day words are English, as Go's are.
    Nanosecond layouts get the microseconds Python keeps (``stampnano`` pads with zeros).
    """
    day, mon = _DAYS[t.weekday()], _MONTHS[t.month - 1]
    d2 = f"{t.day:2d}"  # Go's _2: space-padded
    hms = f"{t:%H:%M:%S}"
    if layout == "ansic":
        return f"{day[:3]} {mon[:3]} {d2} {hms} {t.year}"
    if layout == "unixdate":
        return f"{day[:3]} {mon[:3]} {d2} {hms} {_abbrev(t)} {t.year}"
    if layout == "rubydate":
        return f"{day[:3]} {mon[:3]} {t.day:02d} {hms} {_zone(t, False)} {t.year}"
    if layout in ("rfc822", "rfc822z"):
        zone = _abbrev(t) if layout == "rfc822" else _zone(t, False)
        return f"{t.day:02d} {mon[:3]} {t.year % 100:02d} {t:%H:%M} {zone}"
    if layout == "rfc850":
        return f"{day}, {t.day:02d}-{mon[:3]}-{t.year % 100:02d} {hms} {_abbrev(t)}"
    if layout in ("rfc1123", "rfc1123z"):
        zone = _abbrev(t) if layout == "rfc1123" else _zone(t, False)
        return f"{day[:3]}, {t.day:02d} {mon[:3]} {t.year} {hms} {zone}"
    if layout in ("rfc3339", "rfc3339nano"):
        fraction = ""
        if layout == "rfc3339nano" and t.microsecond:
            fraction = f".{t.microsecond:06d}".rstrip("0")  # Go's .999999999: zeros trimmed
        zone = "Z" if t.utcoffset() == datetime.timedelta(0) else _zone(t, True)
        return f"{t:%Y-%m-%dT%H:%M:%S}{fraction}{zone}"
    if layout == "kitchen":
        hour = t.hour % 12 or 12
        return f"{hour}:{t.minute:02d}{'PM' if t.hour >= 12 else 'AM'}"
    stamp = f"{mon[:3]} {d2} {hms}"
    if layout == "stamp":
        return stamp
    if layout == "stampmilli":
        return f"{stamp}.{t.microsecond // 1000:03d}"
    if layout == "stampmicro":
        return f"{stamp}.{t.microsecond:06d}"
    if layout == "stampnano":
        return f"{stamp}.{t.microsecond:06d}000"
    raise ValueError(f"unknown time layout {layout!r}")


class KeyValueFormatter(logging.Formatter):
    time_layout = ""
    """A Go layout name (``logTimeFormat``); "" keeps Python's default timestamp."""

    _second: tuple[tuple[str | None, int], str] | None = None
    """The last (datefmt, whole second) formatted by Python's default, and its text."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if not self.time_layout:
            return self._default_time(record, datefmt)
        moment = datetime.datetime.fromtimestamp(record.created).astimezone()
        return go_time(self.time_layout, moment)

    def _default_time(self, record: logging.LogRecord, datefmt: str | None) -> str:
        """What ``logging.Formatter.formatTime`` writes, its date and seconds formatted
        once per second (``strftime`` is most of its cost, and the dispatcher logs a line
        per request): the local time of a whole second depends on that second only."""
        key = (datefmt, int(record.created))
        cached = self._second
        if cached is None or cached[0] != key:
            when = self.converter(record.created)
            text = time.strftime(datefmt or self.default_time_format, when)
            cached = self._second = (key, text)
        if datefmt or not self.default_msec_format:
            return cached[1]
        return self.default_msec_format % (cached[1], record.msecs)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD]
        return f"{line} {' '.join(extras)}" if extras else line


def stdout_echo(stream: IO[bytes] | None = None) -> Callable[[str, bytes], None]:
    """A :attr:`LogBuffer.echo` writing each model line to stdout as ``[model] line``
    (the prefix llama-swap's combined log uses)."""

    def echo(model: str, line: bytes) -> None:
        out = stream if stream is not None else sys.stdout.buffer
        try:
            out.write(b"[" + model.encode() + b"] " + line)
            out.flush()
        except (OSError, ValueError):  # stdout closed or gone: the buffer still has it
            pass

    return echo


PROXY_LOGGER = "llamaswap"
OWN_LOGGERS = (PROXY_LOGGER, "scheduler")
"""llamaswap's own loggers (settings.LOGGING gives both the console handler):
``logLevel`` sets their level."""
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "error": logging.ERROR,
}
"""``logLevel`` (scheduler.config.LOG_LEVELS) -> Python's level."""


def log_level(config: Config) -> int:
    """The level of llamaswap's own log: ``LOG_LEVEL`` from the environment when set (an
    operator's override, e.g. for a benchmark), else the config's ``logLevel``."""
    override = os.getenv("LOG_LEVEL", "").strip().upper()
    if override:
        level = logging.getLevelName(override)
        if isinstance(level, int):
            return level
    return LEVELS.get(config.log_level, logging.INFO)


def apply_log_config(config: Config, logs: LogBuffer | None = None) -> None:
    """Apply ``logLevel``, ``logTimeFormat`` and ``logToStdout`` once the config is loaded
    (after Django's logging setup, which would reset them: ``llamaswap_site.asgi`` runs
    ``django.setup()`` only when nothing has yet).

    * ``logLevel``: the level of llamaswap's loggers (:func:`log_level`).
    * ``logTimeFormat``: every :class:`KeyValueFormatter` on their handlers stamps lines
      with that Go layout.
    * ``logToStdout``: ``upstream`` or ``both`` also write each model output line (what
      ``/logs`` serves) to stdout. llamaswap's own log stays on its console handler
      (stderr) for ``proxy`` and ``both``; for ``upstream`` and ``none`` (llama-swap
      discards its own log then) only warnings and errors are printed, so a failure is
      never silent.
    """
    level = log_level(config)
    quiet = config.log_to_stdout in ("upstream", "none")
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in logger.handlers:
            if isinstance(handler.formatter, KeyValueFormatter):
                handler.formatter.time_layout = config.log_time_format
            handler.setLevel(logging.WARNING if quiet else logging.NOTSET)
    if logs is not None:
        logs.echo = stdout_echo() if config.log_to_stdout in ("upstream", "both") else None
