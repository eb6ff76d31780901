"""parallelize(): the dimensions applied to a model in a fixed order (see the package doc,
``meshfold/parallel/__init__.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from meshfold.mesh import ParallelDims
from meshfold.parallel.cp.plan import apply_context_parallel
from meshfold.parallel.dp.plan import apply_data_parallel, uses_fsdp
from meshfold.parallel.ep.plan import apply_expert_parallel
from meshfold.parallel.fp8.convert import apply_fp8
from meshfold.parallel.fp8.dispatch import apply_fp8_dispatch
from meshfold.parallel.materialize import is_meta, materialize
from meshfold.parallel.recompute import apply_compile, apply_recompute
from meshfold.parallel.tp.plan import parallelize_tensor

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


def parallelize(model: nn.Module, cfg: Config, dims: ParallelDims, device: torch.device | None = None,
                comm_hook=None) -> nn.Module:
    """``device``: where a meta-built model's local shards are allocated. ``comm_hook``: the
    DDP communication hook's installer of a feature above this layer (``apply_ddp``)."""
    meta = is_meta(model)

    def init(m: nn.Module) -> nn.Module:
        return materialize(m, cfg.model, cfg.train.seed, device or torch.device("cpu")) if meta else m

    apply_fp8(model, cfg.train, device, dims.size("tp"))  # fp8 linears first: tp and FSDP2 shard the converted modules
    if dims.distributed and dims.enabled("tp"):  # rewrites layers, so first of all

        parallelize_tensor(model, dims, cfg)
    if (dims.distributed and dims.enabled("cp")) or cfg.data.skip_masked_blocks:  # swaps Attention.core,
        # so before recompute wraps it

        apply_context_parallel(model, cfg, dims)
    if dims.distributed and cfg.model.moe_experts:  # global balance statistics; ep shards experts

        apply_expert_parallel(model, cfg, dims)
        apply_fp8_dispatch(model, cfg.parallel)  # parallel.ep_fp8_dispatch: the dispatch's rows in fp8
    apply_recompute(model, cfg.train)
    if cfg.train.compile:
        apply_compile(model)
    if not dims.distributed:
        return init(model)
    if uses_fsdp(dims):
        return init(apply_data_parallel(model, dims, train=cfg.train))
    return apply_data_parallel(init(model), dims, comm_hook=comm_hook, train=cfg.train)
