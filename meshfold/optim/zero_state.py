"""ZeRO-1 Adam state under tensor/pipeline parallel (``ShardedAdamW``) as checkpoint
chunks: a rank owns a flat segment of its local parameter pieces laid end to end, which
cuts each piece into rectangular boxes (``flat_boxes``); placed at the piece's global
offset they are what the rank writes, and what it reads back from a checkpoint of any
layout (``Chunks``, DCP's checkpointable protocol). Nothing is gathered or copied."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshfold.parallel.materialize import local_box, local_pieces, own_strided

if TYPE_CHECKING:  # annotations only: the optimizer imports this module
    from meshfold.optim.sharded import ShardedAdamW


def flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple, tuple, int, int]]:
    """The flat elements [a, b) of a row-major tensor of ``shape`` as rectangular boxes
    ``(offsets, sizes, start, stop)``, in order, each box the contiguous flat range
    [start, stop): a partial first row, whole rows, a partial last row, and the same
    recursively inside a partial row (at most 2 per dimension less one)."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a,), (b - a,), a, b)] if shape else [((), (), a, b)]
    inner = math.prod(shape[1:])
    (i0, r0), (i1, r1) = divmod(a, inner), divmod(b, inner)

    def row(i: int, lo: int, hi: int) -> list:
        return [((i, *o), (1, *z), i * inner + x, i * inner + y) for o, z, x, y in flat_boxes(shape[1:], lo, hi)]

    if i0 == i1:
        return row(i0, r0, r1)
    out = []
    if r0:
        out += row(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0,) + (0,) * (len(shape) - 1), (i1 - i0, *shape[1:]), i0 * inner, i1 * inner))
    if r1:
        out += row(i1, 0, r1)
    return out


def strided_boxes(p: DTensor, a: int, b: int) -> list[tuple[tuple, tuple, int, int]]:
    """``flat_boxes`` for a DTensor whose local rows are ``sf`` separate pieces of the global
    tensor along dimension d (expert tp's w13, ``materialize.own_strided``): the local tensor
    is cut into blocks of one index of each dimension before d and one piece, each contiguous
    and placed at its piece's global offset, and the blocks' boxes within [a, b) kept."""
    local = p.to_local()
    _, sf, d = own_strided(p)
    offsets = [off for _, off, _ in local_pieces(tuple(p.shape), p)]
    block = (local.shape[d] // sf,) + tuple(local.shape[d + 1:])
    n, out = math.prod(block), []
    for i, outer in enumerate(torch.cartesian_prod(*[torch.arange(x) for x in (*local.shape[:d], sf)]).view(-1, d + 1)
                              .tolist()):
        base, j = i * n, outer[-1]
        lead = tuple(o + x for o, x in zip(offsets[j][:d], outer[:-1]))
        for off, size, lo, hi in flat_boxes(block, max(a, base) - base, min(b, base + n) - base):
            out.append((lead + tuple(o + x for o, x in zip(offsets[j][d:], off)), (1,) * d + size,
                        base + lo - a, base + hi - a))
    return out


class Chunks(torch.Tensor):
    """A tensor of global ``shape`` of which this rank holds some rectangular chunks,
    ``[(global offsets, tensor)]`` (views into storage it owns: a ZeRO-1 rank's Adam
    state). It speaks DCP's checkpointable protocol, as DTensor does: DCP saves exactly
    these chunks (duplicates across ranks, at the same offsets, once) and, loading, reads
    into them whatever overlaps them in a checkpoint of any layout. Only DCP uses it; any
    tensor operation on it is an error. ``flat``: the 1-D tensor the chunks view, if any."""

    chunks: list[tuple[tuple[int, ...], torch.Tensor]]
    flat: torch.Tensor | None

    @staticmethod
    def __new__(cls, shape, chunks: list[tuple[tuple[int, ...], torch.Tensor]], flat: torch.Tensor | None = None):
        first = chunks[0][1]
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=first.dtype, device=first.device)
        r.chunks, r.flat = chunks, flat
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on checkpoint Chunks (only DCP reads and writes them)")

    def _metadata(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in self.chunks]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.chunks[0][1])
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props, size=self.size()))
                for c in self._metadata()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._metadata()

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, t in self.chunks:
            if torch.Size(offsets) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no chunk at {tuple(index.offset or ())}")


# (flat state view, parameter name, global shape, boxes (global offsets, sizes, start, stop), writes)
Piece = tuple[torch.Tensor, str, torch.Size, list, bool]


def sharded_layout(opt: ShardedAdamW, names: dict[int, str]) -> list[Piece]:
    """For each piece ``opt`` updates on this rank: (its flat view, the parameter's name
    (``names``: id -> name), its global shape, the boxes ``(global offsets, sizes, start,
    stop)`` the piece covers, with [start, stop) its range of the piece's flat state, and
    whether this rank writes them). A parameter replicated over a mesh dimension (a norm
    under tp) is written only by coordinate 0 there: the other coordinates cut the same
    values into their own, possibly different, boxes. Fixed for a run."""
    layout = []
    for view, (p, a, b) in zip(opt._views, opt.pieces):
        local, offset, writes = p, (0,) * p.ndim, True
        if isinstance(p, DTensor) and own_strided(p)[0] is not None:  # (replicated nowhere: every rank writes)
            layout.append((view, names[id(p)], p.shape, strided_boxes(p, a, b), True))
            continue
        if isinstance(p, DTensor):
            if not all(type(pl) in (Shard, Replicate) for pl in p.placements):
                raise ValueError(f"{names[id(p)]} has placements {p.placements}: ZeRO-1 checkpoints take "
                                 f"Shard and Replicate only")
            local = p.to_local()
            offset, shape = local_box(tuple(p.shape), p)  # the box materialize fills, too
            if tuple(shape) != tuple(local.shape):
                raise ValueError(f"{names[id(p)]}: local shape {tuple(local.shape)} is not the "
                                 f"{tuple(shape)} its placements give")
            coord = p.device_mesh.get_coordinate()
            writes = all(c == 0 for c, pl in zip(coord, p.placements) if isinstance(pl, Replicate))
        boxes = [(tuple(o + g for o, g in zip(off, offset)), size, lo - a, hi - a)
                 for off, size, lo, hi in flat_boxes(tuple(local.shape), a, b)]
        layout.append((view, names[id(p)], p.shape, boxes, writes))
    return layout


def chunks_of(shape: torch.Size, boxes: list, flat: torch.Tensor) -> Chunks:
    """The boxes of one piece's flat state ``flat`` as a ``Chunks`` of global ``shape``."""
    return Chunks(shape, [(off, flat[lo:hi].view(size)) for off, size, lo, hi in boxes], flat)
