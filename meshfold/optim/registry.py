"""Optimizers by name: ``build_optimizer`` looks the run's kind up in ``OPTIMIZERS``.

A builder takes the model, ``[train]``, the mesh and the layout's choices (``zero_one``:
ZeRO-1 over dp_shard_cp; ``sharded``: DTensor parameters; ``weights``: the step's bf16
compute weights, which a ZeRO-1 optimizer may gather into) and returns an optimizer that
implements ``state.CheckpointState``. A new kind is its module plus one line here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from meshfold.errors import ConfigError
from meshfold.mesh import ParallelDims
from meshfold.optim.adamw import build_adamw
from meshfold.optim.muon.optimizer import build_muon
from meshfold.parallel.compute_weights import ComputeWeights

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import TrainConfig

Builder = Callable[..., torch.optim.Optimizer]

OPTIMIZERS: dict[str, Builder] = {
    "adamw": build_adamw,
    "muon": build_muon,
}

DEFAULT = "adamw"


def build_optimizer(model: nn.Module, cfg: TrainConfig, dims: ParallelDims, device_type: str = "cpu",
                    zero_one: bool = False, sharded: bool = False,
                    weights: ComputeWeights | None = None) -> torch.optim.Optimizer:
    """The optimizer ``train.optimizer`` names (AdamW where the config has no such key)."""
    kind = getattr(cfg, "optimizer", DEFAULT)
    if kind == "auto":
        raise ConfigError("train.optimizer = auto is the planner's to choose: run `meshfold plan CONFIG --cluster C "
                          f"--out PLAN.toml` and train PLAN.toml, or set train.optimizer to one of "
                          f"{', '.join(sorted(OPTIMIZERS))}")
    if kind not in OPTIMIZERS:
        raise ValueError(f"train.optimizer = {kind!r}: not one of {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[kind](model, cfg, dims, device_type, zero_one=zero_one, sharded=sharded, weights=weights)
