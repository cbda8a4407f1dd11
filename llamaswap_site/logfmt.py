"""A log formatter that prints the structured ``extra=`` fields as key=value pairs."""

import logging

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [f"{k}={v}" for k, v in vars(record).items() if k not in _STANDARD]
        return f"{line} {' '.join(extras)}" if extras else line
