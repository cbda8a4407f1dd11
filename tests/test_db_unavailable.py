"""Pages while the database is away: a 503 naming the cause (JSON on API paths), never a
500; other errors are still Django's. (tests/test_e2e_fleet_outage.py cuts a real
PostgreSQL link under a running server; here the database's error is raised in the view.)"""

from __future__ import annotations

import json

import pytest
from django.db import OperationalError
from django.db.models.query import QuerySet
from django.test import RequestFactory

from web.dbdown import DatabaseUnavailableMiddleware

pytestmark = pytest.mark.django_db

CUT = "server closed the connection unexpectedly"


@pytest.fixture
def database_away(monkeypatch):
    def unavailable(self):
        raise OperationalError(CUT)

    monkeypatch.setattr(QuerySet, "_fetch_all", unavailable)
    monkeypatch.setattr(QuerySet, "count", unavailable)


def test_a_page_that_reads_records_says_the_database_is_away(client, database_away):
    response = client.get("/history/")
    assert response.status_code == 503
    assert response["Retry-After"] == "5"
    page = response.content.decode()
    assert "503 Database unavailable" in page and CUT in page
    assert "requests are still served" in page


def test_an_api_path_gets_the_same_as_openai_shaped_json(client, database_away):
    response = client.get("/api/metrics/activity")
    assert response.status_code == 503
    error = json.loads(response.content)["error"]
    assert error["code"] == "database_unavailable" and CUT in error["message"]


def test_other_errors_are_left_to_django():
    middleware = DatabaseUnavailableMiddleware(lambda request: None)  # type: ignore[arg-type,return-value]
    request = RequestFactory().get("/history/")
    assert middleware.process_exception(request, ValueError("a bug")) is None
    assert middleware.process_exception(request, OperationalError(CUT)).status_code == 503
