"""The history page over a big activity log: ``python -m bench.bench_history``.

The page's first page (the newest 50 rows) is what its live mode fetches every 2 s while
a tab shows it; the filters (outcome, lane, model) run on indexed columns. Timed through
Django's test client against a throwaway SQLite database of :data:`RECORDS` rows
(``DATABASE_URL`` chooses another database; it must be one you can fill).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

RECORDS = 100_000
RUNS = 7
QUERIES = ("", "?outcome=cancelled_waiting", "?lane=gpu1", "?outcome=failed&lane=gpu0&model=m3")


def main() -> None:
    folder = tempfile.mkdtemp(prefix="bench-history-")
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{folder}/history.db")
    os.environ.setdefault("ALLOWED_HOSTS", "testserver")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llamaswap_site.settings")
    import django

    django.setup()
    from datetime import UTC, datetime, timedelta

    from django.core.management import call_command
    from django.test import Client
    from django.test.utils import setup_test_environment

    from activity.models import RequestRecord

    call_command("migrate", verbosity=0)
    setup_test_environment()
    if RequestRecord.objects.count() < RECORDS:
        t0 = datetime(2026, 11, 1, tzinfo=UTC)
        outcomes = ["completed"] * 18 + ["failed", "cancelled_waiting"]
        RequestRecord.objects.bulk_create(
            (
                RequestRecord(
                    request_id=f"r{i}",
                    model=f"m{i % 7}",
                    path="/v1/chat/completions",
                    priority=0,
                    band=("interactive", "normal", "batch")[i % 3],
                    policy="serial",
                    lane=f"gpu{i % 2}",
                    arrived_at=t0 + timedelta(seconds=i),
                    finished_at=t0 + timedelta(seconds=i + 1),
                    outcome=outcomes[i % 20],
                    status=200,
                    duration_ms=1000.0,
                    prompt_tokens=10,
                    completion_tokens=20,
                    tokens_per_second=30.0,
                )
                for i in range(RECORDS)
            ),
            batch_size=5000,
        )
    client = Client()
    print(f"| /history/ query ({RECORDS:,} records) | median ms | max ms |")
    print("| --- | ---: | ---: |")
    for query in QUERIES:
        client.get("/history/" + query)
        times = []
        for _ in range(RUNS):
            start = time.perf_counter()
            response = client.get("/history/" + query)
            times.append((time.perf_counter() - start) * 1000)
            if response.status_code != 200:
                sys.exit(f"/history/{query}: {response.status_code}")
        print(f"| `{query or '(none)'}` | {statistics.median(times):.0f} | {max(times):.0f} |")


if __name__ == "__main__":
    main()
