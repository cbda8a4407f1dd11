"""The config's admission rules (:class:`scheduler.core.admission.Rules`): per model its
``slots``, ``concurrencyLimit`` and ``ttl``, the router's eviction, the queue bounds. The
dispatcher, the simulator's ``--config`` and the what-if page build them here, so both
drivers of the strategies read the config the same way."""

from __future__ import annotations

from collections.abc import Mapping

from scheduler.config import Config, ModelConfig
from scheduler.core.admission import ModelRules, Rules


def model_rules(model: ModelConfig) -> ModelRules:
    return ModelRules(slots=model.slots, concurrency_limit=model.concurrency_limit, ttl=model.ttl)


def rules_of(config: Config, retired: Mapping[str, ModelConfig] | None = None) -> Rules:
    """``config``'s rules; ``retired`` (models a reload removed, still draining) keep theirs."""
    models = {**(retired or {}), **config.models}
    return Rules(
        models={model_id: model_rules(m) for model_id, m in models.items()},
        evict=config.router.evict,
        max_queue_depth=config.bounds.max_queue_depth,
        max_wait=config.bounds.max_wait,
    )
