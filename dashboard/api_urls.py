"""The activity log API, mounted under ``/api/`` (see ``dashboard.api``)."""

from django.urls import path

from dashboard import api, model_control, profiles
from web.errors import allow_methods

read = allow_methods("GET", "HEAD")  # read-only: any other method is a JSON 405

urlpatterns = [
    path("metrics/activity", read(api.activity)),
    path("metrics/stats", read(api.stats)),  # llama-swap's totals and speed histograms
    path("requests/<str:request_id>", read(api.request_detail)),
    path("captures/<str:capture_id>", read(api.capture)),  # captureBuffer
    path("profiles", read(profiles.profiles_api)),  # llama-swap's profile API
    path("profiles/active", allow_methods("PUT")(profiles.active_profile_api)),
    path("models/load/<path:model_name>", allow_methods("POST")(model_control.load_api)),
]
