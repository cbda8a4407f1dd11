"""Formatting shared by the server-rendered pages (dashboard.js formats live values alike).

Times: one convention everywhere. The server writes ``<time datetime="...Z">`` with the
UTC value as fallback text; time.js rewrites the text in the viewer's local time, 24-hour,
and the page header names the zone ("times in Europe/Berlin (UTC+1)").
"""

from __future__ import annotations

import datetime as dt
import re
from typing import TYPE_CHECKING, Any

from django import template
from django.utils.html import conditional_escape, format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from control.html import timetag

if TYPE_CHECKING:
    from activity.models import RequestRecord

register = template.Library()

Number = float | str | None
"""What a number filter gets from a template: the number, None, or "" (a missing value);
the last two are shown as "–"."""


@register.filter
def secs(value: Number) -> str:
    """12.3 s, 4m 05s, 1h 02m."""
    if value is None or value == "":
        return "–"
    value = float(value)
    if value < 60:
        return f"{value:.1f} s"
    if value < 3600:
        m, s = divmod(int(value), 60)
        return f"{m}m {s:02d}s"
    h, rest = divmod(int(value), 3600)
    return f"{h}h {rest // 60:02d}m"


@register.filter
def clock(value: Number) -> str:
    """Unix seconds as HH:MM:SS (UTC)."""
    if value is None or value == "":
        return "–"
    return dt.datetime.fromtimestamp(float(value), dt.UTC).strftime("%H:%M:%S")


register.filter("timetag", timetag)  # control.html: the admin writes times too


STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC")
"""A UTC time written into text (the settings source: "... by alice at 2026-12-01 04:10:17 UTC")."""


@register.filter
def local_stamps(text: str) -> SafeString:
    """Text with each ``YYYY-MM-DD HH:MM:SS UTC`` in it as a zoned ``<time>`` (time.js
    shows it in local time with its offset)."""

    def tag(match: re.Match[str]) -> str:
        when = dt.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
        return str(timetag(when, "zoned"))

    return mark_safe(STAMP.sub(tag, str(conditional_escape(text))))


@register.filter
def num(value: Number, digits: int = 2) -> str:
    """A score or term: at most ``digits`` decimals, trailing zeros dropped."""
    if value is None or value == "":
        return "–"
    text = f"{float(value):.{int(digits)}f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


@register.filter
def ms_secs(value: float | None) -> str:
    return "–" if value is None else secs(float(value) / 1000)


@register.filter
def term_label(value: str) -> str:
    return {
        "swap_affinity": "swap affinity",
        "aging": "aging",
        "aging_cap": "aging cap",
        "band_share": "band share",
    }.get(value, value)


@register.filter
def short_id(value: str) -> str:
    return value[:8] if value and len(value) > 12 else value


@register.filter
def plain_number(value: Number) -> str:
    """A setting as typed: 60, not 60.0; 0.5 stays 0.5."""
    if value is None or value == "":
        return "–"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


UNCONTESTED_TITLE = "no other request was waiting when it was picked: no runner-up"


@register.filter
def pick_reason(row: RequestRecord | dict[str, Any]) -> SafeString | str:
    """What changed the pick: the terms that reordered it; "uncontested" when no other
    request was waiting (the decision has no runner-up); else priority and arrival order.

    ``row``: an activity-log record (``runner_up_id`` empty when none, ``dispatched_at``
    None when never picked) or a live decision (a dict, ``runner_up_id`` None when none).
    """
    picked: bool | dt.datetime | None
    if isinstance(row, dict):
        terms, runner_up, picked = row.get("reordered_by") or [], row.get("runner_up_id"), True
    else:
        terms, runner_up, picked = row.reordered_by or [], row.runner_up_id, row.dispatched_at
    if not picked:
        return "–"
    if terms:
        return format_html_join(
            " ", '<span class="term">{}</span>', ((term_label(t),) for t in terms)
        )
    if not runner_up:
        return format_html(
            '<span class="uncontested" title="{}">uncontested</span>', UNCONTESTED_TITLE
        )
    return "priority · arrival"


@register.filter
def outcome_text(code: str) -> str:
    """An outcome code in words (``activity.models.OUTCOME_WORDS``, the one mapping)."""
    from activity.models import outcome_words

    return outcome_words(str(code))
