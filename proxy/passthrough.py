"""``/upstream/{model}/{path}`` and ``/comfyui/{path}``: which model a path names and
which paths it may reach. One rule for the HTTP passthrough (``proxy.views.upstream_passthrough``,
``proxy.comfyui``) and the websocket one (``proxy.wsproxy``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from django.http import HttpRequest, HttpResponse

from scheduler.config import Config, ModelConfig, PathPattern
from scheduler.config.models import COMFYUI_MODEL_ID
from scheduler.process import ModelState
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
    if dot_segments(path):
        return False
    return any(pattern.search(path) for pattern in patterns)


def dot_segments(path: str) -> bool:
    """Has ``path`` (decoded) a ``.`` or ``..`` segment? A model server that resolves them
    would serve another path than the one checked."""
    return "/." in path and any(segment in (".", "..") for segment in path.split("/"))


def ignored(path: str, patterns: tuple[PathPattern, ...]) -> bool:
    """Does ``upstream.ignorePaths`` name ``path`` (such a path never loads the model)?"""
    return any(pattern.search(path) for pattern in patterns)


def raw_rest(scope: Mapping[str, Any] | None, model_name: str, path: str) -> str:
    """The path after ``/upstream/{model}`` exactly as the client sent it: still
    percent-encoded, so ``%3F``, ``%23``, ``%2F`` and ``%25`` reach the model as sent
    (the decoded ``path`` would turn them into a query, a fragment, a separator). The
    model's name may itself have been sent encoded (``org%2Fmodel``): the raw path is
    walked until the decoded ``/upstream/{model}`` is consumed."""
    return raw_after(scope, "/upstream/" + model_name, "/" + path)


def raw_after(scope: Mapping[str, Any] | None, decoded_prefix: str, path: str) -> str:
    """The request's path after ``decoded_prefix`` (as daphne decoded it) exactly as the
    client sent it (:func:`raw_rest`); ``path``, the decoded rest, when the scope has no
    raw path."""
    raw = scope.get("raw_path") if scope is not None else None
    if not raw:
        return path
    raw = raw.split(b"?", 1)[0]
    prefix = decoded_prefix.encode()
    i = 0
    for _ in range(len(prefix)):  # one decoded byte per step: %XX or a plain byte
        i += 3 if raw[i : i + 1] == b"%" else 1
    return str(raw[i:].decode("latin-1")) or "/"


# -- /comfyui: llama-swap's passthrough to the fixed model comfyui_auto ---------------------

COMFYUI = "/comfyui"
"""``/comfyui/{path}`` reaches ``{path}`` of the local model
:data:`scheduler.config.models.COMFYUI_MODEL_ID` (``proxy.comfyui``, ``proxy.wsproxy``)."""


def slash_redirect(request: HttpRequest, path: str) -> HttpResponse:
    """``path`` without its trailing slash: to ``path + "/"`` (the query kept), so a web
    UI's relative links resolve; 301 for GET and HEAD, 308 otherwise, as llama-swap answers."""
    location = path + "/"
    if request.META.get("QUERY_STRING"):
        location += "?" + request.META["QUERY_STRING"]
    response = HttpResponse(status=301 if request.method in ("GET", "HEAD") else 308)
    response["Location"] = location
    return response


class Refusal(NamedTuple):
    """Why a passthrough request is not relayed: its status, message and error code."""

    status: int
    message: str
    code: str


def comfyui(rt: Runtime, path: str, may_start: bool = True) -> ModelConfig | Refusal:
    """The model ``/comfyui{path}`` reaches (``path`` decoded, from its ``/``), or why not.
    llama-swap's rules: the local model ``comfyui_auto`` by its exact id (no alias, no
    peer; else 404), and only the root ``/comfyui/`` may start it (``may_start``: an HTTP
    request): any other path gets ``409`` unless it is loaded and ready, so a stale browser
    tab's asset, API or socket requests never load it again once it is unloaded. Any path
    of that server is reached (ComfyUI's page needs ``/prompt``, ``/ws``, ``/view``, ...:
    ``upstream.allowPaths`` names a llama-server's) but one with a dot segment (403)."""
    model = rt.config.models.get(COMFYUI_MODEL_ID)
    if model is None:
        return Refusal(404, f"local model {COMFYUI_MODEL_ID} not found", "model_not_found")
    if dot_segments(path):
        return Refusal(
            403, f"{COMFYUI}/ may not reach a path with . or .. segments", "path_not_allowed"
        )
    if (path != "/" or not may_start) and rt.dispatcher.model_states().get(
        model.id
    ) is not ModelState.READY:
        return Refusal(
            409,
            f"model {COMFYUI_MODEL_ID} is not loaded; only {COMFYUI}/ can start it",
            "model_not_loaded",
        )
    return model


def comfyui_socket(rt: Runtime, scope: Mapping[str, Any]) -> tuple[ModelConfig, str, str] | str:
    """For a websocket on ``/comfyui/...``: ``(model, path for the model as sent, its id)``,
    or why there is none. A socket never starts the model (``compat.ignoreWebsockets``,
    forced for it), the root's included."""
    path = str(scope["path"])[len(COMFYUI) :]
    found = comfyui(rt, path, may_start=False)
    if isinstance(found, Refusal):
        return found.message
    return found, raw_after(scope, COMFYUI, path), found.id
