"""The global gradient norm, correct for any mix of sharded (DTensor) and replicated
gradients over the mesh, and clipping by it; no host reads."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshfold import comm


@torch.no_grad()
def grad_norm(params, extra_group: dist.ProcessGroup | None = None,
              device: torch.device | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients, a 0-dim float64 tensor on ``device`` (the compute
    device; default: the gradients'). Sharded DTensor gradients are summed over the mesh
    dimensions they are sharded on (replicated ones count once); ``extra_group`` adds the
    squares over ranks holding disjoint parameters (pipeline stages). Gradients held on
    the host (``train.offload = params``) have their squared norms moved to ``device``
    before any collective: NCCL groups take device tensors only. No host reads."""
    by_mesh: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            # _StridedShard (FSDP2 over a tp-sharded dim) is not a Shard subclass in torch 2.13.
            sharded = tuple(i for i, pl in enumerate(g.placements) if isinstance(pl, (Shard, _StridedShard)))
            key = (g.device_mesh, sharded) if sharded else (None, ())
            by_mesh[key].append(g.to_local())
        else:
            by_mesh[(None, ())].append(g)
        device = device or g.device
    total = torch.zeros((), dtype=torch.float64, device=device or "cpu")
    for (mesh, sharded), grads in by_mesh.items():
        # Per-tensor norms in the gradients' own dtype (no float64 copies of every gradient),
        # squared and summed in float64, on the compute device.
        sq = torch.stack([n.to(total.device, torch.float64) for n in torch._foreach_norm(grads)]).pow(2).sum()
        for dim in sharded:
            comm.all_reduce(sq, mesh.get_group(dim), None)  # control scalar: not counted
        total += sq
    if extra_group is not None and dist.get_world_size(extra_group) > 1:
        comm.all_reduce(total, extra_group, None)
    return total.sqrt()


def _local_grads_by_place(params) -> dict[tuple, list[torch.Tensor]]:
    out: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        out[(g.device, g.dtype)].append(g)
    return out


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, extra_group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None, uncounted=()) -> torch.Tensor:
    """Scale the gradients so their global norm is at most ``max_norm``: one foreach
    multiply per (device, dtype) by a device scalar (never a host read). ``uncounted``:
    parameters scaled but left out of the norm (a copy of a weight counted elsewhere: the
    embedding on the last pipeline stage under multi-token prediction)."""
    params = [p for p in params if p.grad is not None]
    skip = {id(p) for p in uncounted}
    norm = grad_norm([p for p in params if id(p) not in skip], extra_group, device)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for (dev, dtype), grads in _local_grads_by_place(params).items():
            torch._foreach_mul_(grads, scale.to(dev, dtype))
    return norm
