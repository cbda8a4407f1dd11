"""The activity log API, mounted under ``/api/`` (see ``dashboard.api``)."""

from django.urls import path

from dashboard import api

urlpatterns = [
    path("metrics/activity", api.activity),
    path("requests/<str:request_id>", api.request_detail),
]
