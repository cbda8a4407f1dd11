"""web/captures.py: captureBuffer's store, bounded by bytes, credentials redacted."""

from __future__ import annotations

from types import SimpleNamespace

from web import captures


def capture(request_id: str, body: bytes = b"", path: str = "/v1/chat/completions"):
    return captures.Capture(request_id, path, {}, body, {}, b"")


def test_the_oldest_go_first_and_the_total_stays_under_the_budget():
    store = captures.CaptureStore(limit=3000)
    for i in range(10):
        assert store.add(capture(f"r{i}", b"x" * 900))
        assert store.used <= store.limit
    assert [store.has(f"r{i}") for i in range(10)] == [False] * 7 + [True] * 3


def test_a_capture_over_the_whole_budget_is_not_kept():
    store = captures.CaptureStore(limit=1000)
    assert not store.add(capture("big", b"x" * 2000))
    assert len(store) == 0 and store.used == 0


def test_off_keeps_nothing_and_shrinking_evicts():
    store = captures.CaptureStore(limit=0)
    assert not store.add(capture("a"))
    store.resize(10_000)
    for i in range(5):
        store.add(capture(f"r{i}", b"x" * 1000))
    store.resize(2500)
    assert len(store) == 2 and store.used <= 2500


def test_credentials_are_redacted_and_binary_routes_keep_less(monkeypatch):
    monkeypatch.setattr(captures, "store", captures.CaptureStore(limit=1 << 20))
    headers = [(b"authorization", b"Bearer sk-1"), (b"x-api-key", b"k"), (b"cookie", b"s=1")]
    headers.append((b"content-type", b"application/json"))
    assert captures.keep("a", "/v1/chat/completions", headers, b"{}", [("set-cookie", "x")], b"ok")
    kept = captures.store.get("a")
    assert kept is not None
    assert kept.req_headers == {
        "authorization": "[REDACTED]",
        "x-api-key": "[REDACTED]",
        "cookie": "[REDACTED]",
        "content-type": "application/json",
    }
    assert kept.resp_headers == {"set-cookie": "[REDACTED]"}
    body = kept.as_json(7)
    assert body["id"] == 7 and body["req_body"] == "e30=" and body["resp_body"] == "b2s="
    # llama-swap keeps no image bodies of /v1/images/edits.
    assert captures.keep("b", "/v1/images/edits", headers, b"PNG", [], b"{}")
    edits = captures.store.get("b")
    assert edits is not None and edits.req_body == b"" and edits.resp_body == b""
    assert edits.as_json(None)["req_body"] is None


def test_enabled_follows_the_config(monkeypatch):
    monkeypatch.setattr(captures, "store", captures.CaptureStore())
    assert not captures.enabled(SimpleNamespace(capture_buffer_mb=0))
    assert captures.enabled(SimpleNamespace(capture_buffer_mb=2))
    assert captures.store.limit == 2 << 20


def test_capture_buffer_is_read_from_the_config():
    import pytest

    from scheduler.config import ConfigError, parse_config

    models = {"m": {"cmd": "x --port ${PORT}", "proxy": "http://127.0.0.1:${PORT}"}}
    assert parse_config({"models": models}).capture_buffer_mb == 0
    config = parse_config({"models": models, "captureBuffer": 15})
    assert config.capture_buffer_mb == 15 and not any("captureBuffer" in w for w in config.warnings)
    for bad in (-1, "5", 1.5):
        with pytest.raises(ConfigError, match="captureBuffer"):
            parse_config({"models": models, "captureBuffer": bad})
