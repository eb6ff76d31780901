"""The planner's view of a config: the workload and layout a ``Config`` runs as, and the
footprint ``meshfold dry-run`` compares with the runtime's."""

from __future__ import annotations

from meshfold.config import Config, validate
from meshfold.data.micro import micro_batch_count
from meshfold.parallel.facts.attention import ulysses_degree
from meshfold.planner.cluster import load_cluster
from meshfold.planner.cost import CostModel, Layout, Workload
from meshfold.planner.workload import DEFAULT_SCHEDULE


def workload_from_config(cfg: Config, on_gpu: bool) -> Workload:
    """The model and batch of a config, with the numerics the run would use: ``bfloat16``
    (``auto`` on a GPU) is autocast over fp32 parameters, fused attention on GPUs, fused
    memory-bound kernels under ``train.compile``, fp8 GEMMs (at the device's ``fp8_tflops``,
    plus their casts) under ``train.fp8``, and ``train.optimizer``."""
    dtype = cfg.train.dtype
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    dtype = {"bfloat16": "bf16-amp"}.get(dtype, dtype)
    # ``train.compile`` compiles each block: inductor fuses its memory-bound ops
    kernels = "fused" if cfg.train.compile else "eager"
    return Workload(cfg.model, cfg.train.global_batch, cfg.model.seq_len, dtype=dtype, flash=on_gpu, kernels=kernels,
                    fp8=cfg.train.fp8 != "none", fp8_recipe=cfg.train.fp8, fp8_all_gather=cfg.train.fp8_all_gather,
                    fp8_dispatch=cfg.parallel.ep_fp8_dispatch, optimizer=cfg.train.optimizer,
                    muon_ns_steps=cfg.train.muon_ns_steps, aligned_groups=on_gpu, cp_balance=cfg.parallel.cp_balance)


def layout_from_config(cfg: Config, world: int) -> Layout:
    """The layout a config runs as on ``world`` devices (validated as ``train`` would)."""
    cfg = validate(cfg, world)
    p, t = cfg.parallel, cfg.train
    local = t.global_batch // p.dp
    micro = local // micro_batch_count(local, t.micro_batch, p.pp, p.pp_microbatches)
    zero = p.zero if (p.dp_shard * p.cp > 1) else 0
    return Layout(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, zero=zero, tp=p.tp, sp=p.sp, pp=p.pp,
                  pp_schedule=p.pp_schedule if p.pp > 1 else DEFAULT_SCHEDULE, pp_virtual_stages=p.pp_virtual_stages,
                  cp=p.cp, cp_mode=p.cp_mode, ep=p.ep, ep_overlap_chunks=p.ep_overlap_chunks,
                  expert_tp=p.expert_tp, micro_batch=micro, recompute=t.recompute,
                  cp_ulysses=ulysses_degree(p, cfg.model) if p.cp_mode == "hybrid" and p.cp > 1 else 0,
                  pp_split=tuple(p.pp_split) if p.pp > 1 else (),
                  pp_links=tuple(tuple(x) for x in p.pp_links) if p.pp > 1 else (),
                  pp_skip=p.pp_skip, pp_reorder=p.pp_reorder)


def _cuda_available() -> bool:
    import torch  # only for train.device = auto; the planner itself never needs torch

    return torch.cuda.is_available()


def on_gpu(device: str) -> bool:
    """Whether ``train.device`` (cpu | cuda | auto) runs on a GPU here."""
    return device == "cuda" or (device == "auto" and _cuda_available())


def footprint(cfg: Config, world: int, device: str | None = None) -> dict:
    """The planner's prediction for the layout in ``cfg.parallel`` on ``world`` ranks, in
    the terms ``meshfold dry-run`` reports for the runtime: per rank (max over ranks)
    ``param_bytes``, ``grad_bytes``, ``optimizer_bytes``, ``activation_bytes``, and rank 0's
    ``collectives`` per step, ``{dim: {"count": int, "bytes": float}}`` (see
    ``CostModel.collectives``; docs/planner.md defines every count). ``device`` (cpu |
    cuda) decides the numerics as the trainer would; default ``cfg.train.device``. Memory
    and collectives do not depend on the cluster's speeds."""
    gpu = on_gpu(device or cfg.train.device)
    cluster = load_cluster("h100" if gpu else "cpu", devices=world)
    est = CostModel(workload_from_config(cfg, gpu), cluster).estimate(layout_from_config(cfg, world))
    return est.footprint()
