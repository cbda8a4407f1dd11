from django.urls import path, re_path

from activity.metrics import metrics_view
from proxy import views
from proxy.errors import allow_methods

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

# Methods as llama-swap documents them; any
# other gets a JSON 405 with Allow. Inference checks for POST itself; /upstream passes
# every method through.
read = allow_methods("GET", "HEAD")

urlpatterns = [path(p, views.inference) for p in INFERENCE_PATHS] + [
    re_path(r"^upstream/(?P<model_name>[^/]+)/(?P<path>.*)$", views.upstream_passthrough),
    re_path(r"^upstream/(?P<model_name>[^/]+)$", views.upstream_passthrough),
    path("v1/models", read(views.list_models)),
    path("running", read(views.running)),
    path("unload", allow_methods("GET")(views.unload)),  # legacy; HEAD would unload too
    path("api/models/unload", allow_methods("POST")(views.unload)),
    path("api/models/unload/<str:model_name>", allow_methods("POST")(views.unload)),
    path("health", read(views.health)),
    path("api/queue", read(views.queue)),
    path("logs", read(views.logs)),
    path("logs/stream", read(views.logs_stream)),
    path("metrics", read(metrics_view)),  # on the event loop: the collector reads the queue
]

# Paths served by the lean proxy handler (see llamaswap_site/asgi.py).
PROXY_EXACT = frozenset(
    "/" + p
    for p in INFERENCE_PATHS
    + ["v1/models", "running", "unload", "health", "logs", "logs/stream", "api/queue", "metrics"]
)
PROXY_PREFIXES = ("/upstream/", "/api/models/unload")
