"""Config checks: a bad config.yaml is reported before the first request.

Two ways in, one set of messages (:func:`inspect_config`):

* ``llamaswap check CONFIG`` (``manage.py check_config``): the file named on the command
  line; prints each error and warning with its key path, exits 1 on an error.
* Django's system checks (``manage.py check`` and every command that runs checks,
  ``runserver`` among them) load the file named by ``settings.LLAMASWAP_CONFIG``, and say
  nothing when it is unset.

Messages:

* ``llamaswap.E001``: the config cannot be used; the message names the key path, one per
  problem: :func:`every_error` finds the first, then parses the file again without the
  key at fault (a model's ``cmd`` replaced by a placeholder, a list entry's whole list
  left out), and so on, so a config with three mistakes in different places reports
  all three in one run (at most :data:`MAX_ERRORS`), also for ``--config-dir`` fragments
  (parsed merged, as ``serve`` reads them). A file that cannot be read (missing, not YAML)
  or merged is one error.
* ``llamaswap.W001``: a key that is ignored (not supported, unknown) or adjusted.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from django.conf import settings
from django.core import checks

from scheduler.config import Config, ConfigError, load_config, parse_config, read_yaml
from scheduler.sources import load_sources, merged_sources, source_files

log = logging.getLogger("llamaswap.config")

TAG = "llamaswap"
E_CONFIG = "llamaswap.E001"
W_CONFIG = "llamaswap.W001"
MAX_ERRORS = 20
"""Errors one ``check`` lists at most (each costs a parse of the file)."""
PLACEHOLDER_CMD = "llamaswap-check-placeholder ${PORT}"
"""What a model's faulty (or missing) ``cmd`` is replaced by while the rest is checked."""


def every_error(first: ConfigError, path: str, config_dir: str = "") -> list[ConfigError]:
    """``first`` (raised loading ``path`` and the fragments of ``config_dir``) and the
    errors after it: the config (the fragments merged as ``serve`` merges them) parsed
    again without each key at fault, until it parses, a key cannot be left out, or
    :data:`MAX_ERRORS`. Each error keeps its own key path."""
    errors = list(first.every)
    if not (path or config_dir) or first.key in ("", path, config_dir):
        return errors  # the file itself (missing, not YAML): nothing to go on with
    try:
        if config_dir:
            files = source_files(path, config_dir)
            data, source = merged_sources(files), ", ".join(files)
        else:
            data, source = read_yaml(path), path
    except ConfigError:
        return errors  # a fragment that cannot be read or merged: that is the one error
    if not isinstance(data, dict):
        return errors
    seen = {error.key for error in errors}
    pending = [(error.key, False) for error in errors]
    for _ in range(2 * MAX_ERRORS):  # every round leaves something out, or ends
        for key, again in pending:
            if not _leave_out(data, key, again):
                return errors
        try:
            parse_config(data, source=source)
        except ConfigError as exc:
            fresh = [error for error in exc.every if error.key not in seen]
            if fresh:
                errors += fresh
                seen.update(error.key for error in fresh)
                pending = [(error.key, False) for error in fresh]
            else:  # a key left out (or replaced) is still at fault: its parent goes
                pending = [(_parent(error.key), True) for error in exc.every]
        except Exception:  # a parser bug the edited file triggered: what was found stands
            log.debug("re-checking %s failed", path, exc_info=True)
            return errors
        else:
            return errors
        if len(errors) >= MAX_ERRORS:
            break
    return errors[:MAX_ERRORS]


def _locate(data: Any, key: str) -> list[tuple[Any, Any]]:
    """The ``(container, key)`` steps of ``key`` (``models.org/model.ttl``,
    ``apiKeys[1]``) in ``data``, as far as they go. Mapping keys may hold dots: the
    longest one that fits is taken."""
    steps: list[tuple[Any, Any]] = []
    node, rest = data, key
    while rest:
        if rest.startswith("[") and isinstance(node, list) and "]" in rest:
            index = rest[1 : rest.index("]")]
            if not index.isdigit() or int(index) >= len(node):
                break
            steps.append((node, int(index)))
            node, rest = node[int(index)], rest[rest.index("]") + 1 :].removeprefix(".")
            continue
        if not isinstance(node, dict):
            break
        fits = [k for k in node if rest == str(k) or rest.startswith((f"{k}.", f"{k}["))]
        if not fits:
            break
        k = max(fits, key=lambda k: len(str(k)))
        steps.append((node, k))
        node, rest = node[k], rest[len(str(k)) :].removeprefix(".")
    return steps


def _parent(key: str) -> str:
    cut = max(key.rfind("."), key.rfind("["))
    return key[:cut] if cut > 0 else ""


def _leave_out(data: dict[str, Any], key: str, again: bool) -> bool:
    """Take the value at ``key`` out of ``data`` (a model's ``cmd``: replaced by
    :data:`PLACEHOLDER_CMD`, unless ``again``; a list entry: the whole list). False when
    ``key`` is not found in ``data``."""
    steps = _locate(data, key)
    while steps and not isinstance(steps[-1][0], dict):
        steps.pop()  # a list entry: the list goes (its other entries' indexes stay true)
    if not steps:
        return False
    container, name = steps[-1]
    in_model = len(steps) == 3 and steps[0][1] == "models"
    if in_model and name == "cmd" and not again:
        container[name] = PLACEHOLDER_CMD
    else:
        del container[name]
    return True


def inspect_config(
    path: str, named_by: str = "", config_dir: str = ""
) -> tuple[Config | None, list[checks.CheckMessage]]:
    """Load ``path`` (and the fragments of ``config_dir``, see :mod:`scheduler.sources`):
    the config (None when unusable) and one Error, or one Warning per warning.
    ``named_by`` says where the path came from, for the hint."""
    given = path
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
        found = every_error(exc, given, config_dir)
        errors: list[checks.CheckMessage] = [
            checks.Error(
                exc.message if file_level else f"{exc.key}: {exc.message}",
                hint=hint,
                obj=path,
                id=E_CONFIG,
            )
        ]
        errors.extend(  # every other problem (every_error), each with its key
            checks.Error(f"{more.key}: {more.message}", hint=hint, obj=path, id=E_CONFIG)
            for more in found[1:]
        )
        return None, errors
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
