"""The X-LlamaSwap-Priority header, as the spec describes it."""

import pytest

from scheduler.core.priority import Band, band_of, parse_priority


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, 0),  # absent means normal
        ("", 0),  # empty means normal
        ("   ", 0),  # only whitespace means normal
        ("0", 0),
        ("100", 100),  # interactive anchor as a number
        ("-100", -100),  # batch anchor as a number
        ("+5", 5),  # explicit plus sign
        ("-98", -98),  # max tier batch offset
        ("  42  ", 42),  # surrounding whitespace is trimmed
        ("\t-7\n", -7),  # any whitespace
        ("1000000", 1000000),  # never clamped: the caller is trusted
        ("-1000000", -1000000),
        ("9223372036854775807", 2**63 - 1),  # the signed 64-bit maximum
        ("-9223372036854775808", -(2**63)),  # the signed 64-bit minimum
        ("9223372036854775808", 0),  # outside signed 64-bit
        ("-9223372036854775809", 0),
        ("interactive", 100),  # alias
        ("normal", 0),  # alias
        ("batch", -100),  # alias
        ("INTERACTIVE", 100),  # aliases are case-insensitive
        ("Batch", -100),
        ("  normal ", 0),
        ("1.5", 0),  # not an integer
        ("high", 0),  # not a known alias
        ("0x10", 0),  # no hex
        ("1e3", 0),  # no exponent
        ("1_000", 0),  # no digit separators
        ("--5", 0),  # one sign at most
        ("+", 0),  # a sign alone
        ("5 5", 0),  # inner whitespace
        ("٣", 0),  # non-ASCII digits
        ("0" * 32, 0),  # 32 characters is still parsed
        ("0" * 33, 0),  # longer than 32 characters after trimming
        ("1" + "0" * 31, 0),  # 32 digits but outside int64
        (" " * 40 + "7" + " " * 40, 7),  # the length limit applies after trimming
        (b"-100", -100),  # raw ASGI header bytes
        (b"\xff", 0),  # undecodable bytes
    ],
)
def test_parse_priority(header, expected):
    assert parse_priority(header) == expected


@pytest.mark.parametrize(
    ("priority", "band"),
    [
        (100, Band.INTERACTIVE),  # the anchor
        (50, Band.INTERACTIVE),  # half-way rounds to the outer band
        (49, Band.NORMAL),
        (0, Band.NORMAL),
        (2, Band.NORMAL),  # tier offsets stay in their band
        (-49, Band.NORMAL),
        (-50, Band.BATCH),  # half-way rounds to the outer band
        (-98, Band.BATCH),  # max tier batch
        (-100, Band.BATCH),
        (10**9, Band.INTERACTIVE),  # unclamped values still get a band
        (-(10**9), Band.BATCH),
    ],
)
def test_band_is_the_nearest_anchor(priority, band):
    assert band_of(priority) is band
