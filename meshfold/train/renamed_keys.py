"""Checkpoints written before a parameter was joined from others still load, in any layout.

Each entry names a tensor by the end of its key and the older tensors it is made of, laid
end to end along one dimension. A checkpoint that lacks the new key but has the old ones
is read straight from the old tensors into views of this rank's pieces of the new one
(model weights and their optimizer state alike: plain tensors, DTensor shards, ZeRO-1
boxes), so nothing is gathered, nothing is copied twice, and no trained step is lost.
Optimizer entries that are not per-element (the step count, param-group settings) come
from the first old tensor's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from meshfold.parallel.materialize import local_box
from meshfold.optim.zero_state import Chunks

# new key suffix -> (old key suffixes in order, the dimension they are joined along)
JOINED: dict[str, tuple[tuple[str, ...], int]] = {
    # MoE experts: w1 and w3 [E, F, D] became one w13 [E, 2F, D] (transformers' gate_up_proj), 2026-11-26
    ".experts.w13": ((".experts.w1", ".experts.w3"), 1),
}


def old_keys(key: str, saved: dict[str, Any]) -> tuple[list[str], int] | None:
    """The keys ``key`` was made of, and their joining dimension, if ``saved`` (a
    checkpoint's metadata) lacks ``key`` and has every one of them; else None."""
    if key in saved:
        return None
    for new, (olds, dim) in JOINED.items():
        head, sep, tail = key.rpartition(new)
        if sep and (not tail or tail.startswith(".")):
            keys = [head + old + tail for old in olds]
            if all(k in saved for k in keys):
                return keys, dim
    return None


def joinable(saved: dict[str, Any]) -> set[str]:
    """The new keys ``saved`` holds under their old names only."""
    out = set()
    for new, (olds, _) in JOINED.items():
        for key in saved:
            head, sep, tail = key.rpartition(olds[0])
            if sep and (not tail or tail.startswith(".")) and old_keys(head + new + tail, saved):
                out.add(head + new + tail)
    return out


def joined_shape(keys: list[str], dim: int, saved: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape the old tensors ``keys`` make when joined along ``dim``; None if they
    are not tensors of one rank that agree off ``dim``."""
    metas = [saved[k] for k in keys]
    if not all(isinstance(m, TensorStorageMetadata) for m in metas):
        return None
    shapes = [tuple(m.size) for m in metas]
    if len({len(s) for s in shapes}) != 1 or not 0 <= dim < len(shapes[0]):
        return None
    if len({s[:dim] + s[dim + 1:] for s in shapes}) != 1:
        return None
    return shapes[0][:dim] + (sum(s[dim] for s in shapes),) + shapes[0][dim + 1:]


def _pieces(value: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(global offset, view) of each piece of ``value`` this rank holds."""
    if isinstance(value, Chunks):
        return list(value.chunks)
    if isinstance(value, DTensor):
        offset, _ = local_box(tuple(value.shape), value)
        return [(offset, value.to_local())]
    return [((0,) * value.ndim, value)]


def _split(value: torch.Tensor, sizes: list[int], dim: int) -> list[Chunks | None]:
    """``value``'s pieces cut at the old tensors' boundaries along ``dim``: for each old
    tensor, a ``Chunks`` of views into ``value``'s storage (None where this rank holds none
    of it)."""
    out, lo = [], 0
    for size in sizes:
        hi, chunks = lo + size, []
        for offset, view in _pieces(value):
            a, b = max(offset[dim], lo), min(offset[dim] + view.shape[dim], hi)
            if a < b and view.numel():
                at = offset[:dim] + (a - lo,) + offset[dim + 1:]
                chunks.append((at, view.narrow(dim, a - offset[dim], b - a)))
        shape = tuple(value.shape[:dim]) + (size,) + tuple(value.shape[dim + 1:])
        out.append(Chunks(shape, chunks) if chunks else None)
        lo = hi
    return out


def read_old_names(sd: dict[str, Any], saved: dict[str, Any]) -> Callable[[], None]:
    """Rewrite ``sd`` (what ``dcp.load`` is about to fill; its "model" and "optim" parts) so
    that keys ``saved`` has only under their old names are read from those. Returns the
    function that puts the new keys back once loaded."""
    undo = []
    for top in ("model", "optim"):
        part = sd.get(top)
        if not isinstance(part, dict):
            continue
        for key, value in list(part.items()):
            found = old_keys(f"{top}.{key}", saved)
            if found is None:
                continue
            olds, dim = [k[len(top) + 1:] for k in found[0]], found[1]
            del part[key]
            if torch.is_tensor(value) and value.ndim > dim:
                sizes = [saved[k].size[dim] for k in found[0]]
                for old, piece in zip(olds, _split(value, sizes, dim)):
                    if piece is not None:
                        part[old] = piece
                undo.append((part, key, value, olds, False))
            else:  # a step count or a param-group setting: the first old tensor's
                part[olds[0]] = value
                undo.append((part, key, value, olds, True))

    def put_back() -> None:
        for part, key, value, olds, renamed in undo:
            loaded = part.get(olds[0])
            for old in olds:
                part.pop(old, None)
            part[key] = loaded if renamed else value

    return put_back


def join_whole(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole tensors by name (one process, e.g. ``convert export``), those saved under
    old names joined into the new ones."""
    for key in joinable(tensors):
        olds, dim = old_keys(key, tensors)
        tensors[key] = torch.cat([tensors.pop(k) for k in olds], dim=dim)
    return tensors
