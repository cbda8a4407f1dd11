"""API keys, pure: how a key is presented, and the priority its rule grants."""

from __future__ import annotations

import base64

import pytest

from scheduler.keys import ApiKey, KeyPolicy, KeyRing, digest, presented_key


def basic(user: str, password: str) -> bytes:
    return b"Basic " + base64.b64encode(f"{user}:{password}".encode())


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([], None),
        ([(b"authorization", b"Bearer sk-1")], "sk-1"),
        ([(b"Authorization", b"bearer  sk-1 ")], "sk-1"),  # scheme in any case
        ([(b"authorization", basic("anyone", "sk-2"))], "sk-2"),  # Basic: the password
        ([(b"authorization", basic("", "sk-2"))], "sk-2"),
        ([(b"x-api-key", b"sk-3")], "sk-3"),
        # llama-swap's order: Basic, then Bearer, then x-api-key.
        ([(b"x-api-key", b"sk-3"), (b"authorization", b"Bearer sk-1")], "sk-1"),
        ([(b"authorization", basic("u", "sk-2")), (b"x-api-key", b"sk-3")], "sk-2"),
        # A broken Authorization falls back to x-api-key.
        ([(b"authorization", b"Basic !!!"), (b"x-api-key", b"sk-3")], "sk-3"),
        ([(b"authorization", b"Token sk-1")], None),
        ([(b"authorization", b"Bearer")], None),
        ([(b"x-api-key", b"  ")], None),
    ],
)
def test_presented_key(headers, expected):
    assert presented_key(headers) == expected


@pytest.mark.parametrize(
    ("policy", "header", "granted", "requested"),
    [
        # No rule: the spec's behaviour, header or 0.
        (KeyPolicy(), None, 0, None),
        (KeyPolicy(), "interactive", 100, None),
        (KeyPolicy(), "1000000", 1000000, None),
        # default: when the header is absent or unparseable.
        (KeyPolicy(default=-100), None, -100, None),
        (KeyPolicy(default=-100), "garbage", -100, None),
        (KeyPolicy(default=-100), "0", 0, None),  # a header, even 0, wins over the default
        # ceiling: the header cannot claim more; the record keeps what was asked.
        (KeyPolicy(ceiling=0), "interactive", 0, 100),
        (KeyPolicy(ceiling=0), "1000000", 0, 1000000),
        (KeyPolicy(ceiling=0), "batch", -100, None),
        (KeyPolicy(ceiling=0), "0", 0, None),
        (KeyPolicy(default=50, ceiling=0), None, 0, 50),  # a default above the ceiling is cut too
        # offset: the spec's tiers, added after the ceiling; never crosses a band.
        (KeyPolicy(offset=2), "batch", -98, None),
        (KeyPolicy(ceiling=0, offset=1), "interactive", 1, 100),
    ],
)
def test_policy_grants(policy, header, granted, requested):
    assert policy.grant(header) == (granted, requested)


def test_key_ring_looks_keys_up_by_digest_and_takes_admin_keys_live():
    ring = KeyRing({"sk-config": ApiKey("ops")})
    assert ring.enabled
    assert ring.lookup("sk-config").name == "ops"
    assert ring.lookup("sk-wrong") is None and ring.lookup(None) is None
    issued = ApiKey("farm", KeyPolicy(ceiling=0), source="admin")
    ring.set_admin_keys({digest("sk-admin"): issued})
    assert ring.lookup("sk-admin") is issued
    ring.set_admin_keys({})  # revoked: refused on the very next lookup
    assert ring.lookup("sk-admin") is None
    assert not KeyRing().enabled
