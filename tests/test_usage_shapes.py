"""Token accounting for every API shape llama-swap reads (proxy/usage.py through
proxy/relay.py's note_usage / note_stream_usage): what a request's record will hold."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from proxy.relay import STREAM_TAIL, note_stream_usage, note_usage


def whole(answer) -> dict:
    ticket = SimpleNamespace(extra={})
    note_usage(ticket, json.dumps(answer).encode())
    return ticket.extra


def streamed(events: list, pad: int = 0) -> dict:
    """The stream's head (its first piece) and tail as the relay keeps them."""
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    body += b"data: [DONE]\n\n"
    first = body.index(b"\n\n") + 2
    head, rest = body[:first], body[first:]
    filler = b"".join(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n' for _ in range(pad))
    ticket = SimpleNamespace(extra={})
    note_stream_usage(ticket, (head + filler + rest)[-STREAM_TAIL:], head)
    return ticket.extra


def counts(extra: dict) -> tuple:
    usage = extra.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), cached


def test_openai_usage():
    extra = whole(
        {
            "choices": [],
            "usage": {
                "prompt_tokens": 12,
                "completion_tokens": 30,
                "total_tokens": 42,
                "prompt_tokens_details": {"cached_tokens": 4},
            },
        }
    )
    assert counts(extra) == (12, 30, 4)
    assert extra["usage"]["total_tokens"] == 42
    assert "timings" not in extra


def test_anthropic_messages():
    extra = whole(
        {
            "type": "message",
            "content": [],
            "usage": {"input_tokens": 25, "output_tokens": 7, "cache_read_input_tokens": 3},
        }
    )
    assert counts(extra) == (25, 7, 3)
    # The model's own names stay beside OpenAI's.
    assert extra["usage"]["input_tokens"] == 25 and extra["usage"]["output_tokens"] == 7


@pytest.mark.parametrize("pad", [0, 400])  # the input count comes first, past the tail
def test_anthropic_messages_streamed(pad):
    extra = streamed(
        [
            {
                "type": "message_start",
                "message": {"usage": {"input_tokens": 25, "output_tokens": 1}},
            },
            {"type": "content_block_delta", "delta": {"text": "hi"}},
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn"},
                "usage": {"output_tokens": 9},
            },
            {"type": "message_stop"},
        ],
        pad=pad,
    )
    assert counts(extra) == (25, 9, None)


def test_responses_api():
    extra = whole(
        {
            "object": "response",
            "usage": {
                "input_tokens": 40,
                "output_tokens": 11,
                "total_tokens": 51,
                "input_tokens_details": {"cached_tokens": 32},
            },
        }
    )
    assert counts(extra) == (40, 11, 32)


def test_responses_api_streamed():
    extra = streamed(
        [
            {"type": "response.created", "response": {"usage": None}},
            {"type": "response.output_text.delta", "delta": "hi"},
            {
                "type": "response.completed",
                "response": {"usage": {"input_tokens": 40, "output_tokens": 11}},
            },
        ]
    )
    assert counts(extra) == (40, 11, None)


def test_llama_cpp_timings_streamed_after_openai_usage():
    timings = {"prompt_n": 5, "predicted_n": 8, "cache_n": 2, "predicted_per_second": 50.0}
    extra = streamed(
        [
            {"choices": [{"delta": {"content": "a"}}]},
            {
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 8},
                "timings": timings,
            },
        ]
    )
    assert counts(extra) == (5, 8, None)
    assert extra["timings"] == timings


def test_infill_array_takes_the_last_elements_timings():
    extra = whole([{"content": "a"}, {"content": "b", "timings": {"predicted_n": 3}}])
    assert extra["timings"] == {"predicted_n": 3}


def test_vllm_metrics_give_speeds_and_drafts():
    extra = whole(
        {
            "usage": {
                "prompt_tokens": 110,
                "completion_tokens": 50,
                "prompt_tokens_details": {"cached_tokens": 10},
            },
            "metrics": {
                "time_to_first_token_ms": 200,
                "mean_itl_ms": 20,
                "speculative_decoding": {"num_draft_tokens": 30, "num_accepted_draft_tokens": 21},
            },
        }
    )
    assert counts(extra) == (110, 50, 10)
    assert extra["timings"] == {
        "prompt_per_second": 500.0,  # (110 - 10 cached) tokens in 0.2 s
        "predicted_per_second": 50.0,
        "draft_n": 30,
        "draft_n_accepted": 21,
        "source": "vllm",
    }


@pytest.mark.parametrize(
    "answer",
    [
        {"choices": []},
        {"usage": None},
        {"usage": {"foo": 1}},
        [],
        "text",
        {"usage": {"prompt_tokens": True}},
    ],
)
def test_answers_without_counts_leave_nothing(answer):
    assert whole(answer) == {}


def test_a_stream_without_counts_leaves_nothing():
    assert streamed([{"choices": [{"delta": {"content": "a"}}]}]) == {}
