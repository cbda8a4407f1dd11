from django.urls import path

from dashboard import (
    logs_page,
    model_control,
    models_page,
    playground,
    profiles,
    queue,
    views,
    whatif,
)
from web.errors import allow_methods

app_name = "dashboard"

read = allow_methods("GET", "HEAD")  # read-only pages: 405 (an HTML page) for anything else

urlpatterns = [
    path("", read(views.dashboard), name="index"),
    path("dashboard/", read(views.dashboard), name="dashboard"),
    path("history/", read(views.history), name="history"),
    path("requests/<str:request_id>/", read(views.request_detail), name="request"),
    path("requests/<str:request_id>/status", read(queue.request_status), name="request_status"),
    path("queue/", read(queue.queue_page), name="queue"),
    path("queue/data", read(queue.queue_data), name="queue_data"),
    path("queue/<str:request_id>/cancel", allow_methods("POST")(queue.cancel_view), name="cancel"),
    path("whatif/", read(whatif.whatif), name="whatif"),
    path("models/", read(models_page.models_page), name="models"),
    path("models/feed/", read(models_page.models_feed), name="models_feed"),
    path("models/control/", allow_methods("POST")(model_control.control), name="models_control"),
    path("dashboard/logs/", read(logs_page.logs_page), name="logs"),
    path("dashboard/logs/feed", read(logs_page.logs_feed), name="logs_feed"),
    path("playground/", read(playground.playground), name="playground"),
    path("dashboard/profile/", profiles.profile_control, name="profile"),  # staff, POST
    # Included at the root (llamaswap_site/urls.py), so this is /favicon.ico, served by
    # the pages handler (it is no proxy path).
    path("favicon.ico", read(views.favicon), name="favicon"),
]
