"""AdamW (plain or ZeRO-1 sharded), warmup + cosine schedule, and a gradient-norm clip that
is correct for any mix of sharded (DTensor) and replicated gradients."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from meshfold import comm
from meshfold.comm import ledger
from meshfold.mesh import ParallelDims

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not norms, biases or router biases)."""
    decay, no_decay = [], []
    for _name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def adamw_kwargs(cfg: TrainConfig, device_type: str) -> dict:
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    choice = cfg.fused_optimizer
    if choice == "auto":
        choice = "fused" if device_type == "cuda" else "foreach"
    if choice == "fused":
        kwargs["fused"] = True
    elif choice == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    return kwargs


class ZeroOneOptimizer(ZeroRedundancyOptimizer):
    """ZeRO-1: gradients are all-reduced by DDP; each rank keeps Adam state only for the
    parameters it owns and broadcasts them after its update. Records that traffic."""

    def __init__(self, groups, group: dist.ProcessGroup, **adam_kwargs):
        super().__init__(groups[0]["params"], optimizer_class=torch.optim.AdamW, process_group=group,
                         weight_decay=groups[0]["weight_decay"], **adam_kwargs)
        for extra in groups[1:]:
            self.add_param_group(extra)
        self._n = dist.get_world_size(group)
        self._bytes = sum(p.numel() * p.element_size() for g in groups for p in g["params"])

    def step(self, closure=None):
        out = super().step(closure)
        ledger().record("dp", "all_gather", self._bytes, self._n)
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class ShardedAdamW(torch.optim.Optimizer):
    """ZeRO-1 for layouts whose parameters are DTensors or pipeline stages: Megatron-LM's
    distributed optimizer. Gradients arrive already averaged (``GradReducer``, once per
    step). This rank's local parameter pieces, laid end to end, form one flat range of
    ``total`` elements cut into n equal segments (element granularity, so no rank holds
    more than ceil(total/n) elements of Adam state however uneven the parameters are);
    rank r keeps Adam state for segment r only, as views into the parameters it covers,
    updates them, and one all-gather of the segments hands every rank the updated values.
    ``param_groups`` still list every parameter, with every key AdamW's groups have (so
    schedulers work, and a checkpoint's param groups load into any layout's optimizer).
    ``pieces``/``_views`` and the inner optimizer's state are what checkpoints save."""

    def __init__(self, groups: list[dict], group: dist.ProcessGroup, **adam_kwargs):
        adamw_defaults = torch.optim.AdamW([torch.empty(0, requires_grad=True)], **adam_kwargs).defaults
        super().__init__(groups, dict(adamw_defaults, weight_decay=0.0))
        self.group = group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = [p for g in self.param_groups for p in g["params"]]
        dtypes = {_local(p).dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO-1 with tensor/pipeline parallel needs one parameter dtype, got {dtypes}")
        self.dtype = dtypes.pop() if dtypes else torch.float32
        self.device = _local(self.params[0]).device if self.params else torch.device("cpu")
        total = sum(_local(p).numel() for p in self.params)
        self.segment = max(1, math.ceil(total / self.n))
        lo, hi = self.rank * self.segment, (self.rank + 1) * self.segment
        # (param, start, stop) of the pieces this rank updates, in flat order.
        self.pieces: list[tuple[torch.Tensor, int, int]] = []
        inner_groups = []
        offset = 0
        for g in self.param_groups:
            views = []
            for p in g["params"]:
                numel = _local(p).numel()
                a, b = max(lo, offset) - offset, min(hi, offset + numel) - offset
                if a < b:
                    self.pieces.append((p, a, b))
                    views.append(_local(p).detach().view(-1)[a:b])
                offset += numel
            if views:
                inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": views})
        self._views = [v for g in inner_groups for v in g["params"]]
        self._inner_of = [i for i, g in enumerate(self.param_groups)
                          if any(self._owns(p) for p in g["params"])]
        self.optim = torch.optim.AdamW(inner_groups, **adam_kwargs) if inner_groups else None

    def _owns(self, p) -> bool:
        return any(q is p for q, _, _ in self.pieces)

    @torch.no_grad()
    def step(self, closure=None):
        if self.optim is not None:
            for inner, outer in zip(self.optim.param_groups, self._inner_of):
                for k, v in self.param_groups[outer].items():
                    if k != "params":
                        inner[k] = v
            for view, (p, a, b) in zip(self._views, self.pieces):
                view.grad = None if p.grad is None else _local(p.grad).reshape(-1)[a:b]
            self.optim.step()
        flat = torch.zeros(self.n * self.segment, dtype=self.dtype, device=self.device)
        mine = flat.narrow(0, self.rank * self.segment, self.segment)
        offset = 0
        for view in self._views:
            mine[offset: offset + view.numel()].copy_(view)
            offset += view.numel()
        comm.all_gather_into_tensor(flat, mine.clone(), self.group, "dp")
        offset = 0
        for p in self.params:
            t = _local(p)
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()
        for view in self._views:
            view.grad = None

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


class HostOffloadAdamW(torch.optim.AdamW):
    """Optimizer-state offload (ZeRO-Offload style): fp32 master copies of this rank's
    parameters (or their local shards) and all Adam state live in host memory; each step
    copies gradients to the host, updates there, and copies the new values back. Device
    memory then holds only the (possibly low-precision) parameters and gradients."""

    def __init__(self, groups: list[dict], **adam_kwargs):
        adam_kwargs.pop("fused", None)
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


def build_optimizer(model: nn.Module, cfg: TrainConfig, dims: ParallelDims, device_type: str = "cpu",
                    zero_one: bool = False, sharded: bool = False) -> torch.optim.Optimizer:
    """``zero_one``: ZeRO-1 over dp_shard_cp; ``sharded`` picks ``ShardedAdamW`` (tensor
    parallel: DTensor parameters, which ZeroRedundancyOptimizer cannot broadcast) over
    ZeroRedundancyOptimizer (plain parameters: DDP, pipeline stages). Both checkpoint
    (meshfold/train/checkpoint.py)."""
    groups = param_groups(model, cfg.weight_decay)
    kwargs = adamw_kwargs(cfg, device_type)
    if zero_one and sharded:
        kwargs.pop("fused", None)
        return ShardedAdamW(groups, dims.group("dp_shard_cp"), **kwargs)
    if zero_one:
        kwargs.pop("fused", None)
        return ZeroOneOptimizer(groups, dims.group("dp_shard_cp"), **kwargs)
    if cfg.offload == "optimizer":
        return HostOffloadAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


def lr_lambda(cfg: TrainConfig):
    warmup = cfg.warmup_steps if cfg.warmup_steps >= 0 else max(1, cfg.steps // 10)
    total = max(cfg.steps, warmup + 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


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
        g = _local(p.grad)
        out[(g.device, g.dtype)].append(g)
    return out


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, extra_group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> torch.Tensor:
    """Scale the gradients so their global norm is at most ``max_norm``: one foreach
    multiply per (device, dtype) by a device scalar (never a host read)."""
    params = [p for p in params if p.grad is not None]
    norm = grad_norm(params, extra_group, device)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for (dev, dtype), grads in _local_grads_by_place(params).items():
            torch._foreach_mul_(grads, scale.to(dev, dtype))
    return norm
