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
from meshfold.parallel.compute_weights import ComputeWeights
from meshfold.parallel.dp.replicate import expert_data_parallel

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
        # torch's fused AdamW runs on CUDA and on host CPUs (offloaded states included):
        # 18.9M parameters step in 12-14 ms on this CPU against 50-73 ms foreach
        choice = "fused" if device_type in ("cuda", "cpu") else "foreach"
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


def _held(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns a (DTensor) parameter's local storage (``to_local`` may return
    a view of it)."""
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardedAdamW(torch.optim.Optimizer):
    """ZeRO-1 as Megatron-LM's distributed optimizer. Gradients arrive already averaged
    (DDP or ``GradReducer``, once per step). This rank's local parameter pieces, laid end
    to end, form one flat range of ``total`` elements cut into n equal segments (element
    granularity, so no rank holds more than ceil(total/n) elements of Adam state however
    uneven the parameters are); rank r keeps Adam state for segment r only, updates it, and
    one all-gather of the segments hands every rank the updated values.

    fp32 compute (``compute_dtype`` None): the state's parameters are views into the
    parameters, and the all-gather writes the updated fp32 values back into them.

    bf16 compute (``compute_dtype``, ``parallel/compute_weights.py``), as Megatron: the rank
    keeps fp32 master values only for its segment (``master_shard``, which Adam updates);
    the all-gather carries the updated segments in bf16, into one flat buffer whose views
    are the next step's compute weights (``compute_copies``): half the bytes of fp32 on the
    wire, no cast per step. The module's fp32 parameters then hold no values between steps
    (``release``: their storage is freed, 4 B per parameter; shapes, gradients and autograd
    are untouched); ``sync_masters`` gathers the fp32 values into them where they are read
    whole (checkpoint save, ``full_state``; collective over the group), ``materialize``
    gives them storage to be loaded into, and ``masters_written`` takes loaded values back
    into the shard and the buffer.

    ``param_groups`` still list every parameter, with every key AdamW's groups have (so
    schedulers work, and a checkpoint's param groups load into any layout's optimizer).
    ``pieces``/``_views`` and the inner optimizer's state are what checkpoints save."""

    def __init__(self, groups: list[dict], group: dist.ProcessGroup, compute_dtype: torch.dtype | None = None,
                 **adam_kwargs):
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
        self.compute_dtype = compute_dtype if compute_dtype not in (None, self.dtype) else None
        total = sum(_local(p).numel() for p in self.params)
        self.segment = max(1, math.ceil(total / self.n))
        lo, hi = self.rank * self.segment, (self.rank + 1) * self.segment
        # (param, start, stop) of the pieces this rank updates, in flat order; per group.
        self.pieces: list[tuple[torch.Tensor, int, int]] = []
        owned: list[list[tuple[torch.Tensor, int, int]]] = []
        offset = 0
        for g in self.param_groups:
            owned.append([])
            for p in g["params"]:
                numel = _local(p).numel()
                a, b = max(lo, offset) - offset, min(hi, offset + numel) - offset
                if a < b:
                    self.pieces.append((p, a, b))
                    owned[-1].append((p, a, b))
                offset += numel
        # Adam's parameters: views into the parameters (fp32 compute) or into the rank's own
        # fp32 master shard (bf16 compute), piece after piece
        self.master_shard = None
        if self.compute_dtype is not None:
            self.master_shard = torch.zeros(sum(b - a for _, a, b in self.pieces), dtype=self.dtype,
                                            device=self.device)
        inner_groups, at = [], 0
        for g, pieces in zip(self.param_groups, owned):
            views = []
            for p, a, b in pieces:
                if self.master_shard is None:
                    views.append(_local(p).detach().view(-1)[a:b])
                else:
                    views.append(self.master_shard[at: at + b - a])
                    at += b - a
            if views:
                inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": views})
        self._views = [v for g in inner_groups for v in g["params"]]
        self._inner_of = [i for i, g in enumerate(owned) if g]
        self.optim = torch.optim.AdamW(inner_groups, **adam_kwargs) if inner_groups else None
        self.current = True  # the module's fp32 parameters hold the current values
        self._released: list[torch.Tensor] = []  # local parameter tensors whose storage is freed
        if self.compute_dtype is not None:
            self._init_compute_buffer()

    # ------------------------------------------------------------------ bf16 compute buffer

    @torch.no_grad()
    def _init_compute_buffer(self) -> None:
        """The flat compute-dtype buffer (every rank's segments, as the all-gather returns
        them), a view of it per parameter (a DTensor with the parameter's placements under
        tp), and this rank's send segment; then the built parameters taken in."""
        self.compute_flat = torch.zeros(self.n * self.segment, dtype=self.compute_dtype, device=self.device)
        self._send = torch.zeros(self.segment, dtype=self.compute_dtype, device=self.device)
        self._compute: dict[int, torch.Tensor] = {}
        offset = 0
        for p in self.params:
            t = _local(p)
            view = self.compute_flat[offset: offset + t.numel()].view(t.shape)
            if isinstance(p, DTensor):
                view = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
            self._compute[id(p)] = view
            offset += t.numel()
        self.masters_written()

    @torch.no_grad()
    def masters_written(self) -> None:
        """The fp32 parameters were set on every rank (built, loaded from a checkpoint):
        take this rank's segment of them into the master shard, cast them all into the
        compute buffer, and free them."""
        if self.compute_dtype is None:
            return
        if self._released:
            raise RuntimeError("ZeRO-1 masters_written() on released parameters (materialize() before loading)")
        for view, (p, a, b) in zip(self._views, self.pieces):
            view.copy_(_local(p).reshape(-1)[a:b])
        offset = 0
        for p in self.params:
            t = _local(p)
            self.compute_flat[offset: offset + t.numel()].copy_(t.reshape(-1))
            offset += t.numel()
        self.release()

    def release(self) -> None:
        """Free the module's fp32 parameters' storage (their values live in the ranks' master
        shards). A parameter whose storage holds more than itself (a view) is kept."""
        for p in self.params:
            t = _held(p)
            storage = t.untyped_storage()
            if storage.nbytes() and storage.nbytes() == t.numel() * t.element_size() and t.is_contiguous():
                storage.resize_(0)
                self._released.append(t)
        self.current = False
        self._versions = self._param_versions()

    def materialize(self) -> None:
        """Storage for every released parameter again (values undefined until written:
        ``sync_masters`` or a checkpoint load followed by ``masters_written``)."""
        for t in self._released:
            t.untyped_storage().resize_(t.numel() * t.element_size())
        self._released = []

    def held_param_bytes(self) -> int:
        """Bytes of fp32 parameter values this rank holds: the module's parameters that
        have storage, and the master shard."""
        held = sum(_held(p).untyped_storage().nbytes() for p in self.params)
        return held + (self.master_shard.numel() * self.master_shard.element_size()
                       if self.master_shard is not None else 0)

    def _param_versions(self) -> list[int]:
        return [_held(p)._version for p in self.params]

    def compute_copies(self) -> dict[int, torch.Tensor]:
        """The step's compute weights by ``id`` of the fp32 parameter: its values in the
        gathered buffer, with the gradient going to the parameter as a cast's would.
        Parameters this optimizer does not update are not in it (they are cast from their
        fp32 values, current everywhere)."""
        if self.compute_dtype is None:
            return {}
        if self._versions != self._param_versions():  # a write the buffer has not seen
            raise RuntimeError("ZeRO-1 with bf16 compute: fp32 master parameters were written outside the "
                               "optimizer; call masters_written() once they are set on every rank")
        return {id(p): _FromBuffer.apply(p, self._compute[id(p)]) for p in self.params}

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Make every rank's fp32 parameters hold the current values (one fp32 all-gather of
        the master shards, counted on dp): before a checkpoint, an unsharded copy or an
        export. A no-op when they do; collective over the group otherwise (``current`` is
        the same on every rank). They stay until the next step frees them."""
        if self.compute_dtype is None or self.current:
            return
        self.materialize()
        self._gather(self.dtype, self._install_masters)
        self.current = True
        self._versions = self._param_versions()

    def _install_masters(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            t = _local(p)
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()

    def _gather(self, dtype: torch.dtype, install=None) -> torch.Tensor:
        """All-gather every rank's updated segment, in ``dtype``: into the compute buffer
        (``dtype`` the compute dtype), or into a temporary flat tensor handed to ``install``."""
        if dtype == self.compute_dtype:
            flat, mine = self.compute_flat, self._send
        else:
            flat = torch.zeros(self.n * self.segment, dtype=dtype, device=self.device)
            mine = torch.zeros(self.segment, dtype=dtype, device=self.device)
        if self.master_shard is not None:  # the pieces end to end already: one copy (and cast)
            mine[: self.master_shard.numel()].copy_(self.master_shard)
        else:
            offset = 0
            for view in self._views:
                mine[offset: offset + view.numel()].copy_(view)
                offset += view.numel()
        comm.all_gather_into_tensor(flat, mine, self.group, "dp")
        if install is not None:
            install(flat)
        return flat

    # ------------------------------------------------------------------ the step

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
        if self.compute_dtype is not None:
            # bf16 on the wire, into the next step's compute weights; the module's fp32
            # parameters (gathered for a checkpoint since the last step) are out of date: freed
            self._gather(self.compute_dtype)
            self.release()
        else:
            self._gather(self.dtype, self._install_masters)
        for view in self._views:
            view.grad = None

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


class _FromBuffer(torch.autograd.Function):
    """``copy`` (a compute-dtype view of ZeRO-1's gathered buffer) as the compute weight of
    the fp32 ``master``: the gradient flows back to the master in its dtype, exactly as
    through the cast ``master.to(copy.dtype)`` it replaces (micro-batches accumulate in fp32)."""

    @staticmethod
    def forward(ctx, master, copy):
        ctx.dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


class ExpertSplitAdamW(torch.optim.Optimizer):
    """ZeRO-1 with expert parallel (DeepSeek-V3's layout): the dense parameters' Adam state
    sharded over the data-parallel ranks (``ShardedAdamW`` over dp_shard_cp) and the routed
    experts' over edp, the ranks holding the same experts (a second ``ShardedAdamW``), seen
    by the trainer, the scheduler, the compute weights and checkpoints as one optimizer.
    ``param_groups`` are the parts' own group dicts (a scheduler's lr reaches both);
    ``parts`` are what checkpoints save, each as any ``ShardedAdamW``. The gradient norm
    needs nothing here: the experts' gradients are DTensors sharded over ep, so
    ``grad_norm`` sums them over ep and counts each once."""

    def __init__(self, parts: list[ShardedAdamW]):
        self.parts = parts
        super().__init__([g for o in parts for g in o.param_groups], parts[0].defaults)
        self.params = [p for o in parts for p in o.params]
        self.compute_dtype = parts[0].compute_dtype

    @property
    def current(self) -> bool:
        return all(o.current for o in self.parts)

    def step(self, closure=None):
        for o in self.parts:
            o.step()

    def zero_grad(self, set_to_none: bool = True):
        for o in self.parts:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"parts": [o.optim.state_dict() if o.optim is not None else {} for o in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        for o, sd in zip(self.parts, state_dict["parts"], strict=True):
            if o.optim is not None:
                o.optim.load_state_dict(sd)

    def compute_copies(self) -> dict[int, torch.Tensor]:
        return {k: v for o in self.parts for k, v in o.compute_copies().items()}

    def sync_masters(self) -> None:
        for o in self.parts:
            o.sync_masters()

    def materialize(self) -> None:
        for o in self.parts:
            o.materialize()

    def masters_written(self) -> None:
        for o in self.parts:
            o.masters_written()

    def held_param_bytes(self) -> int:
        return sum(o.held_param_bytes() for o in self.parts)


class HostOffloadAdamW(torch.optim.AdamW):
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


def build_optimizer(model: nn.Module, cfg: TrainConfig, dims: ParallelDims, device_type: str = "cpu",
                    zero_one: bool = False, sharded: bool = False,
                    weights: ComputeWeights | None = None) -> torch.optim.Optimizer:
    """``zero_one``: ZeRO-1 over dp_shard_cp; ``sharded`` picks ``ShardedAdamW`` (tensor
    parallel: DTensor parameters, which ZeroRedundancyOptimizer cannot broadcast) over
    ZeroRedundancyOptimizer (plain parameters: DDP, pipeline stages). Both checkpoint
    (meshfold/train/checkpoint.py). ``weights``: the step's compute weights (bf16 compute
    without FSDP2); given with ``zero_one``, ``ShardedAdamW`` gathers the updated values in
    their dtype straight into them (Megatron's distributed optimizer: bf16 on the wire, in
    one flat collective) in every ZeRO-1 layout, and becomes their source."""
    groups = param_groups(model, cfg.weight_decay)
    kwargs = adamw_kwargs(cfg, device_type)
    experts, edp = expert_data_parallel(model)
    if experts:
        # expert parallel with zero 0/1: the experts (DTensors over ep) in groups of their own,
        # as foreach/fused AdamW take no mix of DTensors and plain tensors in one group
        apart = {id(p) for p in experts}
        split = [[{**g, "params": [p for p in g["params"] if (id(p) in apart) == mine]} for g in groups]
                 for mine in (False, True)]
        split = [[g for g in part if g["params"]] for part in split]
        groups = split[0] + split[1]
    if zero_one and experts:  # dense state over dp_shard_cp, experts' over edp
        dtype = weights.dtype if weights is not None else None
        opt = ExpertSplitAdamW([ShardedAdamW(part, group, dtype, **kwargs)
                                for part, group in zip(split, (dims.group("dp_shard_cp"), edp.get_group()))])
        if weights is not None and opt.compute_dtype is not None:
            weights.source = opt
        return opt
    if zero_one and (sharded or weights is not None):
        opt = ShardedAdamW(groups, dims.group("dp_shard_cp"), weights.dtype if weights is not None else None,
                           **kwargs)
        if weights is not None and opt.compute_dtype is not None:
            weights.source = opt
        return opt
    if zero_one:
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
