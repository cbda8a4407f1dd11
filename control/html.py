"""Times as HTML, one convention everywhere: ``<time datetime="...Z">`` with the UTC value
as fallback text; time.js rewrites the text in the viewer's local time. Here, below the
pages, because the admin of the control records (``control/admin.py``) writes them too;
the dashboard's templates reach it as the ``timetag`` filter (``dashboard/templatetags/dash.py``).
"""

from __future__ import annotations

import datetime as dt

from django.utils.html import format_html
from django.utils.safestring import SafeString

TIME_SHOWS = {"datetime": "%Y-%m-%d %H:%M:%S", "time": "%H:%M:%S", "zoned": "%Y-%m-%d %H:%M:%S UTC"}
"""``zoned`` names its zone in the text (2026-11-29 13:00:00 UTC+1 once local): for pages
without the header that names it (the admin)."""


def _as_utc(value: dt.datetime | float | int | str) -> dt.datetime:
    if isinstance(value, dt.datetime):
        if value.tzinfo is None:  # stored times are UTC (USE_TZ); naive ones are taken as UTC
            return value.replace(tzinfo=dt.UTC)
        return value.astimezone(dt.UTC)
    return dt.datetime.fromtimestamp(float(value), dt.UTC)


def timetag(value: dt.datetime | float | None, show: str = "datetime") -> SafeString | str:
    """A datetime or Unix seconds as ``<time datetime="2026-11-29T12:00:00.000Z">`` with
    the UTC value as text (``show``: datetime, time or zoned); time.js shows it in local
    time."""
    if value is None or value == "":
        return "–"
    when = _as_utc(value)
    iso = when.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    shown = show if show in TIME_SHOWS else "datetime"
    return format_html(
        '<time datetime="{}" data-show="{}">{}</time>', iso, shown, when.strftime(TIME_SHOWS[shown])
    )
