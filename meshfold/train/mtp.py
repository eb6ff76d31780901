"""Multi-token prediction's part of a step (``model.mtp_depth``), as a feature
(``train/feature.py``): the depths' loss around the token-loss sum (``parallel/loss.py::
MTPLoss``), the shifted token ids the depths embed as a forward input, and the ``mtp_loss``
metric."""

from __future__ import annotations

import torch

from meshfold import comm
from meshfold.parallel.loss import MTPLoss


class MultiTokenPrediction:
    """``wrap_loss``, ``forward_inputs``, ``before_step`` and ``device_metrics``."""

    name = None

    def __init__(self, depth: int, weight: float, dims, device: torch.device):
        self.depth, self.weight, self.dims, self.device = depth, weight, dims, device
        self.loss: MTPLoss | None = None

    def wrap_loss(self, loss_fn):
        self.loss = MTPLoss(loss_fn, self.depth, self.weight)
        return self.loss

    def forward_inputs(self, mb: dict) -> dict:
        return {"ids": mb["inputs"]}  # the depths embed the shifted tokens

    def before_step(self) -> None:
        self.loss.pop()  # a step redone (live recovery) counts its own depths' losses only

    def _sum(self, value: torch.Tensor, dim: str) -> torch.Tensor:
        if self.dims.distributed and self.dims.size(dim) > 1:
            comm.all_reduce(value, self.dims.group(dim), None)  # control scalars: not counted as traffic
        return value

    def device_metrics(self, global_tokens: torch.Tensor) -> dict:
        """``mtp_loss``: the mean over depths of their token losses, normalised like the main
        loss, unweighted, on the device. Its sum lives where the last stage ran: summed over
        dp/cp and pp."""
        mine = self.loss.pop()
        mine = (torch.zeros((), dtype=torch.float64, device=self.device) if mine is None
                else mine.detach().double().clone())
        total = self._sum(self._sum(mine, "dp_cp"), "pp")
        return {"mtp_loss": total / global_tokens.double().clamp(min=1) / self.depth}


def build_mtp(cfg, parts) -> MultiTokenPrediction | None:
    """The feature of a model with multi-token prediction (registered in ``train/registry.py``)."""
    m = cfg.model
    return MultiTokenPrediction(m.mtp_depth, m.mtp_loss_weight, parts.dims, parts.device) if m.mtp_depth else None
