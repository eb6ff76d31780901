"""The Muon optimizer: hidden matrices get Newton-Schulz-orthogonalised momentum
(``OwnerPlan`` decides where each one is orthogonalised), everything else AdamW; one
optimizer for the trainer, the scheduler and checkpoints.

State lives in ``self.state`` by parameter, as torch's optimizers keep it:
``momentum_buffer`` for Muon's matrices, AdamW's ``step``/``exp_avg``/``exp_avg_sq`` for
the rest, each a DTensor with its parameter's placements where the parameter is one; so
DCP's flattened optimizer state (``FlattenedState``) saves it by parameter name, and a
run resumes into any layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from meshfold.mesh import ParallelDims
from meshfold.optim.adamw import adamw_kwargs
from meshfold.optim.muon.exchange import OwnerPlan, local_of
from meshfold.optim.muon.newton_schulz import DEFAULT_COEFFICIENTS, update_scale
from meshfold.optim.muon.qk_clip import QKClip
from meshfold.optim.muon.zero_one import WholeOwnership, ZeroOneOwnership
from meshfold.optim.state import CheckpointStateError, FlattenedState, ParamNames
from meshfold.parallel.compute_weights import ComputeWeights
from meshfold.parallel.dp.plan import unwrap
from meshfold.parallel.dp.replicate import expert_data_parallel

if TYPE_CHECKING:  # annotations only: the composed config sits above this layer
    from meshfold.config import TrainConfig

# Matrices that stay on AdamW (Muon's authors' rule): token embeddings, the output layer,
# MoE routers, by the module they belong to.
ADAMW_MATRICES = ("tok_embeddings", "embed", "output", "lm_head", "router")


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """A hidden matrix or a stack of them (experts [E, a, b])."""
    parts = name.split(".")
    return p.ndim >= 2 and not any(part in ADAMW_MATRICES for part in parts)


def split_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Parameter]]:
    """(Muon's (name, matrix) pairs, AdamW's parameters), trainable ones only."""
    muon, adam = [], []
    for name, p in unwrap(model).named_parameters():
        if p.requires_grad:
            (muon.append((name, p)) if is_muon_matrix(name, p) else adam.append(p))
    return muon, adam


class Muon(FlattenedState, torch.optim.Optimizer):
    """Muon for the matrices of the first group (``"muon": True``), AdamW (an inner torch
    AdamW sharing this optimizer's group dicts and state) for the other groups.

    A Muon step, per matrix: momentum m <- mu m + g (local, elementwise); the update
    u = g + mu m (Nesterov) or m; decoupled weight decay p <- (1 - lr wd) p; then
    p <- p - lr * scale * NS(u), NS orthogonalising the whole matrix on its owner."""

    def __init__(self, muon_params: list[tuple[str, torch.Tensor]], adam_groups: list[dict], *, lr: float,
                 weight_decay: float, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients=DEFAULT_COEFFICIENTS, ns_dtype: torch.dtype | None = None,
                 scale: str = "match_rms_adamw", adam_kwargs: dict | None = None,
                 zero_one: ZeroOneOwnership | None = None):
        self.adamw = torch.optim.AdamW(adam_groups, **(adam_kwargs or {})) if adam_groups else None
        muon_group = {"params": [p for _, p in muon_params], "lr": lr, "weight_decay": weight_decay,
                      "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                      "ns_coefficients": tuple(ns_coefficients), "scale": scale, "muon": True}
        groups = [muon_group] + (self.adamw.param_groups if self.adamw else [])
        super().__init__(groups, {})
        if self.adamw is not None:
            self.adamw.state = self.state  # one state dict: DCP and the scheduler see one optimizer
        self.ns_dtype = ns_dtype
        # ZeRO-1 (zero_one.py): state and update only for the parameters this rank owns
        self.zero_one = zero_one
        self.owned = [p for p in muon_group["params"] if zero_one is None or zero_one.owns(p)]
        mine = [(n, p) for n, p in muon_params if zero_one is None or zero_one.owns(p)]
        device = local_of(mine[0][1]).device if mine else torch.device("cpu")
        self.plan = OwnerPlan([p for _, p in mine], [n for n, _ in mine], device)
        self.after_step: list = []  # called after every step (QK-clip: qk_clip.py)

    def __setstate__(self, state: dict) -> None:
        """``load_state_dict`` replaces the state and the group dicts: the inner AdamW
        follows them."""
        super().__setstate__(state)
        if getattr(self, "adamw", None) is not None:
            self.adamw.state = self.state
            self.adamw.param_groups = self.param_groups[1:]

    def checkpoint_template(self, model: ParamNames, saved: set[str]) -> dict:
        """As ``FlattenedState``'s, refusing in one line a checkpoint another optimizer wrote
        (``train.init_from`` starts from its parameters alone)."""
        params = self.param_groups[0]["params"]
        if params and f"state.{model[params[0]]}.momentum_buffer" not in saved:
            raise CheckpointStateError(
                f"the checkpoint has no Muon momentum for {model[params[0]]} (another train.optimizer wrote it); "
                "resume with that optimizer, or start from its parameters with train.init_from")
        return super().checkpoint_template(model, saved)

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        params = self.owned
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = local_of(state["momentum_buffer"])
            g = local_of(p.grad) if p.grad is not None else torch.zeros_like(buf)
            buf.mul_(mu).add_(g)
            updates.append(g.add(buf, alpha=mu) if group["nesterov"] else buf.clone())
        dtype = self.ns_dtype
        done = self.plan.orthogonalize(updates, group["ns_steps"], group["ns_coefficients"], dtype)
        for p, o in zip(params, done):
            local = local_of(p)
            local.mul_(1 - lr * wd)
            local.add_(o, alpha=-lr * update_scale(p.shape[-2], p.shape[-1], group["scale"]))
        if self.adamw is not None:
            self._adamw_step()
        if self.zero_one is not None:
            self.zero_one.gather()
        for hook in self.after_step:
            hook()

    def _adamw_step(self) -> None:
        """AdamW's step over the parameters this rank owns (torch's AdamW skips a parameter
        without a gradient: the others' are set aside meanwhile)."""
        if self.zero_one is None:
            self.adamw.step()
            return
        aside = [(p, p.grad) for g in self.adamw.param_groups for p in g["params"] if not self.zero_one.owns(p)]
        for p, _ in aside:
            p.grad = None
        try:
            self.adamw.step()
        finally:
            for p, grad in aside:
                p.grad = grad


def ns_dtype_of(cfg: TrainConfig, param_dtype: torch.dtype) -> torch.dtype:
    """``train.muon_dtype``: auto is float64 when the run is, else bfloat16."""
    if cfg.muon_dtype != "auto":
        return getattr(torch, cfg.muon_dtype)
    return torch.float64 if param_dtype == torch.float64 else torch.bfloat16


def build_muon(model: nn.Module, cfg: TrainConfig, dims: ParallelDims, device_type: str = "cpu",
               zero_one: bool = False, sharded: bool = False,
               weights: ComputeWeights | None = None) -> torch.optim.Optimizer:
    """Muon for the hidden matrices, AdamW for the rest (weight decay on AdamW's matrices
    only, as ``adamw.param_groups``). FSDP2/tp shards come as DTensors (``OwnerPlan``
    exchanges them); DDP and HSDP replicas compute the same update side by side; ``zero_one``
    (ZeRO-1 over dp_shard_cp): each rank owns whole parameters (``zero_one.py``), the expert
    stacks over their own edp group."""
    muon, adam = split_params(model)
    kwargs = adamw_kwargs(cfg, device_type)
    # foreach/fused AdamW take no mix of DTensors and plain tensors (or meshes) in one group
    adam_groups: dict[tuple, dict] = {}
    for p in adam:
        key = (p.ndim >= 2, getattr(p, "device_mesh", None) is not None and id(p.device_mesh))
        g = adam_groups.setdefault(key, {"params": [], "weight_decay": cfg.weight_decay if p.ndim >= 2 else 0.0,
                                         "muon": False})
        g["params"].append(p)
    dtype = next((local_of(p).dtype for _, p in muon), torch.float32)
    opt = Muon(muon, list(adam_groups.values()),
                lr=cfg.muon_lr or cfg.lr,
                weight_decay=cfg.weight_decay if cfg.muon_weight_decay < 0 else cfg.muon_weight_decay,
                momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                ns_coefficients=cfg.muon_ns_coefficients, ns_dtype=ns_dtype_of(cfg, dtype),
                scale=cfg.muon_scale, adam_kwargs=kwargs,
                zero_one=zero_one_ownership(model, muon, dims) if zero_one else None)
    if cfg.muon_qk_clip > 0:
        clip = QKClip(unwrap(model), cfg.muon_qk_clip, cfg.muon_qk_clip_alpha, dims.group("dp_cp"),
                      tp=dims.size("tp"), cp=dims.size("cp"))
        opt.after_step.append(clip.after_step)
        opt.qk_clip = clip
    return opt


def zero_one_ownership(model: nn.Module, muon: list[tuple[str, nn.Parameter]], dims: ParallelDims) -> ZeroOneOwnership:
    """Whole-parameter ownership of every trainable parameter, in registration order: the
    routed experts over edp (where expert parallel keeps them apart), the rest over dp_shard_cp."""
    kinds = {id(p) for _, p in muon}
    experts, edp = expert_data_parallel(model)
    apart = {id(p) for p in experts}
    params = [p for _, p in unwrap(model).named_parameters() if p.requires_grad]
    domains = []
    for group, mine in ((dims.group("dp_shard_cp"), False), (edp.get_group() if edp is not None else None, True)):
        part = [p for p in params if (id(p) in apart) == mine]
        if group is not None and part:
            domains.append(WholeOwnership(part, [id(p) in kinds for p in part], group))
    return ZeroOneOwnership(domains)
