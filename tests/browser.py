"""What every browser test shares: Debian's chromium (never a downloaded browser), the
admin account a test logs in with, and the login form itself.

The browser is /usr/bin/chromium (`make test` installs Debian's package when it is
missing); Playwright drives it. Screenshots go to test-artifacts/ (gitignored).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from tests.server import ROOT, Server

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"
ADMIN_PASSWORD = "browser-test-pw"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="needs Debian's chromium (make test installs it)"
)


def ensure_admin(server: Server, password: str = ADMIN_PASSWORD) -> None:
    """Create the staff account ``admin`` in the server's database (``make run``'s way)."""
    env = {**os.environ, "DATABASE_URL": server.database_url, "LLAMASWAP_ADMIN_PASSWORD": password}
    subprocess.run(
        [sys.executable, "manage.py", "ensure_admin"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=30,
        capture_output=True,
    )


def launch(playwright: Any) -> Any:
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


def log_in(page: Any, url: str, password: str = ADMIN_PASSWORD) -> None:
    """Fill the admin login form at ``url`` (a login page, or a page that shows one) as
    ``admin`` and submit it."""
    page.goto(url)
    page.fill("#id_username", "admin")
    page.fill("#id_password", password)
    page.click("input[type=submit]")
