"""Expert tensor parallel (``parallel.expert_tp = tp``; Megatron-Core's
``expert_tensor_parallel_size``): each routed expert's FFN split over the tp group instead
of whole experts split over ep x tp (``parallel/facts/expert_tp.py`` has the two foldings).

A rank keeps the E/ep experts of its ep rank, each a 1/tp slice: the first GEMM's weight by
columns (w13: the rank's rows of w1 and of w3, so its SwiGLU runs on its own hidden units),
the second's by rows (w2 [E, dim, hidden] split on hidden). The tokens are the same on
every tp rank (entered with ``tokens_in``: f, or gathered under sp); every tp rank dispatches
all their assignments over its ep group, its experts produce partial sums of the outputs,
and these are summed over tp after the combine (``tokens_out``: all-reduce, or
reduce-scatter under sp), as a row-parallel linear's.

The weights are DTensors on the (ep, tp) mesh (tp alone when ep = 1): ``Shard(0)`` over ep;
over tp ``Shard(2)`` for w2 and, for w13, ``_StridedShard(1, split_factor=2)``: the rank's
rows are two pieces of the global [w1; w3], which DTensor redistributes correctly
(``full_tensor``) but DCP cannot write as one box (``checkpoint_view``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshfold.models.moe import MoE
from meshfold.parallel.materialize import own_strided
from meshfold.parallel.tp.collectives import TensorParallelGroup

# the stacked weights [E, out, in] split by columns (out: dim 1) and by rows (in: dim 2)
_COLUMNS = ("w13", "w1")
_ROWS = ("w2",)


def _tp_slice(name: str, w: torch.Tensor, tp: int, rank: int) -> tuple[torch.Tensor, object]:
    """This tp rank's slice of one stacked expert weight and its tp placement."""
    if name == "w13":  # [w1; w3]: the rank's rows of each half, so SwiGLU pairs its own units
        halves = [h.chunk(tp, dim=1)[rank] for h in w.chunk(2, dim=1)]
        return torch.cat(halves, dim=1), _StridedShard(1, split_factor=2)
    dim = 1 if name in _COLUMNS else 2
    return w.chunk(tp, dim=dim)[rank], Shard(dim)


def shard_experts_inside(moe: MoE, ep_mesh: DeviceMesh | None, tp: TensorParallelGroup) -> None:
    """Replace the stacked expert weights by this rank's piece: its ep rank's experts (when
    ``ep_mesh``) and, of each, this tp rank's slice."""
    mesh = tp.mesh if ep_mesh is None else DeviceMesh._concatenate([ep_mesh, tp.mesh])
    for name, p in list(moe.experts.named_parameters(recurse=False)):
        if name not in _COLUMNS + _ROWS:
            raise ValueError(f"expert tensor parallel has no split for experts.{name}")  # (biases: refused)
        w = p.detach()
        placements = []
        if ep_mesh is not None:
            w = w.chunk(ep_mesh.size(), dim=0)[ep_mesh.get_local_rank()]
            placements.append(Shard(0))
        local, placement = _tp_slice(name, w, tp.size, tp.rank)
        dt = DTensor.from_local(local.clone(), mesh, placements + [placement], run_check=False, shape=p.shape,
                                stride=p.stride())
        setattr(moe.experts, name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _strided(t) -> bool:
    """A DTensor whose rows on some rank are separate pieces (FSDP2's own ``_StridedShard``,
    on a dimension a ``Shard`` splits too, is one box: DCP writes it)."""
    return isinstance(t, DTensor) and own_strided(t)[0] is not None


def checkpoint_view(tree):
    """``tree`` (a state dict, nested) with every DTensor whose rows are strided pieces
    (``_StridedShard``, which DCP cannot write as one box) replaced by one replicated over
    that mesh dimension: each tp rank then holds the whole experts of its ep rank, which DCP
    writes once and reads into any layout. Everything else is returned as it is."""
    if isinstance(tree, dict):
        return {k: checkpoint_view(v) for k, v in tree.items()}
    if _strided(tree):
        i = own_strided(tree)[0]
        replicated = [Replicate() if k == i else pl for k, pl in enumerate(tree.placements)]
        return tree.redistribute(tree.device_mesh, replicated)
    return tree


def restore_placements(loaded, original):
    """``loaded`` (read into ``checkpoint_view(original)``) with the strided DTensors back in
    ``original``'s placements (a local slice of the replicated tensor, no communication)."""
    if isinstance(original, dict) and isinstance(loaded, dict):
        return {k: restore_placements(v, original[k]) if k in original else v for k, v in loaded.items()}
    if _strided(original) and isinstance(loaded, DTensor):
        return loaded.redistribute(original.device_mesh, original.placements)
    return loaded
