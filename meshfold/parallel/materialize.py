"""Give a model built on the ``meta`` device storage for this rank's shard only, with the
initial values of the one-process model.

A model is built on ``meta`` (no memory), parallelised there (tensor parallel slices,
expert sharding, FSDP2 sharding all work on meta tensors), and only then materialised:
``to_empty`` allocates each parameter's *local* piece, and every parameter is filled from
its full name-seeded initial value (``models/llama.py: init_value``), generated one
parameter at a time and sliced to this rank's piece. Peak host memory is therefore this
rank's share of the model plus one unsharded parameter, and the values are identical to
the one-process initialisation whatever the layout.

The local piece of a DTensor is found from its placements: ``Shard(d)`` takes this mesh
coordinate's ``torch.chunk`` along d, in mesh order; a ``_StridedShard`` (FSDP2 sharding a
dimension tensor/expert parallel already split) means the right-hand shardings were applied
first (in mesh order among themselves), so it is applied last. The result's shape is checked
against the local tensor's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshfold.models.config import ModelConfig
from meshfold.models.llama import init_buffers, init_value


def build_on_meta(make: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    """``make()`` on the meta device, in ``dtype``. Under a FakeTensorMode (``meshfold
    dry-run``) the model is built as fake tensors instead, which need no materialisation
    (fake tensors cannot be swapped by ``to``/``to_empty``, so the dtype is set as the
    default while building)."""
    if detect_fake_mode() is None:
        with torch.device("meta"):
            return make().to(dtype=dtype)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return make()
    finally:
        torch.set_default_dtype(prev)


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def local_piece(full: torch.Tensor, dt: DTensor) -> torch.Tensor:
    """This rank's piece of ``full`` under ``dt``'s mesh and placements."""
    mesh, placements = dt.device_mesh, dt.placements
    coords = mesh.get_coordinate()
    strided = [isinstance(pl, _StridedShard) for pl in placements]
    # The right-hand (non-strided) shardings first, in mesh order (e.g. experts Shard(0) on
    # ep, then again on tp), then the strided FSDP one.
    order = [i for i, s in enumerate(strided) if not s] + [i for i, s in enumerate(strided) if s]
    t = full
    for i in order:
        pl = placements[i]
        if isinstance(pl, (Shard, _StridedShard)):
            chunks = torch.chunk(t, mesh.size(i), dim=pl.dim)
            r = coords[i]
            t = chunks[r] if r < len(chunks) else t.narrow(pl.dim, 0, 0)
    return t


@torch.no_grad()
def materialize(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device) -> nn.Module:
    """Allocate this rank's pieces on ``device`` and fill them with the initial values."""
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        full = init_value(name, p.shape, cfg, seed)
        if isinstance(p, DTensor):
            local = p.to_local()
            piece = local_piece(full, p)
            if piece.shape != local.shape:
                raise RuntimeError(f"materialize: {name}: local piece {tuple(piece.shape)} for placements "
                                   f"{p.placements} does not match the shard {tuple(local.shape)}")
            local.copy_(piece)
        else:
            p.copy_(full)
        del full
    init_buffers(model, cfg)
    return model
