"""Where the config comes from: ``--config``, ``--config-dir`` fragments, and their changes.

llama-swap's ``-config-dir`` merges every ``*.yml``/``*.yaml`` file of a directory (sorted
by name, after ``-config`` when both are given) into one config, and we merge the same
way:

* the identity maps (``models``, ``groups``, ``profiles``, ``selectors``, ``peers``,
  ``matrix``, ``routing.router.settings.groups`` and ``.matrix``) take each source's
  entries; an id defined by two sources is an error naming it and the second file;
* other mappings merge key by key, lists are concatenated, and a scalar set to two
  different values is an error (null gives way to a value);
* ``--config`` and a file in ``--config-dir`` may not be the same file.

:func:`fingerprint` is what ``--watch-config`` polls (every 2 s, as llama-swap): the
names, sizes and modification times of every source, so adding or removing a fragment
counts as a change too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from scheduler.config import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_CHARS,
    MAX_CONFIG_VALUES,
    Config,
    ConfigError,
    check_size,
    parse_config,
    read_yaml,
)

log = logging.getLogger("llamaswap.config")

MAX_CONFIG_FILES = 1000
"""The most ``*.yml``/``*.yaml`` fragments a ``--config-dir`` may hold (each is opened and
parsed at every load)."""

IDENTITY_MAPS = frozenset(
    {
        "models",
        "groups",
        "profiles",
        "selectors",
        "peers",
        "matrix",
        "routing.router.settings.groups",
        "routing.router.settings.matrix",
    }
)


def source_files(config: str = "", config_dir: str = "") -> list[str]:
    """The files to read, in merge order. Raises :class:`ConfigError`."""
    if not config and not config_dir:
        raise ConfigError("", "no config: pass --config FILE and/or --config-dir DIR")
    files = [config] if config else []
    if config_dir:
        try:
            names = sorted(
                entry.name
                for entry in os.scandir(config_dir)
                if entry.is_file() and entry.name.endswith((".yml", ".yaml"))
            )
        except OSError as exc:
            raise ConfigError(config_dir, f"cannot read the config directory: {exc.strerror}") from None
        if len(names) > MAX_CONFIG_FILES:
            raise ConfigError(
                config_dir, f"more than {MAX_CONFIG_FILES} *.yml/*.yaml files in the config directory"
            )
        fragments = [os.path.join(config_dir, name) for name in names]
        if config and any(Path(f).resolve() == Path(config).resolve() for f in fragments):
            raise ConfigError(
                config, f"--config {config} is also in --config-dir {config_dir}; remove it from one"
            )
        files += fragments
    if not files:
        raise ConfigError(config_dir, "no *.yml or *.yaml files in the config directory")
    return files


def load_sources(config: str = "", config_dir: str = "") -> Config:
    """Read, merge and parse the config. Raises :class:`ConfigError`, and nothing else.

    Any other exception is a parser bug that a file triggered: for the operator it is still
    a refused config (``check`` exits 1, ``serve`` does not start, a reload keeps the old
    config), reported as a ConfigError naming the file; its traceback is logged at debug.
    """
    try:
        return _load_sources(config, config_dir)
    except ConfigError:
        raise
    except Exception as exc:
        where = ", ".join(p for p in (config, config_dir) if p)
        log.debug("loading the config %s failed", where, exc_info=True)
        raise ConfigError(where, f"cannot load the config: {type(exc).__name__}: {exc}") from exc


def _load_sources(config: str, config_dir: str) -> Config:
    files = source_files(config, config_dir)
    return parse_config(merged_sources(files), source=", ".join(files))


def merged_sources(files: list[str]) -> dict[str, Any]:
    """``files`` (:func:`source_files`) read and merged into one config mapping, not yet
    parsed (``scheduler.checks`` parses it again, key by key left out, to list every
    error). Raises :class:`ConfigError`."""
    merged: dict[str, Any] | None = None
    left = MAX_CONFIG_BYTES  # for all the files together
    values = chars = 0  # the merged config holds at most the sum of the files
    for path in files:
        data = read_yaml(path, max_bytes=left)
        left -= _size(path)
        more_values, more_chars = check_size(data, path)  # before _merge walks it
        values, chars = values + more_values, chars + more_chars
        if values > MAX_CONFIG_VALUES or chars > MAX_CONFIG_CHARS:
            raise ConfigError(
                path,
                f"the config sources up to this one hold more than {MAX_CONFIG_VALUES} values "
                f"or {MAX_CONFIG_CHARS} characters once YAML aliases are expanded",
            )
        if data is None:
            continue  # an empty file
        if not isinstance(data, dict):
            raise ConfigError(path, "the top level of a config file must be a mapping")
        if merged is None:
            merged = data
        else:
            _merge(merged, data, "", path)
    return merged or {}


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # read a moment ago; gone since: the next reload sees it
        return 0


def fingerprint(config: str = "", config_dir: str = "") -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime in ns) of every source; a missing one counts as (name, -1, -1)."""
    try:
        files = source_files(config, config_dir)
    except ConfigError:
        files = [config] if config else []
    out = []
    for path in files:
        try:
            stat = os.stat(path)
            out.append((path, stat.st_size, stat.st_mtime_ns))
        except OSError:
            out.append((path, -1, -1))
    return tuple(out)


def _merge(dst: dict[str, Any], src: dict[str, Any], path: str, source: str) -> None:
    for key, value in src.items():
        child = f"{path}.{key}" if path else str(key)
        if key not in dst:
            dst[key] = value
        elif child in IDENTITY_MAPS:
            _merge_identity(dst[key], value, child, source)
        else:
            dst[key] = _merge_value(dst[key], value, child, source)


def _merge_identity(dst: Any, src: Any, path: str, source: str) -> None:
    if src is None:
        return
    if not isinstance(dst, dict) or not isinstance(src, dict):
        raise ConfigError(path, f"expected a mapping, introduced by {source}")
    for key, value in src.items():
        if key in dst:
            raise ConfigError(
                f"{path}.{key}", f"defined again in {source} (already defined in another config source)"
            )
        dst[key] = value


def _merge_value(dst: Any, src: Any, path: str, source: str) -> Any:
    if isinstance(dst, dict) and isinstance(src, dict):
        _merge(dst, src, path, source)
        return dst
    if isinstance(dst, list) and isinstance(src, list):
        return dst + src
    if dst is None:
        return src
    if src is None:
        return dst
    if isinstance(dst, (dict, list)) or isinstance(src, (dict, list)):
        raise ConfigError(path, f"{source} gives it a different kind of value than a previous source")
    if dst == src and type(dst) is type(src):
        return dst
    raise ConfigError(path, f"{source} sets a different value than a previous source")
