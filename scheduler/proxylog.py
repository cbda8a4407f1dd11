"""The proxy's own log (llama-swap's "proxy" logger): llamaswap's log lines (dispatch,
swaps, failed starts, refusals...), stamped and kept in a bounded :class:`LogBuffer` for
``/logs/stream/proxy`` and the dashboard's logs page.

:func:`install` puts a :class:`ProxyLogHandler` on llamaswap's loggers (the ``serve``
command does, once); their level (``logLevel``) decides which lines reach it. Each
line is kept under the model it names (its ``model`` field), so a page can filter by model.
"""

from __future__ import annotations

import datetime
import logging

from scheduler.logbuffer import LogBuffer

LOGGERS = ("llamaswap", "scheduler")
"""llamaswap's own loggers: the dispatcher's, the proxy's, the model processes' states."""
MAX_BYTES = 512 * 1024
"""What the buffer keeps: ~4,000 lines of ~120 bytes."""
LEVEL_NAMES = {
    logging.DEBUG: "debug",
    logging.INFO: "info",
    logging.WARNING: "warn",
    logging.ERROR: "error",
    logging.CRITICAL: "error",
}
"""Python's level -> llama-swap's ``logLevel`` word (what the line shows, what a page
filters on)."""

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}

proxy_log = LogBuffer(MAX_BYTES, prefixed=False)
"""The running server's proxy log (one per process, as its loggers are)."""


def level_name(levelno: int) -> str:
    return LEVEL_NAMES.get(levelno, "error" if levelno > logging.ERROR else "debug")


_second: tuple[int, str] = (-1, "")
"""The last whole second formatted (lines come in bursts: format it once)."""


def _stamp(created: float) -> str:
    global _second
    whole = int(created)
    if _second[0] != whole:
        moment = datetime.datetime.fromtimestamp(whole, datetime.UTC)
        _second = (whole, f"{moment:%Y-%m-%dT%H:%M:%S}")
    return f"{_second[1]}.{int((created - whole) * 1000):03d}Z"


def format_line(record: logging.LogRecord) -> str:
    """``2026-12-02T07:30:01.123Z [warn] model failed to start model=a cause=...``: the UTC
    time, the level, the message and the record's fields (newlines folded)."""
    extras = " ".join([f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD])
    text = record.getMessage()
    if record.exc_info and record.exc_info[1] is not None:
        text += f" ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
    line = f"{_stamp(record.created)} [{level_name(record.levelno)}] {text}"
    if extras:
        line += " " + extras
    if "\n" in line or "\r" in line:
        line = line.replace("\r", " ").replace("\n", " ")
    return line


class ProxyLogHandler(logging.Handler):
    """Writes each record to :data:`proxy_log` (never raises, never blocks)."""

    def __init__(self, buffer: LogBuffer) -> None:
        super().__init__()
        self.buffer = buffer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            model = getattr(record, "model", "")
            self.buffer.write(model if isinstance(model, str) else "", format_line(record).encode())
        except Exception:  # a log line must never break the code that logs it
            self.handleError(record)


def install(buffer: LogBuffer = proxy_log) -> None:
    """Attach a handler writing to ``buffer`` to llamaswap's loggers (once each)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, ProxyLogHandler) and h.buffer is buffer for h in logger.handlers):
            logger.addHandler(ProxyLogHandler(buffer))
