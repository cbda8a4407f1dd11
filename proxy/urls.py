from django.urls import path, re_path

from proxy import views
from scheduler.metrics import metrics_view

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

urlpatterns = [path(p, views.inference) for p in INFERENCE_PATHS] + [
    re_path(r"^upstream/(?P<model_name>[^/]+)/(?P<path>.*)$", views.upstream_passthrough),
    re_path(r"^upstream/(?P<model_name>[^/]+)$", views.upstream_passthrough),
    path("v1/models", views.list_models),
    path("running", views.running),
    path("unload", views.unload),
    path("api/models/unload", views.unload),
    path("api/models/unload/<str:model_name>", views.unload),
    path("health", views.health),
    path("api/queue", views.queue),
    path("logs", views.logs),
    path("logs/stream", views.logs_stream),
    path("metrics", metrics_view),  # on the event loop: the collector reads the queue
]

# Paths served by the lean proxy handler (see llamaswap_site/asgi.py).
PROXY_EXACT = frozenset(
    "/" + p for p in INFERENCE_PATHS + ["v1/models", "running", "unload", "health", "logs", "logs/stream", "api/queue", "metrics"]
)
PROXY_PREFIXES = ("/upstream/", "/api/models/unload")
