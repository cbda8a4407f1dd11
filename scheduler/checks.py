"""Config checks: a bad config.yaml is reported before the first request.

Two ways in, one set of messages (:func:`inspect_config`):

* ``llamaswap check CONFIG`` (``manage.py check_config``): the file named on the command
  line; prints each error and warning with its key path, exits 1 on an error.
* Django's system checks (``manage.py check`` and every command that runs checks,
  ``runserver`` among them) load the file named by ``settings.LLAMASWAP_CONFIG``, and say
  nothing when it is unset.

Messages:

* ``llamaswap.E001``: the config cannot be used; the message names the key path (one
  per problem found: every invalid scheduler setting is listed, not only the first).
* ``llamaswap.W001``: a key that is ignored (not supported, unknown) or adjusted.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from django.conf import settings
from django.core import checks

from scheduler.config import Config, ConfigError, load_config
from scheduler.sources import load_sources

log = logging.getLogger("llamaswap.config")

TAG = "llamaswap"
E_CONFIG = "llamaswap.E001"
W_CONFIG = "llamaswap.W001"


def inspect_config(
    path: str, named_by: str = "", config_dir: str = ""
) -> tuple[Config | None, list[checks.CheckMessage]]:
    """Load ``path`` (and the fragments of ``config_dir``, see :mod:`scheduler.sources`):
    the config (None when unusable) and one Error, or one Warning per warning.
    ``named_by`` says where the path came from, for the hint."""
    try:
        try:
            config = load_sources(path, config_dir) if config_dir else load_config(path)
        except ConfigError:
            raise
        except Exception as bug:  # a parser bug the file triggered: still the file's error
            log.debug("loading the config %s failed", path or config_dir, exc_info=True)
            raise ConfigError(
                path or config_dir, f"cannot load the config: {type(bug).__name__}: {bug}"
            ) from bug
        path = path or config_dir
    except ConfigError as exc:
        path = path or config_dir
        # Django prints obj first: "config.yaml: (llamaswap.E001) models.qwen.ttl: ...".
        file_level = exc.key in ("", path)
        where = "the file" if file_level else f"'{exc.key}'"
        origin = f" (set by {named_by})" if named_by else ""
        if file_level and not os.path.exists(path):
            hint = f"No file at {path}{origin}; a relative path starts at {os.getcwd()}."
        else:
            hint = f"Fix {where} in {path}{origin}; config.example.yaml shows every supported key."
        return None, [
            checks.Error(
                exc.message if file_level else f"{exc.key}: {exc.message}",
                hint=hint,
                obj=path,
                id=E_CONFIG,
            )
        ] + [
            # Problems found in the same pass (every invalid scheduler setting), each with its key.
            checks.Error(f"{more.key}: {more.message}", hint=hint, obj=path, id=E_CONFIG)
            for more in exc.also
        ]
    return config, [
        checks.Warning(
            warning,
            hint="See config.example.yaml for the keys llamaswap supports.",
            obj=path,
            id=W_CONFIG,
        )
        for warning in config.warnings
    ]


@checks.register(TAG)
def check_config(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Load the configured config.yaml; one Error for a problem, one Warning per warning."""
    path = getattr(settings, "LLAMASWAP_CONFIG", "")
    if not path:
        return []
    return inspect_config(path, named_by="LLAMASWAP_CONFIG")[1]
