"""Turning a module tensor-parallel in place: its parameters become DTensors on the tp mesh,
sliced locally from the full value every rank holds (``distribute``: no communication), and
its class the tp subclass (``swap_class``); with the plans of the parts every block and
extra head shares (norms, the dense feed-forward), which expert parallel uses too."""

from __future__ import annotations

import math

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshfold.models.llama import FeedForward, RMSNorm
from meshfold.parallel.tp.collectives import TensorParallelGroup
from meshfold.parallel.tp.layers import TensorParallelFeedForward, TensorParallelLayerNorm, TensorParallelRMSNorm


def shard_range(size: int, n: int, rank: int) -> tuple[int, int]:
    """Rows of dimension ``size`` that rank holds under DTensor's ``Shard`` (torch.chunk
    sizes: ceil(size/n) each, the last ranks shorter or empty)."""
    chunk = math.ceil(size / n)
    return min(rank * chunk, size), min((rank + 1) * chunk, size)


def distribute(module: nn.Module, name: str, tp: TensorParallelGroup, placement) -> None:
    """Replace ``module.<name>`` by a DTensor parameter on the tp mesh, sliced locally from
    the (identical on every rank) full value: no communication."""
    param = getattr(module, name)
    if param is None:
        return
    full = param.detach()
    if isinstance(placement, Shard):
        start, stop = shard_range(full.shape[placement.dim], tp.size, tp.rank)
        piece = full.narrow(placement.dim, start, stop - start).clone()
    else:
        piece = full.clone()
    dt = DTensor.from_local(piece, tp.mesh, [placement], run_check=False, shape=full.shape, stride=full.stride())
    setattr(module, name, nn.Parameter(dt, requires_grad=param.requires_grad))


def swap_class(module: nn.Module, cls: type, **attrs) -> None:
    """Turn ``module`` into its tensor-parallel subclass in place (names, children and
    hooks stay), as FSDP2 does for its wrapper classes."""
    module.__class__ = cls
    for key, value in attrs.items():
        setattr(module, key, value)


def parallelize_norm(norm: nn.Module | None, tp: TensorParallelGroup) -> None:
    if norm is None:
        return
    cls = TensorParallelRMSNorm if isinstance(norm, RMSNorm) else TensorParallelLayerNorm
    if not isinstance(norm, (RMSNorm, nn.LayerNorm)):
        raise TypeError(f"tensor parallel: unsupported norm {type(norm).__name__}")
    for name in ("weight", "bias"):
        if getattr(norm, name, None) is not None:
            distribute(norm, name, tp, Replicate())
    swap_class(norm, cls, tp=tp)


def parallelize_ffn(ffn: FeedForward, tp: TensorParallelGroup) -> None:
    for lin in (ffn.w1, ffn.w3):
        if lin is not None:
            distribute(lin, "weight", tp, Shard(0))
            distribute(lin, "bias", tp, Shard(0))
    distribute(ffn.w2, "weight", tp, Shard(1))
    distribute(ffn.w2, "bias", tp, Replicate())
    swap_class(ffn, TensorParallelFeedForward, tp=tp)
