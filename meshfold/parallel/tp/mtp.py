"""Tensor parallel for multi-token prediction's depths (``models/deepseek/mtp.py``) around their
blocks, registered in ``parallel/tp/plan.py``'s ``EXTRA_HEAD_PLANS``: the depths run
without sp (``facts/mtp.py``), so their inputs are whole on every rank; the block is
planned like the model's (``Transformer.blocks()`` lists it), the norms and ``eh_proj``
replicated."""

from __future__ import annotations

from torch.distributed.tensor import Replicate

from meshfold.models.deepseek.mtp import MTPModule
from meshfold.parallel.tp.collectives import TensorParallelGroup
from meshfold.parallel.tp.layers import ReplicatedLinear
from meshfold.parallel.tp.placement import distribute, parallelize_norm, swap_class


def parallelize_depth(module: MTPModule, tp: TensorParallelGroup) -> None:
    """One depth's norms and its ``eh_proj`` replicated over tp."""
    for norm in (module.enorm, module.hnorm, module.norm):
        parallelize_norm(norm, tp)
    distribute(module.eh_proj, "weight", tp, Replicate())
    swap_class(module.eh_proj, ReplicatedLinear, tp=tp)
