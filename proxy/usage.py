"""Token counts and speeds from a model's answer, whatever API shape it speaks.

Pure functions over parsed JSON: what llama-swap reads, read the same way, into the two
objects a request's record keeps (``activity.rows``): ``usage`` with OpenAI's names
(``prompt_tokens``, ``completion_tokens``, ``prompt_tokens_details.cached_tokens``) added
beside the model's own, and llama.cpp's ``timings``.

Shapes read:

* OpenAI ``usage`` (chat, completions, embeddings);
* Anthropic ``/v1/messages``: ``usage.input_tokens`` / ``output_tokens`` /
  ``cache_read_input_tokens``; streamed, ``message_start`` carries ``message.usage`` and
  each ``message_delta`` a ``usage`` (the counts so far);
* OpenAI ``/v1/responses``: ``usage.input_tokens`` / ``output_tokens`` /
  ``input_tokens_details.cached_tokens``; streamed, in ``response.usage`` of
  ``response.completed``;
* llama.cpp ``timings`` (``prompt_n``, ``predicted_n``, ``cache_n``, speeds, ``draft_n``);
  ``/infill`` answers an array whose last element has them;
* vLLM ``metrics`` (``time_to_first_token_ms``, ``mean_itl_ms``,
  ``speculative_decoding``): turned into the ``timings`` speeds llama-swap derives
  (``prompt_per_second``, ``predicted_per_second``, ``draft_n``, ``draft_n_accepted``),
  marked ``"source": "vllm"``.

Where a stream gives a count more than once the last non-zero one wins (llama-swap's rule).
"""

from __future__ import annotations

from typing import Any


class Tally:
    """The token facts of one answer, gathered from its object or its stream's events."""

    __slots__ = ("usage", "timings", "metrics", "found")

    def __init__(self) -> None:
        self.usage: dict[str, Any] = {}
        self.timings: dict[str, Any] | None = None
        self.metrics: dict[str, Any] | None = None
        self.found = False

    def add(self, data: Any) -> None:
        """Read one answer object (or one event of a stream); arrays: the last element.
        Its usage object may be at ``usage``, ``response.usage`` and ``message.usage``."""
        if isinstance(data, list):
            data = data[-1] if data else None
        if not isinstance(data, dict):
            return
        get = data.get
        usage = get("usage")
        if isinstance(usage, dict) and _merge_usage(self.usage, usage):
            self.found = True
        for outer in ("response", "message"):
            inner = get(outer)
            if isinstance(inner, dict):
                usage = inner.get("usage")
                if isinstance(usage, dict) and _merge_usage(self.usage, usage):
                    self.found = True
        timings = get("timings")
        if isinstance(timings, dict):
            self.timings = timings
            self.found = True
        metrics = get("metrics")
        if isinstance(metrics, dict):
            self.metrics = metrics
            self.found = True

    def result(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """``(usage, timings)`` for the record: None where the answer said nothing."""
        usage = self.usage or None
        timings = self.timings
        if timings is None and self.metrics is not None:
            timings = _vllm_timings(self.metrics, usage or {})
        return usage, timings


def _count(value: Any) -> int | None:
    if type(value) is int:  # the common case, one test
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _merge_usage(into: dict[str, Any], usage: dict[str, Any]) -> bool:
    """Fold one usage object into ``into``; False when it holds no count at all."""
    prompt = _first(usage, "prompt_tokens", "input_tokens")
    completion = _first(usage, "completion_tokens", "output_tokens")
    cached = _first(usage, "cache_read_input_tokens")
    if cached is None:
        for field in ("input_tokens_details", "prompt_tokens_details"):
            inner = usage.get(field)
            if isinstance(inner, dict) and _count(inner.get("cached_tokens")) is not None:
                cached = _count(inner.get("cached_tokens"))
                break
    if prompt is None and completion is None and cached is None:
        return False
    for key, value in usage.items():  # the model's own fields, kept as it sent them
        if value is not None and (key not in into or value):
            into[key] = value
    if prompt is not None and (prompt > 0 or "prompt_tokens" not in into):
        into["prompt_tokens"] = prompt
    if completion is not None and (completion > 0 or "completion_tokens" not in into):
        into["completion_tokens"] = completion
    if cached is not None:
        old = into.get("prompt_tokens_details")
        details: dict[str, Any] = dict(old) if isinstance(old, dict) else {}
        details["cached_tokens"] = cached
        into["prompt_tokens_details"] = details
    if "total_tokens" not in usage and ("prompt_tokens" in into or "completion_tokens" in into):
        into["total_tokens"] = into.get("prompt_tokens", 0) + into.get("completion_tokens", 0)
    return True


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _first(usage: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = _count(usage.get(name))
        if value is not None:
            return value
    return None


def _vllm_timings(metrics: dict[str, Any], usage: dict[str, Any]) -> dict[str, Any] | None:
    """llama-swap's reading of vLLM's per-request ``metrics``: prompt speed from the time
    to the first token (cached tokens not counted), generation speed from the mean
    inter-token latency, drafted and accepted tokens of speculative decoding."""
    timings: dict[str, Any] = {}
    ttft = _number(metrics.get("time_to_first_token_ms"))
    prompt = _count(usage.get("prompt_tokens"))
    if ttft is not None and ttft > 0 and prompt is not None:
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        timings["prompt_per_second"] = (prompt - max(cached or 0, 0)) / (ttft / 1000)
    itl = _number(metrics.get("mean_itl_ms"))
    if itl is not None and itl > 0:
        timings["predicted_per_second"] = 1000 / itl
    spec = metrics.get("speculative_decoding")
    if isinstance(spec, dict):
        drafted = _count(spec.get("num_draft_tokens"))
        accepted = _count(spec.get("num_accepted_draft_tokens"))
        if drafted is not None and accepted is not None:
            timings["draft_n"], timings["draft_n_accepted"] = drafted, accepted
    if not timings:
        return None
    timings["source"] = "vllm"
    return timings
