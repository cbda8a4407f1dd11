"""Formatting shared by the server-rendered pages (dashboard.js formats live values alike)."""

from __future__ import annotations

import datetime as dt

from django import template

register = template.Library()


@register.filter
def secs(value: float | None) -> str:
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
def clock(value: float | None) -> str:
    """Unix seconds as HH:MM:SS (UTC)."""
    if value is None or value == "":
        return "–"
    return dt.datetime.fromtimestamp(float(value), dt.UTC).strftime("%H:%M:%S")


@register.filter
def num(value: float | None, digits: int = 2) -> str:
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
    return {"swap_affinity": "swap affinity", "aging": "aging"}.get(value, value)


@register.filter
def short_id(value: str) -> str:
    return value[:8] if value and len(value) > 12 else value
