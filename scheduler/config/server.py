"""The top-level server settings: logging (``logLevel``, ``logToStdout``,
``logTimeFormat``) and the ``upstream`` paths (RE2 patterns)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, cast

import re2

from scheduler.config.values import (
    ConfigError,
    or_default,
    read_mapping,
    read_string,
    read_string_list,
    warn_unknown,
)

LOG_LEVELS = ("debug", "info", "warn", "error")


LOG_TO_STDOUT = ("proxy", "upstream", "both", "none")
"""``logToStdout``: whose log lines go to stdout (llama-swap's values; default proxy)."""


LOG_TIME_FORMATS = (
    "ansic",
    "unixdate",
    "rubydate",
    "rfc822",
    "rfc822z",
    "rfc850",
    "rfc1123",
    "rfc1123z",
    "rfc3339",
    "rfc3339nano",
    "kitchen",
    "stamp",
    "stampmilli",
    "stampmicro",
    "stampnano",
)
"""``logTimeFormat``: the Go time-layout names llama-swap accepts (case-insensitive);
:mod:`llamaswap_site.logfmt` renders each."""


DEFAULT_UPSTREAM_IGNORE_PATHS = r".*\.(js|json|css|png|gif|jpg|jpeg|ico|txt)$"
"""llama-swap's ``upstream.ignorePaths`` when the list is empty or absent."""


DEFAULT_UPSTREAM_ALLOW_PATHS = (
    r"^/$",
    r"^/(v1/)?(chat/completions|completions|responses|messages|messages/count_tokens"
    r"|embeddings|rerank|reranking|models|audio/speech|audio/transcriptions"
    r"|audio/translations|images/generations|images/edits)$",
    r"^/(completion|infill|embedding|tokenize|detokenize|apply-template|props|health)$",
    r"^(/[A-Za-z0-9_~-][A-Za-z0-9_.~-]*)*/[A-Za-z0-9_~-][A-Za-z0-9_.~-]*"
    r"\.(html|js|mjs|css|map|json|png|gif|jpg|jpeg|svg|ico|webp|woff|woff2|ttf|txt|webmanifest)$",
)
"""``upstream.allowPaths`` when the list is empty or absent: what a model's web UI and API
clients use (the root page, static files, the OpenAI and Anthropic routes, llama-server's
native inference routes, ``/props`` and ``/health``); not its operator endpoints
(``/slots``, ``/metrics``, ``/lora-adapters``, ``/cors-proxy``, ``/tools``,
``/models/load``; fakellm's ``/fake/requests``). Static file names start with no dot: no
dot segments, no hidden files."""


class PathPattern(Protocol):
    """A compiled ``upstream.ignorePaths`` pattern (an RE2 regexp: linear in the path)."""

    pattern: str

    def search(self, text: str) -> object: ...


def compile_re2(pattern: str) -> PathPattern:
    """``pattern`` as RE2 (Go's regexp semantics, matching in time linear in the input;
    Python's backtracking ``re`` took seconds on ``.*\\.(js|...)$`` against a path of
    16,000 dots). Raises ``re2.error``; RE2's own logging of it is off (the ConfigError
    says it)."""
    options = re2.Options()
    options.log_errors = False
    return cast(PathPattern, re2.compile(pattern, options=options))


def read_log_time_format(value: Any, warnings: list[str]) -> str:
    """``logTimeFormat``: a Go layout name, lowercased; "" (unset) keeps the default stamp.

    llama-swap prints no timestamp for a name it does not know; we warn and keep ours.
    """
    name = read_string(or_default(value, ""), "logTimeFormat").strip().lower()
    if name and name not in LOG_TIME_FORMATS:
        warnings.append(
            f"logTimeFormat: unknown format {name!r} (use one of {', '.join(LOG_TIME_FORMATS)}); "
            "using the default timestamp"
        )
        return ""
    return name


def read_upstream_ignore_paths(value: Any, warnings: list[str]) -> tuple[PathPattern, ...]:
    """``upstream.ignorePaths``: regular expressions; empty or absent: llama-swap's default.

    Compiled as RE2, as llama-swap compiles them (Go's regexp): the same syntax, and
    matching linear in the path whatever the pattern (no backtracking: a path any client
    sends must not cost quadratic time). What RE2 refuses (backreferences, lookarounds)
    is a ConfigError, as in llama-swap.
    """
    upstream = read_mapping(value, "upstream")
    warn_unknown(upstream, "upstream", {"ignorePaths", "allowPaths"}, warnings)
    patterns = read_string_list(upstream.get("ignorePaths"), "upstream.ignorePaths")
    return _compile_paths(patterns or [DEFAULT_UPSTREAM_IGNORE_PATHS], "upstream.ignorePaths")


def read_upstream_allow_paths(value: Any) -> tuple[PathPattern, ...]:
    """``upstream.allowPaths`` (ours): regular expressions (RE2, searched as
    ``ignorePaths``) naming the paths ``/upstream/<model>/...`` may reach; empty or absent:
    :data:`DEFAULT_UPSTREAM_ALLOW_PATHS`. ``[".*"]`` lets every path through (llama-swap)."""
    upstream = read_mapping(value, "upstream")
    patterns = read_string_list(upstream.get("allowPaths"), "upstream.allowPaths")
    return _compile_paths(patterns or DEFAULT_UPSTREAM_ALLOW_PATHS, "upstream.allowPaths")


def _compile_paths(patterns: Iterable[str], where: str) -> tuple[PathPattern, ...]:
    """``patterns`` (the list at ``where``) compiled as RE2; what RE2 refuses is a
    ConfigError naming the item."""
    compiled: list[PathPattern] = []
    for i, pattern in enumerate(patterns):
        try:
            compiled.append(compile_re2(pattern))
        except re2.error as exc:
            reason = exc.args[0] if exc.args else exc
            if isinstance(reason, bytes):
                reason = reason.decode("utf-8", "replace")
            raise ConfigError(
                f"{where}[{i}]", f"invalid regular expression {pattern!r}: {reason}"
            ) from None
    return tuple(compiled)
