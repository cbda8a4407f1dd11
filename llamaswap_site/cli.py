"""The ``llamaswap`` command (``[project.scripts]`` in pyproject.toml).

``make install`` (``pip install -e .``) puts it in ``.venv/bin/llamaswap``. It sets
DJANGO_SETTINGS_MODULE and runs the Django management command behind each subcommand,
so nothing needs ``manage.py`` or a particular working directory::

    llamaswap serve --config config.yaml --listen :8080
    llamaswap check config.yaml
    llamaswap manage changepassword admin     # any other Django command

``python -m llamaswap_site.cli`` is the same thing without the installed script.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

PROG = "llamaswap"
SETTINGS = "llamaswap_site.settings"

# subcommand -> (Django management command, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("serve", "serve the proxy, dashboard and metrics (--config FILE --listen HOST:PORT)"),
    "check": (
        "check_config",
        "check a config.yaml; errors and warnings with key paths, exit 1 on errors",
    ),
    "simulate": ("simulate", "replay a JSONL trace through the scheduler on a virtual clock"),
    "prune-activity": ("prune_activity", "apply the activity log's retention now"),
    "migrate": ("migrate", "create or update the database tables"),
    "createsuperuser": ("createsuperuser", "create an admin account (asks for the password)"),
    "ensure-admin": (
        "ensure_admin",
        "create or update the admin account from LLAMASWAP_ADMIN_USER/_PASSWORD",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS)) + 2
    lines = [
        f"usage: {PROG} COMMAND [ARGS...]",
        "",
        "A llama-swap compatible proxy with a priority scheduler.",
        "",
        "commands:",
        *(f"  {name:<{width}}{text}" for name, (_, text) in COMMANDS.items()),
        f"  {'manage':<{width}}any other Django management command ({PROG} manage help)",
        "",
        f"`{PROG} COMMAND --help` shows a command's options.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    name, rest = args[0], args[1:]
    if name in ("-h", "--help"):
        print(usage())
        return 0
    if name == "help":  # `llamaswap help serve` is `llamaswap serve --help`
        if not rest:
            print(usage())
            return 0
        name, rest = rest[0], ["--help"]
    if name == "--version":
        print(f"{PROG} {_version()}")
        return 0

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", SETTINGS)
    if name == "manage":
        from django.core.management import execute_from_command_line

        execute_from_command_line([f"{PROG} manage", *rest])
        return 0

    entry = COMMANDS.get(name.replace("_", "-"))
    if entry is None:
        print(f"{PROG}: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    import django
    from django.core.management import ManagementUtility

    django.setup()
    command = ManagementUtility([PROG]).fetch_command(entry[0])
    # argv[1] only names the command in its usage line: "usage: llamaswap check ...".
    command.run_from_argv([PROG, name, *rest])
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PROG)
    except PackageNotFoundError:
        return "(not installed)"


if __name__ == "__main__":
    sys.exit(main())
