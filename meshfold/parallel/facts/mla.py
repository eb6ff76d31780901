"""Multi-head latent attention's layout rules (``models/deepseek/mla.py``), torch-free: registered in
``facts/attention.py``'s ``ATTENTION_LAYOUTS`` under ``"mla"``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshfold.errors import ConfigError

if TYPE_CHECKING:  # the configs are handed in; their modules sit above or beside this one
    from meshfold.config import Config
    from meshfold.models.config import ModelConfig


class LatentAttentionLayout:
    """The latent expands into a key and a value per query head, so every query head has
    its own kv head; tp and cp are not composed yet (``parallel/tp/mla.py``,
    ``parallel/cp/mla.py``)."""

    @staticmethod
    def kv_heads(model: ModelConfig) -> int:
        return model.n_heads

    @staticmethod
    def check(cfg: Config) -> None:
        p = cfg.parallel
        if p.tp > 1 and p.cp > 1:
            raise ConfigError("model.mla_kv_rank > 0 (multi-head latent attention) runs under parallel.tp > 1 or "
                              "parallel.cp > 1, not both yet; use one of them (with data, pipeline and expert "
                              "parallel)")
