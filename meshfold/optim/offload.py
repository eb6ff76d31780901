"""Optimizer-state offload (ZeRO-Offload style): fp32 masters and Adam state in host
memory, updated there each step."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from meshfold.optim.state import FlattenedState


class HostOffloadAdamW(FlattenedState, torch.optim.AdamW):
    """Optimizer-state offload (ZeRO-Offload style): fp32 master copies of this rank's
    parameters (or their local shards) and all Adam state live in host memory; each step
    copies gradients to the host, updates there, and copies the new values back. Device
    memory then holds only the (possibly low-precision) parameters and gradients."""

    def __init__(self, groups: list[dict], **adam_kwargs):
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        host_groups = []
        for group in groups:
            masters = []
            for p in group["params"]:
                local = p.to_local() if isinstance(p, DTensor) else p
                master = local.detach().to("cpu", torch.promote_types(local.dtype, torch.float32), copy=True)
                master.requires_grad_(True)
                self._pairs.append((p, master))
                masters.append(master)
            host_groups.append({**group, "params": masters})
        super().__init__(host_groups, **adam_kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        for p, master in self._pairs:
            if p.grad is None:
                master.grad = None
                continue
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            master.grad = grad.to("cpu", master.dtype, copy=True)
        out = super().step(closure)
        for p, master in self._pairs:
            local = p.to_local() if isinstance(p, DTensor) else p
            local.copy_(master.to(local.device, local.dtype))
        return out

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        for p, _ in self._pairs:
            p.grad = None
