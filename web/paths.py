"""Which paths are the proxy's, and which answer errors in JSON: the one table the router
(``proxy/handler.py``), the proxy's URLconf and the error handlers read."""

from __future__ import annotations

INFERENCE_PATHS = [
    "v1/chat/completions",
    "v1/completions",
    "v1/responses",
    "v1/embeddings",
    "v1/rerank",
    "v1/reranking",
    "rerank",
    "reranking",
    "v1/audio/speech",
    "v1/audio/transcriptions",
    "v1/images/generations",
    "v1/messages",
    "infill",
    "completion",
    # llama-swap's other model-dispatched routes (its server.go at 0bdb372)
    "v1/messages/count_tokens",
    "v1/audio/voices",
    "v1/images/edits",
    "sdapi/v1/txt2img",
    "sdapi/v1/img2img",
    "sdapi/v1/loras",
    "props",
    "audioapi/v1/tasks/run",
    *(
        "v/" + p
        for p in (
            "chat/completions",
            "responses",
            "completions",
            "messages",
            "messages/count_tokens",
            "embeddings",
            "rerank",
            "reranking",
        )
    ),
]
"""The inference endpoints (``proxy.urls`` routes each to ``proxy.views.inference``): the
model from the JSON body's or the multipart form's ``model``, or for a GET from the query's
(:data:`QUERY_MODEL_PATHS`)."""
QUERY_MODEL_PATHS = frozenset({"/v1/audio/voices", "/sdapi/v1/loras", "/props"})
"""Inference paths a GET may take, naming its model in ``?model=`` (llama-swap's rule; the
model's answer to ``/props?autoload`` is not asked for)."""
GET_ONLY_PATHS = frozenset({"/sdapi/v1/loras", "/props"})
"""Inference paths that take a GET only (every other one takes a POST)."""
STRIPPED_PREFIXES = ("/v/", "/audioapi/")
"""Prefixes llama-swap removes before a request goes on: ``/v/chat/completions`` (its
"versionless" aliases) reaches the model as ``/chat/completions``,
``/audioapi/v1/tasks/run`` as ``/v1/tasks/run``."""


def inference_methods(path: str) -> tuple[str, ...]:
    """The methods inference ``path`` takes."""
    if path in GET_ONLY_PATHS:
        return ("GET",)
    if path in QUERY_MODEL_PATHS:
        return ("GET", "POST")
    return ("POST",)


def upstream_path(path: str) -> str:
    """The path an inference request reaches its model (or peer) at."""
    if path.startswith(STRIPPED_PREFIXES):
        return path[path.index("/", 1) :]
    return path


PROXY_EXACT = frozenset(
    "/" + p
    for p in INFERENCE_PATHS
    + [
        "v1/models",
        "running",
        "unload",
        "health",
        "logs",
        "logs/stream",
        "api/queue",
        "metrics",
        "api/version",
        "api/hardware",  # llama-swap's web UI polls these two: no middleware on the way
        "api/performance",
        "api/events",
        "wol-health",  # llama-swap's /health for its wake-on-LAN helper
        "comfyui",  # to /comfyui/ (proxy/comfyui.py)
    ]
)
"""Paths served by the lean proxy handler (see ``proxy/handler.py``)."""
PROXY_PREFIXES = (
    "/upstream/",
    "/comfyui/",
    "/api/models/unload",
    "/api/inflight/",
    "/logs/stream/",
)

JSON_PREFIXES = ("/v1/", "/api/", "/upstream/", "/logs/")


def wants_json(path: str) -> bool:
    """API and proxy paths answer errors in JSON; pages (dashboard, admin) in HTML."""
    return (
        path in PROXY_EXACT
        or path.startswith(PROXY_PREFIXES)
        or path.startswith(JSON_PREFIXES)
        or path.rstrip("/") in PROXY_EXACT
        or path.rstrip("/") in ("/v1", "/api", "/upstream")
    )
