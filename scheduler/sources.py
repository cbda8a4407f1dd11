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

import os
from pathlib import Path
from typing import Any

from scheduler.config import Config, ConfigError, parse_config, read_yaml

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
    """Read, merge and parse the config. Raises :class:`ConfigError`."""
    files = source_files(config, config_dir)
    merged: dict[str, Any] | None = None
    for path in files:
        data = read_yaml(path)
        if data is None:
            continue  # an empty file
        if not isinstance(data, dict):
            raise ConfigError(path, "the top level of a config file must be a mapping")
        if merged is None:
            merged = data
        else:
            _merge(merged, data, "", path)
    return parse_config(merged or {}, source=", ".join(files))


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
