"""Reading a config's YAML: strictly (a key defined twice is an error, as in llama-swap)
and within bounds (:data:`MAX_CONFIG_BYTES` of text; :func:`check_size` for what its
aliases expand to, before anything walks it)."""

from __future__ import annotations

from typing import Any

import yaml

from scheduler.config.values import ConfigError

# What loading a config may cost. A few KB of YAML aliases (``&a [*b, *b, ...]``), macros
# that use each other or ``${env.NAME}`` repeated can stand for gigabytes; these bounds
# are far above any real config (llama-swap's example is 5 KB, 50 models are ~20 KB) and
# keep a hostile or mistaken one to a few seconds and a few hundred MB.
MAX_CONFIG_BYTES = 1024 * 1024
"""The most bytes of YAML read for one config, all of its sources together."""


MAX_CONFIG_VALUES = 200_000
"""The most values (scalars, lists, mappings and keys) once YAML aliases are expanded:
a node used through an alias counts at every use."""


MAX_CONFIG_CHARS = 16 * 1024 * 1024
"""The most characters of text once YAML aliases are expanded."""


MAX_CONFIG_DEPTH = 64
"""The deepest nesting of lists and mappings."""


def read_yaml(source: str, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """One YAML file, parsed strictly (duplicate keys are errors), of at most ``max_bytes``.
    Raises :class:`ConfigError` keyed by the file name, with the line number in the message.

    What its aliases expand to is not measured yet: the caller runs :func:`check_size`
    before walking it (:func:`parse_config` does)."""
    try:
        # At most one byte past the bound: --config /dev/zero must not fill the memory.
        with open(source, "rb") as file:
            raw = file.read(max_bytes + 1)
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(source, "config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, f"cannot read the config file: {exc}") from None
    if len(raw) > max_bytes:
        raise ConfigError(
            source,
            f"larger than {max_bytes} bytes"
            + (" (what is left of the config's bound)" if max_bytes < MAX_CONFIG_BYTES else "")
            + f"; a config is at most {MAX_CONFIG_BYTES} bytes in all",
        )
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown line"
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(source, f"YAML syntax error at {where}: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, f"YAML syntax error: {exc}") from None
    except (ValueError, RecursionError) as exc:
        # A scalar PyYAML cannot build: a date like 2001-02-30, an integer of more than
        # 4300 digits (Python's int conversion limit); or nesting past the interpreter's
        # recursion limit (the pure-Python parser).
        raise ConfigError(source, f"YAML value error: {exc}") from None
    return data


def check_size(data: Any, source: str = "") -> tuple[int, int]:
    """Refuse a parsed document that is too big to process once its YAML aliases are
    expanded (:data:`MAX_CONFIG_VALUES`, :data:`MAX_CONFIG_CHARS`), nested deeper than
    :data:`MAX_CONFIG_DEPTH`, or that contains itself (a recursive alias, ``&a [*a]``).

    Linear in the document as written: a node reached through aliases is measured once
    and counted at each use. The error names the smallest key whose expansion passes the
    bound (or ``source`` for the whole document), and the file in its message. Returns
    the document's values and characters, aliases expanded.
    """
    if not isinstance(data, dict | list | tuple):
        return 1, len(data) if isinstance(data, str) else 0
    measured: dict[int, tuple[int, int]] = {}  # id(container) -> (values, chars) in it
    open_ids = {id(data)}  # the containers on the current path: one met again is a cycle
    # One frame per open container: [container, its children, values, chars, path].
    frames: list[list[Any]] = [[data, _items(data), 1, 0, ""]]
    in_file = f" (in {source})" if source else ""

    def refuse(path: str, why: str) -> ConfigError:
        return ConfigError(path or source, f"{why}{in_file}")

    while frames:
        frame = frames[-1]
        item = next(frame[1], None)
        if item is None:
            frames.pop()
            open_ids.discard(id(frame[0]))
            measured[id(frame[0])] = (frame[2], frame[3])
            if not frames:
                return frame[2], frame[3]
            parent = frames[-1]
            parent[2] += frame[2]
            parent[3] += frame[3]
        else:
            label, child, key_chars = item
            frame[2] += 0 if key_chars is None else 1
            frame[3] += key_chars or 0
            path = (
                f"{frame[4]}{label}"
                if label.startswith("[") or not frame[4]
                else f"{frame[4]}.{label}"
            )
            if isinstance(child, dict | list | tuple):  # tuples: !!pairs, !!omap
                if id(child) in open_ids:
                    raise refuse(path, "contains itself (a recursive YAML alias)")
                known = measured.get(id(child))
                if known is None:
                    if len(frames) >= MAX_CONFIG_DEPTH:
                        raise refuse(path, f"nested deeper than {MAX_CONFIG_DEPTH} levels")
                    open_ids.add(id(child))
                    frames.append([child, _items(child), 1, 0, path])
                    continue
                frame[2] += known[0]
                frame[3] += known[1]
            else:
                frame[2] += 1
                frame[3] += len(child) if isinstance(child, str) else 0
        if frame[2] > MAX_CONFIG_VALUES:
            raise refuse(
                frame[4],
                f"holds more than {MAX_CONFIG_VALUES} values once its YAML aliases are "
                "expanded (each use of an alias counts)",
            )
        if frame[3] > MAX_CONFIG_CHARS:
            raise refuse(
                frame[4],
                f"holds more than {MAX_CONFIG_CHARS} characters of text once its YAML "
                "aliases are expanded (each use of an alias counts)",
            )
    raise AssertionError("unreachable: the root frame returns")


def _items(container: dict[Any, Any] | list[Any] | tuple[Any, ...]) -> Any:
    """(label, child, characters of its key or None) for each entry of a list or mapping."""
    if isinstance(container, dict):
        return ((str(k), v, len(k) if isinstance(k, str) else 0) for k, v in container.items())
    return ((f"[{i}]", v, None) for i, v in enumerate(container))


_SafeLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser when PyYAML has it: 4-5x faster than the pure-Python one on a large
config, and it refuses nesting past 1000 levels instead of recursing."""


class _StrictLoader(_SafeLoader):  # type: ignore[misc]  # yaml has no type hints here
    """SafeLoader that rejects a key defined twice in one mapping, as llama-swap's YAML does.

    PyYAML silently keeps the last one, which would hide a duplicated model id. Keys that
    arrive through a ``<<:`` merge may be overridden, so only explicit keys are compared.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            ident = (key_node.tag, key_node.value)
            if ident in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key_node.value!r} is defined twice (first on line {seen[ident]})",
                    key_node.start_mark,
                )
            seen[ident] = key_node.start_mark.line + 1
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping
