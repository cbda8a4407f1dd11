"""Which paths are the proxy's, and which answer errors in JSON: the one table the router
(``llamaswap_site/asgi.py``), the proxy's URLconf and the error handlers read."""

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
]
"""The inference endpoints (``proxy.urls`` routes each to ``proxy.views.inference``)."""

PROXY_EXACT = frozenset(
    "/" + p
    for p in INFERENCE_PATHS
    + ["v1/models", "running", "unload", "health", "logs", "logs/stream", "api/queue", "metrics"]
)
"""Paths served by the lean proxy handler (see ``llamaswap_site/asgi.py``)."""
PROXY_PREFIXES = ("/upstream/", "/api/models/unload")

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
