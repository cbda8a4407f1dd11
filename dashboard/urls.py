from django.urls import path

from dashboard import profiles, views, whatif
from web.errors import allow_methods

app_name = "dashboard"

read = allow_methods("GET", "HEAD")  # read-only pages: 405 (an HTML page) for anything else

urlpatterns = [
    path("", read(views.dashboard), name="index"),
    path("dashboard/", read(views.dashboard), name="dashboard"),
    path("history/", read(views.history), name="history"),
    path("requests/<str:request_id>/", read(views.request_detail), name="request"),
    path("whatif/", read(whatif.whatif), name="whatif"),
    path("dashboard/profile/", profiles.profile_control, name="profile"),  # staff, POST
    # Included at the root (llamaswap_site/urls.py), so this is /favicon.ico, served by
    # the pages handler (it is no proxy path).
    path("favicon.ico", read(views.favicon), name="favicon"),
]
