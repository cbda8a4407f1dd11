"""The time filters of the history and what-if pages: ``since``/``until`` and the zone they
are read in, each refusal a :class:`BadFilter` that names the filter and what it accepts."""

from __future__ import annotations

from datetime import UTC, datetime, time, tzinfo
from zoneinfo import ZoneInfo

from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from web.errors import echo


class BadFilter(Exception):
    """A history filter that cannot be used: the page says which and why (400)."""


def parse_zone(value: str) -> tzinfo:
    """The zone since/until are read in: the browser's (the form sends it), else UTC."""
    if not value:
        return UTC
    try:
        return ZoneInfo(value)
    except (ValueError, KeyError, OSError):  # unknown, malformed, or a path
        raise BadFilter(
            f"tz: there is no time zone {echo(value)}; "
            "expected an IANA name like Europe/Berlin or UTC"
        ) from None


def parse_when(name: str, value: str, end: bool = False, zone: tzinfo = UTC) -> datetime | None:
    """A filter bound from ``2026-11-29``, ``2026-11-29T21:40`` or a full ISO time; without
    an offset, in ``zone``."""
    value = value.strip()
    if not value:
        return None
    try:
        when: datetime | None = parse_datetime(value)
        if when is None:
            day = parse_date(value)
            if day is None:
                raise BadFilter(
                    f"{name}: expected a date like 2026-11-29 or a time like 2026-11-29T21:40, "
                    f"got {echo(value)}"
                )
            when = datetime.combine(day, time.max if end else time.min)
    except ValueError:  # well-formed, but no such day or time: 2026-02-30
        raise BadFilter(f"{name}: there is no such date or time as {echo(value)}") from None
    if timezone.is_naive(when):
        when = when.replace(tzinfo=zone)
    try:
        when.astimezone(UTC)  # what the database adapter does: 0001-01-01T00:00+01:00 overflows
    except OverflowError:
        raise BadFilter(f"{name}: {echo(value)} is out of range") from None
    return when
