"""System checks: a bad config.yaml is reported before the first request.

``manage.py check`` (and every command that runs checks, ``runserver`` and ``serve``
among them) loads the file named by ``settings.LLAMASWAP_CONFIG`` and reports:

* ``llamaswap.E001``: the config cannot be used; the message names the key path.
* ``llamaswap.W001``: a key that is ignored (not supported, unknown) or adjusted.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core import checks

from scheduler.config import ConfigError, load_config

TAG = "llamaswap"
E_CONFIG = "llamaswap.E001"
W_CONFIG = "llamaswap.W001"


@checks.register(TAG)
def check_config(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Load the configured config.yaml; one Error for a problem, one Warning per warning."""
    path = getattr(settings, "LLAMASWAP_CONFIG", "")
    if not path:
        return []
    try:
        config = load_config(path)
    except ConfigError as exc:
        # Django prints obj first: "config.yaml: (llamaswap.E001) models.qwen.ttl: ...".
        file_level = exc.key in ("", path)
        where = "the file" if file_level else f"'{exc.key}'"
        return [
            checks.Error(
                exc.message if file_level else f"{exc.key}: {exc.message}",
                hint=(
                    f"Fix {where} in {path} (set by LLAMASWAP_CONFIG); "
                    "config.example.yaml shows every supported key."
                ),
                obj=path,
                id=E_CONFIG,
            )
        ]
    return [
        checks.Warning(
            warning,
            hint="See config.example.yaml for the keys llamaswap supports.",
            obj=path,
            id=W_CONFIG,
        )
        for warning in config.warnings
    ]
