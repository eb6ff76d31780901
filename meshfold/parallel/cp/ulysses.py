"""Ulysses (DeepSpeed-Ulysses): the all-to-all that turns sequence-sharded q/k/v into
head-sharded whole sequences and back; recorded under ``"cp"``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshfold.comm import all_to_all_single


class _AllToAll(torch.autograd.Function):
    """Split ``scatter_dim`` over the group, concatenate what arrives along ``gather_dim``.
    The backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.args = (scatter_dim, gather_dim, group)
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim, group = ctx.args
        return _all_to_all(grad, gather_dim, scatter_dim, group), None, None, None


def _all_to_all(x, scatter_dim, gather_dim, group):
    n = dist.get_world_size(group)
    send = torch.stack(x.chunk(n, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    all_to_all_single(recv, send, group, "cp")
    return torch.cat(recv.unbind(0), dim=gather_dim)
