"""The X-LlamaSwap-Priority header: parsing and bands.

Pure: no Django, no I/O. See docs/scheduling.md ("Saying how urgent a request is").
"""

from __future__ import annotations

import re
from enum import StrEnum

HEADER = "X-LlamaSwap-Priority"

ALIASES: dict[str, int] = {"interactive": 100, "normal": 0, "batch": -100}

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_MAX_LEN = 32
# A signed decimal integer: optional sign, ASCII digits only (no "1.5", "0x10", "1e3", "1_000").
_DECIMAL = re.compile(r"[+-]?[0-9]+")


class Band(StrEnum):
    """The band a priority falls in: the nearest of the three anchors (100, 0, -100)."""

    INTERACTIVE = "interactive"
    """p >= 50: a human is waiting."""
    NORMAL = "normal"
    """-50 < p < 50: the default."""
    BATCH = "batch"
    """p <= -50: nobody is watching."""


BANDS: tuple[Band, ...] = (Band.INTERACTIVE, Band.NORMAL, Band.BATCH)


def parse_priority(value: str | bytes | None) -> int:
    """The header's value as an int; absent, empty or unparseable is 0.

    Accepts a signed decimal integer with surrounding whitespace (``100``, ``+5``,
    ``-98``) and the aliases ``interactive``/``normal``/``batch`` in any case. A
    value longer than 32 characters after trimming, or outside the signed 64-bit
    range, is unparseable. Never raises and never clamps: the caller is trusted.
    """
    parsed = parse_priority_or_none(value)
    return 0 if parsed is None else parsed


def parse_priority_or_none(value: str | bytes | None) -> int | None:
    """Like :func:`parse_priority`, but None when the header is absent or unparseable
    (an API key's default priority applies then)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    text = value.strip()
    if not text or len(text) > _MAX_LEN:
        return None
    alias = ALIASES.get(text.lower())
    if alias is not None:
        return alias
    if not _DECIMAL.fullmatch(text):
        return None
    number = int(text)
    if number < _INT64_MIN or number > _INT64_MAX:
        return None
    return number


def band_of(priority: float) -> Band:
    """The nearest anchor: interactive when p >= 50, batch when p <= -50, else normal.

    Ties at exactly +-50 go to the outer band (50 is interactive, -50 is batch).
    """
    if priority >= 50:
        return Band.INTERACTIVE
    if priority <= -50:
        return Band.BATCH
    return Band.NORMAL
