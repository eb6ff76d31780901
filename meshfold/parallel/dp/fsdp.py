"""Data parallel with sharded states (zero 2/3): FSDP2 ``fully_shard`` on each block's unit
and on the root, its all-gathers and reduce-scatters issued through the communication
layer (counted under ``"dp"``), stacked expert weights sharded on the dimension that pads
least, and the mixed-precision / offload policies from ``[train]``. What each zero level
means is in ``parallel/dp/plan.py``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor, Shard

from meshfold import comm
from meshfold.comm import ledger
from meshfold.device import resolved_dtype_name
from meshfold.mesh import ParallelDims
from meshfold.models.moe_experts import GroupedExperts
from meshfold.parallel.facts.sizes import expert_shard_dim


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The submodules FSDP wraps one by one: each of the model's blocks (``blocks()``) with
    what surrounds it in the model's containers, so an extra head's block is wrapped with
    its projections and norms (gathered and freed together); a trunk layer is its own unit."""
    owner = {}  # id(module) -> the entry of one of the model's ModuleDicts that holds it
    for child in model.children():
        if isinstance(child, nn.ModuleDict):
            for entry in child.values():
                owner.update((id(m), entry) for m in entry.modules())
    units = [owner.get(id(block), block) for block in model.blocks()]
    return list({id(u): u for u in units}.values())


def apply_fsdp(model: nn.Module, dims: ParallelDims, reshard_after_forward: bool,
               mp_policy: MixedPrecisionPolicy | None = None, offload_policy=None) -> nn.Module:
    kwargs = {"mesh": dims.fsdp_mesh(), "mp_policy": mp_policy or MixedPrecisionPolicy()}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for block in shard_units(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=_expert_placement(block, dims.fsdp_mesh().size()), **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    _count_fsdp_bytes(model, dims, reshard_after_forward)
    return model


def _expert_placement(block: nn.Module, n: int):
    """FSDP2's ``shard_placement_fn`` for a block: the stacked expert weights [E_l, out, in]
    of an MoE block that keeps its experts (no expert parallel) sharded on the dimension
    ``expert_shard_dim`` picks, which pads least (dim 0 pads when E_l < n: every rank would
    hold a whole expert, n / E_l times its share); everything else FSDP2's default."""
    experts = {id(p) for m in block.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    if not experts:
        return None

    def placement(p: nn.Parameter) -> Shard | None:
        if id(p) not in experts:
            return None
        local = p.to_local() if isinstance(p, DTensor) else p
        return Shard(expert_shard_dim(tuple(local.shape), n))

    return placement


class _CountedAllGather(DefaultAllGather):
    """FSDP2's own all-gather, issued through the communication layer (which checks the
    tensors and records the bytes): what is counted is what FSDP2 actually sends."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return comm.all_gather_into_tensor(output_tensor, input_tensor, group, "dp", async_op=async_op)


class _CountedReduceScatter(DefaultReduceScatter):
    """FSDP2's reduce-scatter (its op may be a pre-multiplied sum, which the communication
    layer's string ops do not name): checked and recorded there, issued as FSDP2 would."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        comm.check_tensors([output_tensor, input_tensor], group, "reduce_scatter")
        ledger().record("dp", "reduce_scatter", input_tensor.numel() * input_tensor.element_size(),
                        dist.get_world_size(group))
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def _count_fsdp_bytes(root: nn.Module, dims: ParallelDims, reshard_after_forward: bool = True) -> None:
    """Route every FSDP2 module's all-gathers and reduce-scatters through the communication
    layer, and record the HSDP all-reduce of the reduced shard (FSDP2 calls the hook on its
    output), so ``comm_bytes["dp"]`` is measured, micro-batch accumulation included."""
    for m in root.modules():
        if not isinstance(m, FSDPModule):
            continue
        _, n_rep = getattr(m, "fsdp_group_sizes", (dims.size("dp_shard_cp"), dims.size("dp_replicate")))
        m.set_custom_all_gather(_CountedAllGather())
        m.set_custom_reduce_scatter(_CountedReduceScatter())
        if n_rep > 1:
            m.set_all_reduce_hook(
                lambda out, n=n_rep: ledger().record("dp", "all_reduce", out.numel() * out.element_size(), n))


def fsdp_policies(train, device_type: str = "cpu") -> tuple[MixedPrecisionPolicy, object | None]:
    """FSDP2 mixed precision and offload from ``[train]``: when the resolved compute dtype
    is bf16 (``dtype = bfloat16``, or ``auto`` on ``device_type`` cuda) the
    all-gathered compute copies are bf16 while the sharded fp32 master weights stay in
    fp32 and gradients are reduced in ``train.reduce_dtype``; ``offload = params`` moves
    parameters, gradients and optimizer state to host memory (the step runs there)."""
    mp = MixedPrecisionPolicy()
    if train is not None and resolved_dtype_name(train.dtype, device_type) == "bfloat16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                  reduce_dtype=torch.float32 if train.reduce_dtype == "float32" else torch.bfloat16)
    offload = None
    if train is not None and train.offload == "params":
        from torch.distributed.fsdp import CPUOffloadPolicy

        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return mp, offload
