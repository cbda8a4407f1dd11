from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("proxy.urls")),
    path("api/", include("dashboard.api_urls")),  # activity log API (read-only)
    path("", include("dashboard.urls")),
]
