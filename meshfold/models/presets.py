"""Shipped model shapes, looked up by name over the registered families' presets
(``models/<family>/presets.py``). Their counts (exact parameters, FLOPs per token) are
``models/counts.py``'s."""

from __future__ import annotations

import dataclasses

from meshfold.errors import ConfigError, did_you_mean
from meshfold.models import registry
from meshfold.models.config import ModelConfig

PRESETS: dict[str, dict] = registry.presets()


def preset_values(name: str) -> dict:
    if name not in PRESETS:
        raise ConfigError(f"model.preset = {name!r} is not a shipped shape{did_you_mean(name, PRESETS)}; "
                          f"choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name], preset=name)


def preset(name: str, **overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig(**preset_values(name)), **overrides)
