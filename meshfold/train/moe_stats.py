"""MoE routing statistics as a feature (``train/feature.py``): after each optimizer step,
the experts' load, imbalance and dropped tokens for metrics.jsonl and the router-bias
update (``models/moe.py::moe_end_step``)."""

from __future__ import annotations

from meshfold.models.moe import moe_end_step


class MoEStatistics:
    name = None

    def __init__(self):
        self.model = None

    def attach(self, parts) -> None:
        self.model = parts.model

    def after_update(self) -> dict:
        return moe_end_step(self.model)


def build_moe_stats(cfg, parts) -> MoEStatistics:
    """Every run: a model without MoE layers reports nothing (``moe_end_step``)."""
    return MoEStatistics()
