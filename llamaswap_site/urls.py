from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", include("control.urls")),  # the control records' old admin addresses
    path("admin/", admin.site.urls),
    path("", include("proxy.urls")),
    path("api/", include("dashboard.api_urls")),  # activity log API (read-only)
    path("", include("dashboard.urls")),
]

# JSON on API and proxy paths, HTML pages elsewhere (web.paths.wants_json). The lean
# proxy handler reaches these too, through Django's response_for_exception.
handler400 = "web.errors.bad_request"
handler403 = "web.errors.permission_denied"
handler404 = "web.errors.page_not_found"
handler500 = "web.errors.server_error"
