"""The admin pages of the control records under their old addresses: they were
``/admin/dashboard/<model>/...`` while the models lived in ``dashboard``, and a bookmark,
a link in a note or a script still finds them (a permanent redirect that keeps the method
and the query string). Included under ``admin/`` before the admin itself
(``llamaswap_site/urls.py``)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponsePermanentRedirect
from django.urls import re_path, reverse

MOVED = ("issuedkey", "accesscontrol", "schedulersettingsrecord", "settingschange")
"""The models that moved from ``dashboard`` to ``control`` (their admin paths)."""


def moved(request: HttpRequest, model: str, rest: str) -> HttpResponsePermanentRedirect:
    target = f"{reverse('admin:index')}control/{model}/{rest}"
    query = request.META.get("QUERY_STRING", "")
    return HttpResponsePermanentRedirect(
        f"{target}?{query}" if query else target, preserve_request=True
    )


urlpatterns = [
    re_path(rf"^dashboard/(?P<model>{'|'.join(MOVED)})/(?P<rest>.*)$", moved),
]
