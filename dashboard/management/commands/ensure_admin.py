"""``manage.py ensure_admin``: an admin account from the environment, for `make run`.

With LLAMASWAP_ADMIN_PASSWORD set, creates the superuser LLAMASWAP_ADMIN_USER (default
``admin``) or resets its password. Without it, says how to get an account.
"""

from __future__ import annotations

import os

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand

HINT = (
    "admin: no LLAMASWAP_ADMIN_PASSWORD set. Create an account with "
    "`python manage.py createsuperuser`, or run `LLAMASWAP_ADMIN_PASSWORD=... make run`."
)


class Command(BaseCommand):
    help = (
        "Create or update the admin account from LLAMASWAP_ADMIN_USER / LLAMASWAP_ADMIN_PASSWORD."
    )

    def handle(self, *args, **options):
        password = os.environ.get("LLAMASWAP_ADMIN_PASSWORD", "")
        username = os.environ.get("LLAMASWAP_ADMIN_USER", "admin") or "admin"
        if not password:
            self.stdout.write(HINT)
            return
        user, created = ensure_admin(username, password)
        verb = "created" if created else "updated"
        self.stdout.write(f"admin: {verb} superuser {user.get_username()!r} (log in at /admin/)")


def ensure_admin(username: str, password: str):
    User = get_user_model()
    user, created = User.objects.get_or_create(**{User.USERNAME_FIELD: username})
    user.is_staff = True
    user.is_superuser = True
    user.set_password(password)
    user.save()
    return user, created
