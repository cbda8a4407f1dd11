"""``llamaswap ensure-admin`` (``manage.py ensure_admin``): an admin account from the
environment, for `make run`.

With LLAMASWAP_ADMIN_PASSWORD set, creates the superuser LLAMASWAP_ADMIN_USER (default
``admin``) or resets its password. Without it, says whether an admin account exists and
how to get one or reset its password. Each case prints one line:

* password given, no such user: ``created superuser 'admin'``
* password given, the user exists: ``updated superuser 'admin'`` (password set)
* no password, no superuser yet: how to create one
* no password, superusers exist: which ones, and how to reset a password

:func:`account_hint` is the same answer for ``serve``'s start-up line (None when an
account exists).
"""

from __future__ import annotations

import os
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.base_user import AbstractBaseUser
from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

CREATE = "`llamaswap createsuperuser`, or `LLAMASWAP_ADMIN_PASSWORD=... make run`"


class Command(BaseCommand):
    help = (
        "Create or update the admin account from LLAMASWAP_ADMIN_USER / LLAMASWAP_ADMIN_PASSWORD."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            self.report()
        except DatabaseError as exc:  # before the first `llamaswap migrate`
            raise CommandError(
                f"admin: no database tables yet ({exc}); run `llamaswap migrate`"
            ) from None

    def report(self) -> None:
        password = os.environ.get("LLAMASWAP_ADMIN_PASSWORD", "")
        username = os.environ.get("LLAMASWAP_ADMIN_USER", "admin") or "admin"
        if password:
            user, created = ensure_admin(username, password)
            name = user.get_username()
            if created:
                self.stdout.write(f"admin: created superuser {name!r}; log in at /admin/")
            else:
                self.stdout.write(
                    f"admin: updated superuser {name!r} (password set from "
                    "LLAMASWAP_ADMIN_PASSWORD); log in at /admin/"
                )
            return
        names = superuser_names()
        if not names:
            self.stdout.write(
                f"admin: no admin account yet and no LLAMASWAP_ADMIN_PASSWORD set. Create one "
                f"with {CREATE}."
            )
            return
        shown = ", ".join(repr(name) for name in names[:5]) + (", ..." if len(names) > 5 else "")
        self.stdout.write(
            f"admin: superuser {shown} exists; log in at /admin/ (LLAMASWAP_ADMIN_PASSWORD "
            "not set, password unchanged). Reset it with `LLAMASWAP_ADMIN_PASSWORD=... make "
            "run` or `llamaswap manage changepassword NAME`; another account: "
            "`llamaswap createsuperuser`."
        )


def ensure_admin(username: str, password: str) -> tuple[AbstractBaseUser, bool]:
    User = get_user_model()
    lookup: dict[str, Any] = {User.USERNAME_FIELD: username}
    user, created = User.objects.get_or_create(**lookup)
    user.is_staff = True
    user.is_superuser = True
    user.set_password(password)
    user.save()
    return user, created


def superuser_names() -> list[str]:
    User = get_user_model()
    return list(
        User.objects.filter(is_superuser=True, is_active=True)
        .order_by(User.USERNAME_FIELD)
        .values_list(User.USERNAME_FIELD, flat=True)
    )


def account_hint() -> str | None:
    """For ``serve``'s start-up line: how to get an admin account, or None if one exists."""
    try:
        if superuser_names():
            return None
    except DatabaseError:  # no `llamaswap migrate` yet
        return f"no admin account: run `llamaswap migrate`, then {CREATE}"
    return f"no admin account yet: {CREATE}"
