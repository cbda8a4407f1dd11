"""llama-swap's config.yaml, parsed once into frozen dataclasses.

Pure: no Django, no I/O beyond reading the file in :func:`load_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from scheduler.policy import SchedulerSettings


class ConfigError(ValueError):
    """A config problem that stops startup; ``key`` is the key path (e.g. ``models.qwen.cmd``)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class ModelConfig:
    """One entry of ``models:`` with every macro expanded except ``${PID}`` in ``cmd_stop``."""

    id: str
    cmd: tuple[str, ...]
    """argv, split shell-style; no shell is involved."""
    proxy: str
    """Base URL of the model's server, e.g. ``http://127.0.0.1:5800``."""
    cmd_stop: tuple[str, ...] | None = None
    """argv run to stop the model; ``${PID}`` is replaced at stop time."""
    aliases: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    check_endpoint: str | None = "/health"
    """None when the config says ``none``: the model counts as ready once started."""
    ttl: int = 0
    """Seconds idle before the model is unloaded; 0 never."""
    unload_timeout: float = 10
    """Seconds between SIGTERM and SIGKILL."""
    health_check_timeout: float = 120
    use_model_name: str = ""
    name: str = ""
    description: str = ""
    unlisted: bool = False
    concurrency_limit: int = 10
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    strip_params: tuple[str, ...] = ()
    set_params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Config:
    models: Mapping[str, ModelConfig]
    aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """alias -> model id."""
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    health_check_timeout: float = 120
    start_port: int = 5800
    global_ttl: int = 0
    unload_timeout: float = 10
    log_level: str = "info"
    preload: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    """One line per ignored, not yet supported key (peers, groups, ...)."""
    source: str = ""
    """The file it came from."""

    def resolve(self, name: str) -> ModelConfig | None:
        """The model for an id or an alias."""
        model = self.models.get(name)
        if model is None and name in self.aliases:
            model = self.models[self.aliases[name]]
        return model
