from django.urls import path, re_path

from activity.metrics import metrics_view
from proxy import comfyui, events, logstream, uiapi, views
from web.errors import allow_methods
from web.paths import INFERENCE_PATHS

# Methods as llama-swap documents them; any
# other gets a JSON 405 with Allow. Inference checks for POST itself; /upstream passes
# every method through.
read = allow_methods("GET", "HEAD")

# A path routed here is the lean handler's only when web.paths.PROXY_EXACT or
# PROXY_PREFIXES names it (llamaswap_site/asgi.py); errors on it are JSON.
urlpatterns = [path(p, views.inference) for p in INFERENCE_PATHS] + [
    # The model's id may hold "/" (Hugging Face style): the view finds where it ends.
    re_path(r"^upstream/(?P<rest>.+)$", views.upstream_passthrough),
    path("v1/models", read(views.list_models)),
    path("running", read(uiapi.running)),
    path("api/version", read(uiapi.version)),
    path("api/hardware", read(uiapi.hardware_snapshot)),
    path("api/performance", read(uiapi.performance)),
    path("upstream", read(uiapi.upstream_index)),  # llama-swap's: to its models page
    # llama-swap's ComfyUI passthrough (model comfyui_auto): every method, as /upstream.
    path("comfyui", comfyui.comfyui_redirect),
    re_path(r"^comfyui/(?P<path>.*)$", comfyui.comfyui_passthrough),
    re_path(r"^ui(?:/(?P<page>.*))?$", read(uiapi.ui_redirect)),  # its web UI's addresses
    path("api/events", read(events.events)),  # SSE, llama-swap's web UI
    path("api/inflight/<str:request_id>/cancel", allow_methods("POST")(uiapi.cancel_inflight)),
    path("unload", allow_methods("GET")(views.unload)),  # legacy; HEAD would unload too
    path("api/models/unload", allow_methods("POST")(views.unload)),
    path("api/models/unload/<path:model_name>", allow_methods("POST")(views.unload)),
    path("health", read(views.health)),
    path("wol-health", read(views.health)),  # llama-swap's, for its wake-on-LAN proxy
    path("api/queue", read(views.queue)),
    path("logs", read(logstream.logs)),
    path("logs/stream", read(logstream.logs_stream)),
    path("logs/stream/upstream", read(logstream.logs_stream)),
    path("logs/stream/proxy", read(logstream.proxy_stream)),
    path("logs/stream/<path:model_name>", read(logstream.model_stream)),  # ids may hold "/"
    path("metrics", read(metrics_view)),  # on the event loop: the collector reads the queue
]
