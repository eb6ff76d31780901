"""Give a model built on the ``meta`` device storage for this rank's shard only, with the
initial values of the one-process model.

A model is built on ``meta`` (no memory), parallelised there (tensor parallel slices,
expert sharding, FSDP2 sharding all work on meta tensors), and only then materialised:
``to_empty`` allocates each parameter's *local* piece, and each piece is filled with its box
of the parameter's name-seeded initial value (``models/llama.py: fill_initial_``), which is
generated in fixed tiles keyed by name and tile index: only the tiles the piece overlaps are
generated. Peak host memory is therefore this rank's share of the model plus one 4 MiB tile,
and the values are identical to the one-process initialisation whatever the layout.

The box of a DTensor's local piece is found from its placements: ``Shard(d)`` takes this mesh
coordinate's ``torch.chunk`` along d, in mesh order; a ``_StridedShard`` (FSDP2 sharding a
dimension tensor/expert parallel already split) means the right-hand shardings were applied
first (in mesh order among themselves), so it is applied last. The box's size is checked
against the local tensor's.

A large model (over ``PROGRESS_ABOVE_PARAMS`` parameters) takes minutes to fill on a CPU, so
rank 0 says how far it is on stderr, every tenth of the parameters; small runs stay quiet.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._guards import detect_fake_mode
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshfold.models.config import ModelConfig
from meshfold.models.llama import fill_initial_, init_buffers


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


def local_box(shape: tuple[int, ...], dt: DTensor,
              coords: list[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offset, size) of this rank's piece (or, given mesh ``coords``, that rank's) of a tensor
    of global ``shape`` under ``dt``'s mesh and placements: each ``Shard(d)`` takes the mesh
    coordinate's ``torch.chunk`` range along d."""
    mesh, placements = dt.device_mesh, dt.placements
    coords = mesh.get_coordinate() if coords is None else coords
    strided = [isinstance(pl, _StridedShard) for pl in placements]
    # The right-hand (non-strided) shardings first, in mesh order (e.g. experts Shard(0) on
    # ep, then again on tp), then the strided FSDP one.
    order = [i for i, s in enumerate(strided) if not s] + [i for i, s in enumerate(strided) if s]
    lo, hi = [0] * len(shape), list(shape)
    for i in order:
        pl = placements[i]
        if isinstance(pl, (Shard, _StridedShard)):
            d, n = pl.dim, hi[pl.dim] - lo[pl.dim]
            step = -(-n // mesh.size(i)) if n else 0
            start = lo[d] + min(coords[i] * step, n)
            lo[d], hi[d] = start, lo[d] + min((coords[i] + 1) * step, n)
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


def own_strided(dt: DTensor) -> tuple[int | None, int, int]:
    """(mesh dim, split factor, tensor dim) of a ``_StridedShard`` on a tensor dimension no
    ``Shard`` splits (expert tp's w13, ``parallel/ep/expert_tp.py``: a rank's rows are ``sf``
    separate pieces), else (None, 1, 0). FSDP2's own ``_StridedShard`` sits on a dimension a
    ``Shard`` also splits."""
    plain = {pl.dim for pl in dt.placements if isinstance(pl, Shard) and not isinstance(pl, _StridedShard)}
    for i, pl in enumerate(dt.placements):
        if isinstance(pl, _StridedShard) and pl.dim not in plain:
            return i, pl.split_factor, pl.dim
    return None, 1, 0


def local_pieces(shape: tuple[int, ...], dt: DTensor) -> list[tuple[torch.Tensor, tuple, tuple]]:
    """This rank's local tensor as (view, global offset, box size) pieces: one
    (``local_box``), or, with a strided placement of its own (``own_strided``), ``sf`` views
    along its dimension d, piece j being this rank's chunk of the j-th of ``sf`` equal parts
    of the global dimension."""
    local = dt.to_local()
    i, sf, d = own_strided(dt)
    if i is None:
        return [(local, *local_box(shape, dt))]
    part = list(shape)
    part[d] //= sf
    placements = [Shard(d) if k == i else pl for k, pl in enumerate(dt.placements)]
    plain = DTensor.from_local(local, dt.device_mesh, placements, run_check=False, shape=torch.Size(part),
                               stride=torch.empty(part, device="meta").stride())
    offset, size = local_box(tuple(part), plain)
    return [(view, tuple(o + j * part[d] if k == d else o for k, o in enumerate(offset)), size)
            for j, view in enumerate(local.chunk(sf, dim=d))]


PROGRESS_ABOVE_PARAMS = 1_000_000_000


class _Progress:
    """Rank 0's ``materialising N B parameters: k0 %`` lines on stderr, one per tenth of
    the model's (global) parameters filled, for models over ``above`` parameters."""

    def __init__(self, model: nn.Module, above: int):
        self.total = sum(p.numel() for p in model.parameters())  # global shapes, DTensor or not
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        self.on = rank0 and self.total > above
        self.done, self.next_tenth, self.start = 0, 1, time.monotonic()

    def add(self, numel: int) -> None:
        if not self.on:
            return
        self.done += numel
        tenth = self.done * 10 // self.total
        if tenth >= self.next_tenth:
            self.next_tenth = tenth + 1
            print(f"meshfold: materialising {self.total / 1e9:.2f} B parameters: {tenth * 10} % "
                  f"({time.monotonic() - self.start:.0f} s)", file=sys.stderr, flush=True)


@torch.no_grad()
def materialize(model: nn.Module, cfg: ModelConfig, seed: int, device: torch.device,
                progress_above: int = PROGRESS_ABOVE_PARAMS) -> nn.Module:
    """Allocate this rank's pieces on ``device`` and fill them with the initial values,
    generating only the tiles of each parameter that the piece overlaps
    (``models/llama.py: fill_initial_``). Rank 0 reports progress on stderr when the model
    has more than ``progress_above`` parameters."""
    model.to_empty(device=device)
    progress = _Progress(model, progress_above)
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        pieces = local_pieces(shape, p) if isinstance(p, DTensor) else [(p, (0,) * len(shape), shape)]
        for local, offset, size in pieces:
            if size != tuple(local.shape):
                raise RuntimeError(f"materialize: {name}: local piece {size} for placements "
                                   f"{p.placements} does not match the shard {tuple(local.shape)}")
            # Tiles are generated on the host (one RNG every device agrees on) and copied in.
            fill_initial_(local, name, shape, offset, cfg, seed)
        progress.add(p.numel())
    init_buffers(model, cfg)
    return model
