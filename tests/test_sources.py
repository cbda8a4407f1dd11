"""--config-dir: fragments merged as llama-swap merges them, each conflict an error naming it."""

from __future__ import annotations

import pytest

from scheduler.config import ConfigError
from scheduler.sources import fingerprint, load_sources


def write(path, text: str):
    path.write_text(text)
    return str(path)


def test_fragments_merge_in_name_order_after_the_config(tmp_path):
    main = write(tmp_path / "config.yaml", "healthCheckTimeout: 30\nmodels:\n  a: {cmd: x --port 1, proxy: 'http://127.0.0.1:1'}\n")
    frags = tmp_path / "conf.d"
    frags.mkdir()
    write(frags / "20-b.yaml", "models:\n  b: {cmd: x --port 2, proxy: 'http://127.0.0.1:2'}\nhooks: {on_startup: {preload: [b]}}\n")
    write(frags / "10-c.yml", "models:\n  c: {cmd: x --port 3, proxy: 'http://127.0.0.1:3'}\nhooks: {on_startup: {preload: [c]}}\n")
    write(frags / "notes.txt", "not yaml: [")
    write(frags / "30-empty.yaml", "")
    config = load_sources(main, str(frags))
    assert list(config.models) == ["a", "c", "b"]
    assert config.health_check_timeout == 30
    assert config.preload == ("c", "b")  # lists are concatenated, in file order


def test_a_directory_alone_is_a_config(tmp_path):
    write(tmp_path / "a.yaml", "models:\n  a: {cmd: x, proxy: 'http://127.0.0.1:1'}\n")
    assert list(load_sources("", str(tmp_path)).models) == ["a"]


@pytest.mark.parametrize(
    ("first", "second", "key", "message"),
    [
        (
            "models:\n  a: {cmd: x, proxy: 'http://127.0.0.1:1'}\n",
            "models:\n  a: {cmd: y, proxy: 'http://127.0.0.1:2'}\n",
            "models.a",
            "defined again in",
        ),
        ("healthCheckTimeout: 30\n", "healthCheckTimeout: 60\n", "healthCheckTimeout", "sets a different value"),
        ("startPort: 5800\n", "startPort: [1]\n", "startPort", "different kind of value"),
        (
            "groups: {g: {members: []}}\n",
            "groups: {g: {members: []}}\n",
            "groups.g",
            "defined again in",
        ),
    ],
)
def test_conflicts_are_errors_naming_the_key_and_the_file(tmp_path, first, second, key, message):
    write(tmp_path / "1.yaml", first)
    second_path = write(tmp_path / "2.yaml", second)
    with pytest.raises(ConfigError) as caught:
        load_sources("", str(tmp_path))
    assert caught.value.key == key
    assert message in str(caught.value) and second_path in str(caught.value)


def test_null_gives_way_and_equal_values_agree(tmp_path):
    write(tmp_path / "1.yaml", "globalTTL:\nstartPort: 6000\nmodels: {a: {cmd: x, proxy: 'http://127.0.0.1:1'}}\n")
    write(tmp_path / "2.yaml", "globalTTL: 60\nstartPort: 6000\n")
    config = load_sources("", str(tmp_path))
    assert config.global_ttl == 60 and config.start_port == 6000


def test_the_config_file_may_not_also_be_a_fragment(tmp_path):
    main = write(tmp_path / "config.yaml", "models: {}\n")
    with pytest.raises(ConfigError, match="also in --config-dir"):
        load_sources(main, str(tmp_path))


def test_an_empty_or_missing_directory_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no \\*.yml"):
        load_sources("", str(tmp_path))
    with pytest.raises(ConfigError, match="cannot read the config directory"):
        load_sources("", str(tmp_path / "missing"))


def test_the_fingerprint_changes_when_a_fragment_appears_changes_or_goes(tmp_path):
    first = write(tmp_path / "a.yaml", "models: {}\n")
    before = fingerprint("", str(tmp_path))
    write(tmp_path / "b.yaml", "models: {}\n")
    added = fingerprint("", str(tmp_path))
    assert added != before
    write(tmp_path / "b.yaml", "models: {}  # edited, longer\n")
    assert fingerprint("", str(tmp_path)) != added
    (tmp_path / "b.yaml").unlink()
    assert fingerprint("", str(tmp_path)) == ((first, *before[0][1:]),)


def test_llamaswap_check_reads_a_config_dir(tmp_path):
    from scheduler.checks import inspect_config

    write(tmp_path / "a.yaml", "models:\n  a: {cmd: x, proxy: 'http://127.0.0.1:1'}\n")
    config, messages = inspect_config("", config_dir=str(tmp_path))
    assert config is not None and list(config.models) == ["a"] and not messages
    write(tmp_path / "b.yaml", "models:\n  a: {cmd: y, proxy: 'http://127.0.0.1:2'}\n")
    config, messages = inspect_config("", config_dir=str(tmp_path))
    assert config is None and "models.a: defined again" in messages[0].msg
