"""``/upstream/{model}/{path}``: which model a path names and which paths it may reach.
One rule for the HTTP passthrough (``proxy.views.upstream_passthrough``) and the
websocket one (``proxy.wsproxy``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from scheduler.config import Config, ModelConfig, PathPattern
from scheduler.runtime import Runtime

PATH_SAFE = "/:@!$&'()*+,;=-._~"
"""What a path segment may hold unescaped (RFC 3986 pchar, and ``/``)."""
_LONGEST: tuple[object, int] = (None, 0)


def find(rt: Runtime, rest: str) -> tuple[str, str | None, ModelConfig | None] | None:
    """``(name, path, model)`` for ``rest`` (what follows ``/upstream/``): the name as
    :func:`model_in_path` finds it (ids, aliases, the active profile's pins), the path
    after it (None: no trailing slash), the model it resolves to (None: a pin to nothing).
    None when the path names no model."""
    profile = rt.config.profiles.get(rt.profile) if rt.profile else None
    pins: Mapping[str, str | None] = profile.pins if profile is not None else {}
    found = model_in_path(
        rest, lambda n: n in pins or rt.config.resolve(n) is not None, longest_name(rt.config)
    )
    if found is None:
        return None
    name, path = found
    target = pins.get(name, name)
    return name, path, rt.config.resolve(target) if target else None


def longest_name(config: Config) -> int:
    """The longest name ``/upstream/`` may find in ``config`` (ids, aliases, profile pins):
    no request makes :func:`model_in_path` try longer ones. Computed once per config."""
    global _LONGEST
    if _LONGEST[0] is not config:
        names = [*config.models, *config.aliases]
        names += [pin for profile in config.profiles.values() for pin in profile.pins]
        _LONGEST = (config, max(map(len, names), default=0))
    return _LONGEST[1]


def model_in_path(
    rest: str, known: Callable[[str], bool], longest: int
) -> tuple[str, str | None] | None:
    """``(name, path)`` for ``rest`` (what follows ``/upstream/``): ``name`` the longest
    leading run of ``/``-separated segments that is ``known`` (at most ``longest``
    characters: the few candidates a real name allows, whatever the path's length),
    ``path`` what follows its ``/``, or None when nothing follows (no trailing slash).
    None when no leading run is known."""
    found: tuple[str, str | None] | None = None
    end = -1
    while True:
        end = rest.find("/", end + 1)
        name = rest if end < 0 else rest[:end]
        if len(name) > longest:
            break
        if name and known(name):
            found = (name, None if end < 0 else rest[end + 1 :])
        if end < 0:
            break
    return found


def path_allowed(path: str, patterns: tuple[PathPattern, ...]) -> bool:
    """May ``/upstream/<model>`` reach ``path`` (decoded, after the model, as
    ``ignorePaths`` sees it)? One of ``patterns`` (``upstream.allowPaths``) must match it,
    and it has no ``.`` or ``..`` segment: a model server that resolves them would serve
    another path than the one checked (``/v1%2F..%2Fslots``)."""
    if "/." in path and any(segment in (".", "..") for segment in path.split("/")):
        return False
    return any(pattern.search(path) for pattern in patterns)


def ignored(path: str, patterns: tuple[PathPattern, ...]) -> bool:
    """Does ``upstream.ignorePaths`` name ``path`` (such a path never loads the model)?"""
    return any(pattern.search(path) for pattern in patterns)


def raw_rest(scope: Mapping[str, Any] | None, model_name: str, path: str) -> str:
    """The path after ``/upstream/{model}`` exactly as the client sent it: still
    percent-encoded, so ``%3F``, ``%23``, ``%2F`` and ``%25`` reach the model as sent
    (the decoded ``path`` would turn them into a query, a fragment, a separator). The
    model's name may itself have been sent encoded (``org%2Fmodel``): the raw path is
    walked until the decoded ``/upstream/{model}`` is consumed."""
    raw = scope.get("raw_path") if scope is not None else None
    if not raw:
        return "/" + path
    raw = raw.split(b"?", 1)[0]
    prefix = ("/upstream/" + model_name).encode()
    i = 0
    for _ in range(len(prefix)):  # one decoded byte per step: %XX or a plain byte
        i += 3 if raw[i : i + 1] == b"%" else 1
    return str(raw[i:].decode("latin-1")) or "/"
