"""Expert parallel, folded onto the data x context ranks (MoE Parallel Folding).

Attention keeps its layout (dp_replicate x dp_shard x cp x tp). For the MoE layers the
data x context ranks of one tp slice (the flattened ``dp_cp`` mesh, size R) are viewed as a
2-D mesh (edp, ep) with ep innermost (``DeviceMesh._unflatten``), so an ep group is ep
neighbouring dp_shard/cp ranks:

* each ep rank holds E/ep experts: the stacked expert weights become DTensors sharded on
  dim 0 over ``ep`` (``Shard(0)``);
* with zero >= 2 FSDP2 shards those local experts again over the remaining ``edp = R/ep``
  ranks (its own ``fully_shard`` group inside the block, with the blocks' mixed precision
  and CPU offload), so expert weights are sharded R ways in all. The local stack [E_l, out,
  in] is sharded on dim 0 when edp divides E_l, else on out or in when edp divides it (no
  padding), else on dim 0 padded (``parallel/facts/sizes.py``, which the planner prices too);
* with zero 0/1 (DeepSeek-V3's layout: ep over ZeRO-1 data parallel) the local experts stay
  whole on every edp rank, marked ``reduce_over = edp mesh``: the data layer averages their
  gradients over edp only (a ``GradReducer`` of their own, ``parallel/dp/replicate.py``) while the
  dense parameters are averaged over dp_cp, and ZeRO-1 shards their Adam state over edp
  (``optim/expert_split.py::ExpertSplitAdamW``);
* tokens go to their experts with an all-to-all of variable split sizes and come back with
  the reverse all-to-all (``AllToAllDispatcher``); each rank runs its experts grouped. Under a
  capacity each expert's slots are padded to capacity: equal splits, no host read;
* with tp > 1 no expert FLOP is done twice, in every composition: with ep = 1 (FSDP2,
  ZeRO-1/DDP-style reducer, or no data parallel) the experts are split over the tp ranks
  (``TensorParallelExpertDispatcher``): each tp rank computes its slice of the experts for
  the (replicated) tokens and the partial outputs are summed over tp; with ep > 1 each ep
  rank's experts are split again over tp (DTensor ``Shard(0)`` on the (ep, tp) mesh) and
  tp rank r dispatches only the assignments of its expert column
  (``AllToAllDispatcher(tp=...)``). With ``parallel.expert_tp = tp`` each expert's FFN is
  split over tp instead (``expert_tp.py``: every tp rank dispatches all assignments, E/ep
  experts 1/tp wide; ep need only divide E). The router weight becomes a replicated tp
  DTensor and the shared experts are split over tp like a dense feed-forward;
* with sequence parallel (``parallel.sp``) each tp rank routes only its 1/tp of the sequence
  (router, top-k, balance statistics); the tokens, their chosen experts and gates are
  all-gathered over tp around the experts and the per-token sums reduce-scattered back
  (``tokens_in`` / ``tokens_out``; Megatron's all-gather dispatcher), so the block's output
  stays sequence-sharded; the router's gradient and the balance statistics are summed
  over tp, and the shared experts run as a sequence-parallel feed-forward.

Gradients: every rank scales its loss by R (see the trainer), and an expert's gradient
collects, through the backward all-to-all, the contributions of all tokens of its ep group;
FSDP (or the edp ``GradReducer``) then averages over the edp replicas: R/edp = ep times too
much. The expert weights'
gradients are therefore scaled by 1/ep where they enter the expert computation
(``GroupedExperts.grad_scale``; exact for power-of-two ep). FSDP2's own
``set_gradient_divide_factor`` is not used: with float64 on a one-rank edp group it divides
twice (torch 2.13).

The load-balancing statistics are made global here too: ``MoE.reduce_stats`` becomes an
all-reduce over ``dp_cp`` (E + 2 float64 per MoE layer and micro-batch, recorded under "dp"),
preceded with sp by the same all-reduce over tp (recorded under "tp").

The package: ``dispatch.py`` (the token exchanges and the dispatchers ``MoE.dispatcher``
takes), ``expert_tp.py`` (experts split inside over tp, and their checkpoint view) and this
module (where the experts go, applied from outside the model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshfold.comm import all_reduce
from meshfold.mesh import ParallelDims
from meshfold.models.moe import MoE, moe_layers
from meshfold.parallel.dp.fsdp import fsdp_policies
from meshfold.parallel.ep.dispatch import AllToAllDispatcher, TensorParallelExpertDispatcher, sequence_capacity
from meshfold.parallel.ep.expert_tp import shard_experts_inside
from meshfold.parallel.facts.expert_tp import inside
from meshfold.parallel.facts.sizes import expert_shard_dim
from meshfold.parallel.tp.collectives import TensorParallelGroup
from meshfold.parallel.tp.placement import distribute, parallelize_ffn, shard_range

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import Config


def replicate_router_and_split_shared(moe: MoE, tp: TensorParallelGroup) -> None:
    """Under tp the router weight is a replicated DTensor on the tp mesh (its input and its
    gradient are the same on every tp rank) and the shared experts are split over tp like
    a dense feed-forward (w1/w3 by columns, w2 by rows), so every parameter of the block is
    a tp DTensor (the optimizer, DDP's reducer and checkpoints see one kind) and the shared
    experts' FLOPs are not repeated on every tp rank."""
    distribute(moe.router, "weight", tp, Replicate())
    distribute(moe.router, "bias", tp, Replicate())
    if moe.shared_experts is not None:
        parallelize_ffn(moe.shared_experts, tp)


def split_experts_over_tp(model: nn.Module, dims: ParallelDims) -> None:
    """Shard every MoE layer's experts over the tp ranks (DTensor ``Shard(0)`` on the tp mesh),
    or with expert tp each expert's FFN (``expert_tp.py``; every rank computes all experts)."""
    tp = TensorParallelGroup.from_dims(dims)
    for _, moe in moe_layers(model):
        if inside(dims.parallel):
            shard_experts_inside(moe, None, tp)
            moe.dispatcher = TensorParallelExpertDispatcher(tp, 0, moe.n_experts)
            continue
        start, stop = shard_range(moe.n_experts, tp.size, tp.rank)
        for name, _ in list(moe.experts.named_parameters(recurse=False)):
            distribute(moe.experts, name, tp, Shard(0))
        moe.dispatcher = TensorParallelExpertDispatcher(tp, start, stop)


def _stats_reducer(group: dist.ProcessGroup | None, tp: TensorParallelGroup | None = None):
    def reduce(stats: torch.Tensor) -> torch.Tensor:
        stats = stats.clone()
        if tp is not None:  # sp: each tp rank routed its own slice of the sequence
            all_reduce(stats, tp.group, "tp")
        if group is not None:
            # Runs over the data x context ranks, so it is data-parallel traffic; "ep" is the all-to-all.
            all_reduce(stats, group, "dp")
        return stats

    return reduce


def _seq_counts_reducer(tp: TensorParallelGroup):
    """Per-sequence expert counts [sequences, E] of the sequence-wise balance loss, summed over
    the tp ranks holding slices of the same sequences (sp); no gradient flows through them."""
    def reduce(counts: torch.Tensor) -> torch.Tensor:
        counts = counts.clone()
        all_reduce(counts, tp.group, "tp")
        return counts

    return reduce


def expert_mesh(dims: ParallelDims):
    """The (edp, ep) view of the dp_cp ranks, ep innermost."""
    ep = dims.parallel.ep
    edp = dims.size("dp_cp") // ep
    return dims["dp_cp"]._unflatten(0, (edp, ep), ("edp", "ep"))


def shard_experts(moe: MoE, ep_mesh, tp: TensorParallelGroup | None = None) -> None:
    """Replace the stacked expert weights by this rank's slice, as DTensors Shard(0) on ep
    (and, with tp > 1, Shard(0) again on tp: the (ep, tp) mesh, ep outer, so rank (j, r)
    holds experts [j E/ep + r E/(ep tp), ...) and E/(ep tp) of them)."""
    mesh, shards, index = ep_mesh, ep_mesh.size(), ep_mesh.get_local_rank()
    if tp is not None and tp.size > 1:
        mesh = DeviceMesh._concatenate([ep_mesh, tp.mesh])
        shards, index = shards * tp.size, index * tp.size + tp.rank
    for name, p in list(moe.experts.named_parameters(recurse=False)):
        local = p.detach().chunk(shards, dim=0)[index].clone()
        dt = DTensor.from_local(local, mesh, [Shard(0)] * mesh.ndim, run_check=False, shape=p.shape,
                                stride=p.stride())
        setattr(moe.experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _expert_placement(edp: int):
    """FSDP2's ``shard_placement_fn`` for a stacked expert weight: ``Shard(d)`` on the
    dimension of its local piece [E_l, out, in] that ``expert_shard_dim`` picks."""
    def placement(p: nn.Parameter) -> Shard:
        local = p.to_local() if isinstance(p, DTensor) else p
        # (not a dimension expert tp splits: its strided w13 rows would be split twice)
        split = {pl.dim for pl in p.placements if isinstance(pl, (Shard, _StridedShard)) and pl.dim > 0} \
            if isinstance(p, DTensor) else ()
        return Shard(expert_shard_dim(tuple(local.shape), edp, tuple(split)))

    return placement


def apply_expert_parallel(model: nn.Module, cfg: Config, dims: ParallelDims) -> nn.Module:
    """Make the balance statistics global and (ep > 1) shard the experts; call before data
    parallel wraps the model."""
    layers = moe_layers(model)
    if not layers or not dims.distributed:
        return model
    tp = TensorParallelGroup.from_dims(dims) if dims.size("tp") > 1 else None
    sp = tp if tp is not None and tp.sp else None
    if dims.size("dp_cp") > 1 or sp is not None:
        reduce = _stats_reducer(dims.group("dp_cp") if dims.size("dp_cp") > 1 else None, sp)
        for _, moe in layers:
            moe.reduce_stats = reduce
    if tp is not None:
        for _, moe in layers:
            replicate_router_and_split_shared(moe, tp)
            if sp is not None:  # each tp rank routes its own tokens: the router's gradient is partial
                moe.router_weight_hook = tp.grad_sum
                moe.seq_shards, moe.reduce_seq_counts = tp.size, _seq_counts_reducer(tp)
                moe.sequence_capacity = sequence_capacity(tp)
    if dims.parallel.ep == 1:
        if tp is not None:
            split_experts_over_tp(model, dims)
        return model

    from torch.distributed.fsdp import fully_shard  # (zero >= 2)

    mesh = expert_mesh(dims)
    ep_mesh, edp_mesh = mesh["ep"], mesh["edp"]
    mp, offload = fsdp_policies(cfg.train, dims.mesh.device_type)
    kwargs = {"offload_policy": offload} if offload is not None else {}  # train.offload = params
    split_inside = tp is not None and inside(dims.parallel)
    dispatcher = AllToAllDispatcher(ep_mesh.get_group(), ep_mesh.get_local_rank(), ep_mesh.size(), tp,
                                    dims.parallel.ep_overlap_chunks, columns=not split_inside)
    for _, moe in layers:
        if split_inside:
            shard_experts_inside(moe, ep_mesh, tp)
        else:
            shard_experts(moe, ep_mesh, tp)
        moe.dispatcher = dispatcher
        moe.experts.grad_scale = 1.0 / ep_mesh.size()
        if dims.parallel.zero < 2:
            # DDP-style data parallel: the experts' gradients are averaged (and, ZeRO-1, their
            # Adam state sharded) over edp only, by the data layer (``parallel/dp/replicate.py``)
            moe.experts.reduce_over = edp_mesh
            continue
        # with the blocks' mixed precision (bf16: bf16 gathers, reduce_dtype reductions)
        # on the dimension that wastes least (facts/sizes.py): E_l < edp pads dim 0
        fully_shard(moe.experts, mesh=edp_mesh, reshard_after_forward=dims.parallel.zero == 3, mp_policy=mp,
                    shard_placement_fn=_expert_placement(edp_mesh.size()), **kwargs)
        moe.experts.fsdp_group_sizes = (edp_mesh.size(), 1)  # for the ledger (parallel/dp/fsdp.py)
    return model
