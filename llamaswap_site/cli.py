"""The ``llamaswap`` command (``[project.scripts]`` in pyproject.toml).

``make install`` (``pip install -e .``) puts it in ``.venv/bin/llamaswap``. It sets
DJANGO_SETTINGS_MODULE and runs the Django management command behind each subcommand,
so nothing needs ``manage.py`` or a particular working directory::

    llamaswap serve --config config.yaml --listen :8080
    llamaswap check config.yaml
    llamaswap manage changepassword admin     # any other Django command

and llama-swap's own command line (Go ``flag`` syntax: ``-flag value``, ``-flag=value``,
``--flag``), so a systemd unit written for llama-swap needs only the binary renamed::

    llamaswap -config /etc/llama-swap/config.yaml -listen :8080 -watch-config

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


GO_FLAGS: dict[str, tuple[str, bool]] = {
    "config": ("--config", False),
    "config-dir": ("--config-dir", False),
    "listen": ("--listen", False),
    "tls-cert-file": ("--tls-cert-file", False),
    "tls-key-file": ("--tls-key-file", False),
    "watch-config": ("--watch-config", True),
    "version": ("", True),
}
"""llama-swap's flags (its llama-swap.go) -> (the ``serve`` option, is a bool flag);
``-version`` is answered here."""
_TRUE = ("1", "t", "T", "true", "TRUE", "True")
_FALSE = ("0", "f", "F", "false", "FALSE", "False")  # Go's strconv.ParseBool


class FlagError(Exception):
    pass


def parse_go_flags(args: Sequence[str]) -> dict[str, str | bool]:
    """``args`` as Go's ``flag`` package parses llama-swap's flags: ``-name value``,
    ``-name=value``, one or two dashes; a bool flag takes no separate value (``-name``,
    ``-name=false``). Parsing stops at ``--`` or the first argument that is no flag (the
    rest is ignored, as llama-swap does). Raises :class:`FlagError` as Go would refuse."""
    found: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if len(arg) < 2 or arg[0] != "-":
            break
        i += 1
        if arg == "--":
            break
        name = arg[2:] if arg.startswith("--") else arg[1:]
        if not name or name[0] in "-=":
            raise FlagError(f"bad flag syntax: {arg}")
        name, has_value, value = name.partition("=")
        if name in ("h", "help"):
            raise FlagError("")
        spec = GO_FLAGS.get(name)
        if spec is None:
            raise FlagError(f"flag provided but not defined: -{name}")
        if spec[1]:  # bool
            if not has_value:
                found[name] = True
            elif value in _TRUE or value in _FALSE:
                found[name] = value in _TRUE
            else:
                raise FlagError(f'invalid boolean value "{value}" for -{name}: parse error')
            continue
        if not has_value:
            if i >= len(args):
                raise FlagError(f"flag needs an argument: -{name}")
            value = args[i]
            i += 1
        found[name] = value
    return found


def go_usage() -> str:
    return "\n".join(
        [
            f"Usage of {PROG} (llama-swap's flags; `{PROG} --help` lists the commands):",
            "  -config string\n    \tpath to config file",
            "  -config-dir string\n    \tdirectory of *.yml/*.yaml config files (additive to -config)",
            "  -listen string\n    \tlisten address (default 127.0.0.1:8080, or 127.0.0.1:8443 with TLS)",
            "  -tls-cert-file string\n    \tTLS certificate file",
            "  -tls-key-file string\n    \tTLS key file",
            "  -version\n    \tshow version and exit",
            "  -watch-config\n    \treload config on file change",
        ]
    )


def serve_argv(flags: dict[str, str | bool]) -> list[str]:
    """The ``serve`` arguments for llama-swap's flags (``-version`` excluded)."""
    argv: list[str] = []
    for name, value in flags.items():
        option, is_bool = GO_FLAGS[name]
        if not option:
            continue
        if is_bool:
            if value:
                argv.append(option)
        else:
            argv += [option, str(value)]
    return argv


def version_line() -> str:
    """``-version``: llama-swap's shape (``version: V (COMMIT), built at DATE``)."""
    return f"version: {_version()} ({PROG}), built at unknown"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    name, rest = args[0], args[1:]
    if name in ("-h", "--help"):
        print(usage())
        return 0
    if name.startswith("-") and name != "--version":  # llama-swap's command line
        try:
            flags = parse_go_flags(args)
        except FlagError as error:
            if str(error):
                print(f"{error}\n{go_usage()}", file=sys.stderr)
                return 2
            print(go_usage(), file=sys.stderr)  # -h: Go prints the usage, exits 0
            return 0
        if flags.get("version"):
            print(version_line())
            return 0
        name, rest = "serve", serve_argv(flags)
    if name == "help":  # `llamaswap help serve` is `llamaswap serve --help`
        if not rest:
            print(usage())
            return 0
        name, rest = rest[0], ["--help"]
    if name == "--version":
        print(version_line())
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
