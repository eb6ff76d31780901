"""Activation recomputation and per-block compilation, applied from outside the model.

``train.recompute``:
- ``none``: every activation the backward needs is kept.
- ``selective``: only the core attention (scores, softmax, weighted sum: the part whose
  memory grows with the square of the sequence in Korthikanti et al. 2022) is recomputed
  in backward; the cheap-to-store, expensive-to-recompute matmuls keep their inputs.
- ``full``: each block keeps only its input and recomputes everything inside in backward;
  ``train.recompute_every = k`` applies it to every k-th block only (the rest keep all).

Both patch the module's ``forward`` in place instead of wrapping it, so parameter names,
and therefore checkpoints and the name-seeded initialisation, do not change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshfold.memory import note_checkpoint_inputs

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import TrainConfig


def _checkpoint_forward(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        note_checkpoint_inputs(args)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(model: nn.Module, cfg: TrainConfig) -> None:
    layers = getattr(model, "layers", None)
    if cfg.recompute == "none" or layers is None:
        return
    for i, block in enumerate(layers.values()):
        if cfg.recompute == "selective":
            _checkpoint_forward(block.attention.core)
        elif i % max(1, cfg.recompute_every) == 0:
            _checkpoint_forward(block)


def apply_compile(model: nn.Module) -> None:
    """``torch.compile`` each block in place (names unchanged); identical blocks share one
    compiled graph, so compile time does not grow with depth."""
    layers = getattr(model, "layers", None)
    for block in (layers.values() if layers is not None else []):
        block.compile()
