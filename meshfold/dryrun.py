"""``meshfold dry-run CONFIG --world N``: check a layout at any scale on this machine.

For a few representative ranks of an N-rank job, one after the other in this process:
torch's ``fake`` process-group backend stands in for the N ranks (collectives return at
once, nothing is sent), and a ``FakeTensorMode`` stands in for memory (tensors carry
shapes, dtypes and devices but no data). The real code then runs unchanged: the config is
validated as ``train`` validates it, the mesh is built, the model is built and
parallelised (tensor, pipeline, expert, FSDP/HSDP, DDP-style reducers) exactly as a real
rank builds it, and one training step runs (forward and backward over every micro-batch,
the gradient-norm reduction, the optimizer step). What that rank would hold and send is
then read off:

- ``param_bytes`` / ``grad_bytes``: the local pieces of its parameters, and of its
  gradients at their largest in the step (after the last backward, or between
  micro-batches, where FSDP2 holds unsharded gradients while gradient sync is off);
- ``optimizer_bytes``: the optimizer state it created (ZeRO-1 ranks only their part);
- ``activation_bytes``: what autograd saves for backward in one micro-batch's forward
  (counted with the same saved-tensor hooks as ``metrics.jsonl``); with pipeline parallel, the per-micro-
  batch bytes of each of this rank's chunks (counted in forward only), held from the chunk's
  forward to its backward in the rank's order for the real micro-batch count: the most
  held at once (``DryTrainer.held_activations``);
- ``collectives``: ``{dim: {"count", "bytes"}}`` of the step, as the communication layer
  (meshfold/comm.py) records them.

Which ranks: ranks that differ only in their tensor, data or context coordinate hold
pieces of the same stage of the same size (torch.chunk gives the first coordinates the
larger piece when a dimension does not divide), and send the same collectives; only the
pipeline stage changes what a rank holds. So rank ``s * N / pp`` (coordinate 0 on every
other dimension) is simulated for every stage ``s``, and the report takes the maximum over
them; N ranks never need to exist.

MoE layers route as a perfectly balanced router would (the planner's assumption): fake
tensors carry no routing, so the counts the dispatch needs come from one seam
(``models/moe.py``: ``count_rows`` / ``read_counts``) that gives the balanced counts for
tensors without values and is exactly ``bincount`` / ``tolist`` otherwise.

Next to it, the planner's prediction for the same layout (``planner/cost.py``). Both are
for the target's numerics: ``train.dtype = auto`` is resolved for ``--cluster`` (bfloat16 on
a GPU cluster) before the simulation, which itself runs on this CPU. docs/memory.md says
what each side counts and how closely they agree.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import queue
import sys
import time
import traceback
import types
import warnings
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_module
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.testing._internal.distributed.fake_pg import FakeStore

from meshfold import comm, gpucheck
from meshfold.comm import ledger, reset_ledger
from meshfold.config import Config, load_config, validate
from meshfold.data.loader import to_device, with_host_run_starts
from meshfold.device import resolve_dtypes
from meshfold.errors import ConfigError
from meshfold.lowcomm.compress import build_compression
from meshfold.mesh import build_mesh
from meshfold.models.moe import moe_end_step, moe_layers
from meshfold.models.varlen_attention import use_varlen_attention
from meshfold.parallel.cp.attention import ContextParallelAttention
from meshfold.parallel.cp.batch import shard_for_context_parallel
from meshfold.parallel.dp.replicate import BUCKET_MB
from meshfold.memory import count_saved_activations
from meshfold.optim.clip import grad_norm
from meshfold.parallel.pp.stage_modules import stage_split
from meshfold.planner.cli import layout_from_config, workload_from_config
from meshfold.planner.cluster import load_cluster
from meshfold.planner.cost import CostModel
from meshfold.schedules.by_name import chunks_per_rank, rank_grad_moments, stage_of
from meshfold.schedules.held import held_counts, held_peak
from meshfold.train.feature import Features, RunParts
from meshfold.train.mtp import build_mtp
from meshfold.train.progress import Progress
from meshfold.train.trainer import Trainer

FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")


def _lowcomm_build(cfg: Config, parts):
    """What the trainer's ``[lowcomm]`` and live-recovery features change in what a rank
    builds: lowcomm.compression's DDP hook and the optimizer's fp32 gather."""
    owner, lc = build_compression(cfg.lowcomm), cfg.lowcomm
    return types.SimpleNamespace(comm_hook=owner.install if owner is not None else None,
                                 touches_master_weights=lc.method != "none" or lc.onebit_adam or cfg.train.live_recovery)


MODEL_FEATURES = (build_mtp, _lowcomm_build)


class DryTrainer(Trainer):
    """The parts of a ``Trainer`` that build and step the model; no data, checkpoints,
    metrics or fault handling (those do not change what a rank holds or sends)."""

    gpu = None  # --device cuda: the step's recorder (meshfold/gpucheck.py)

    def __init__(self, cfg: Config, device: str = "cpu"):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.cfg = cfg = validate(cfg, self.world)
        t = cfg.train
        self.device = torch.device("cpu")  # --device cuda: see meshfold/gpucheck.py for where tensors live
        self.param_dtype, self.autocast_dtype = resolve_dtypes(t.dtype, self.device)
        workers = cfg.lowcomm.n_workers
        with unset_fake_temporarily():  # the mesh holds real rank tables
            self.dims = build_mesh(cfg.parallel, workers, "cpu")
        # --device cuda runs the trainer's data settings (packed rows carry doc_ids)
        self.balancer, self.use_doc_mask = None, device == "cuda" and cfg.data.pack and cfg.data.doc_mask
        self.ledger = ledger()
        self.step_metrics, self.progress, self.capture_grads = {}, Progress(), False
        # The features that change what a rank builds and sends (no data: no batch source).
        parts = RunParts(cfg, self.dims, self.device, self.param_dtype, self.rank, self.world, None, self.progress,
                         Features())
        self.features = parts.features.build(MODEL_FEATURES, cfg, parts)
        self.grad_reducers = self.dims.size("dp_cp")
        self.held_grad_bytes = 0
        self.chunk_grads: dict[int, dict[int, int]] = {1: {}, 2: {}}  # (_note_chunk_grads)
        self.reduced_chunks: set = set()
        self.announce_split = False  # stdout carries the report (--json: JSON only)
        self.loss_fn = self.build_loss()
        self.engine = self.build_engine()
        self.model, self.model_parts = self.engine.model, self.engine.parts
        if isinstance(self.model, ddp_module.DistributedDataParallel):
            self.model.reducer = _KeptBuckets(self.model.reducer)
        self.pipeline = getattr(self.engine, "pipe", None)
        if device == "cuda" and cfg.data.balance != "none" and self.pipeline is None:
            use_varlen_attention(self.model)  # data.balance's attention per document (its placement is not simulated)
        self.optimizer = self.build_optimizer(device)  # cuda: the fused AdamW a GPU rank runs
        if self.pipeline is not None:  # timings need real values (no step number: no timeline)
            self.pipeline._reduce_step = self._pipeline_step_reduction
            set_sync = self.pipeline._set_grad_sync

            def measured_set_sync(chunk):  # called before each chunk's last backward
                self._note_held_grads()
                self._note_chunk_grads(chunk)
                set_sync(chunk)

            self.pipeline._set_grad_sync = measured_set_sync
        else:
            grad_sync = self.engine.grad_sync

            def measured_grad_sync(last: bool):
                if last:  # the gradients accumulated over the micro-batches before the last one
                    self._note_held_grads()
                return grad_sync(last)

            self.engine.grad_sync = measured_grad_sync

    def _note_held_grads(self) -> None:
        self.held_grad_bytes = max(self.held_grad_bytes, held_grad_bytes(self.model))

    def _note_chunk_grads(self, chunk) -> None:
        """Each pipeline chunk's gradient bytes while it accumulates (unsharded between
        micro-batches) and once reduced, seen before each chunk's last backward
        (``chunk``; None starts a step, "all" ends it): what ``held_pipeline_grads`` combines
        at the moments of the real micro-batch count."""
        if chunk is None:
            self.reduced_chunks = set()
            return
        if chunk == "all":
            return
        for c, module in enumerate(self.pipeline.model.chunks):
            held = held_grad_bytes(module)
            if held:
                seen = self.chunk_grads[2 if c in self.reduced_chunks else 1]
                seen[c] = max(seen.get(c, 0), held)
        self.reduced_chunks.add(chunk)

    def held_pipeline_grads(self) -> int:
        """The most gradient bytes this pipeline rank holds before a chunk's last backward
        in a step of the real micro-batch count: its chunks' accumulating and reduced
        bytes at each of those moments (``schedule.rank_grad_moments``, as the planner)."""
        p = self.cfg.parallel
        v = p.pp_virtual_stages if p.pp_schedule == "interleaved" else 1
        if p.pp_schedule == "skippipe" or chunks_per_rank(p.pp_schedule, p.pp_virtual_stages) == 1:
            return 0
        moments = rank_grad_moments(p.pp_schedule, p.pp, v, self.n_micro, self.dims.rank("pp"))
        return max(sum(self.chunk_grads[s].get(c, 0) for c, s in enumerate(moment) if s)
                   for moment in moments)

    def _pipeline_step_reduction(self, loss_sum, events, wall0, span, m):
        """What ``Pipeline._reduce_step`` sends (loss sum and timings, one all-gather over pp),
        without reading the values on the host (they are fake)."""
        pipe = self.pipeline
        mine = torch.zeros(4, dtype=torch.float64, device=loss_sum.device)
        every = torch.zeros(4 * pipe.pp, dtype=torch.float64, device=loss_sum.device)
        comm.all_gather_into_tensor(every, mine, pipe.group, "pp")
        return every.view(pipe.pp, 4)[:, 0].sum()

    def _context_work_gather(self) -> None:
        """What ``context_step_metrics`` sends once a step (each cp rank's attention work, one
        all-gather over cp), without its host read of the (fake) values."""
        if self.dims.size("cp") > 1:
            for m in self.model.modules():
                plan = getattr(m, "plan", None)
                if isinstance(m, ContextParallelAttention):
                    plan.work.reset()
                    work = torch.empty(plan.cp, dtype=torch.float64, device=self.device)
                    comm.all_gather_into_tensor(work, torch.zeros(1, dtype=torch.float64, device=self.device),
                                                plan.cp_group, "cp")
                    return

    def fake_batch(self) -> dict[str, torch.Tensor]:
        p, m = self.cfg.parallel, self.cfg.model
        local = self.cfg.train.global_batch // p.dp
        tokens = torch.randint(0, m.vocab_size, (local, m.seq_len + 1))
        batch = {"inputs": tokens[:, :-1], "labels": tokens[:, 1:]}
        if self.use_doc_mask:
            batch["doc_ids"] = torch.zeros_like(batch["inputs"])
        batch = shard_for_context_parallel(batch, self.cfg, self.dims)
        return to_device(with_host_run_starts(batch), self.device)  # as the trainer's prefetcher moves it

    def _step(self, micro: list[dict]) -> tuple[dict, float]:
        """One optimizer step over ``micro``: (collectives, activation bytes)."""
        # the step's scalar reductions, as Trainer.train_step issues them: token count, then loss
        tokens = self.all_reduce_sum(torch.tensor(self.cfg.train.global_batch * self.cfg.model.seq_len,
                                                  device=self.device))
        if self.pipeline is not None:
            with count_saved_activations(self.model) as counted:
                loss_sum = self.engine.forward_backward(micro, tokens)
            activations = self.held_activations(counted.by_tag, len(micro))
        else:
            loss_sum = self.engine.forward_backward(micro, tokens)
            activations = self.engine.pop_metrics().get("activation_bytes", 0)
        self._context_work_gather()
        self.all_reduce_sum(loss_sum)
        if self.gpu is not None:  # the trainer's step end: clip, norm and loss reads, MoE metrics
            norm = self.engine.clip_grad_norm(self.cfg.train.grad_clip)
            math.isfinite(float(norm))
            self.grad_bytes = max(self.grad_bytes, self.held_grad_bytes, held_grad_bytes(self.model))
            self.optimizer.step()
            moe_end_step(self.model)
            self.optimizer.zero_grad(set_to_none=True)
            float(loss_sum / tokens.double())
            return self.ledger.pop_step_collectives(), activations
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm(params, self.dims.group("pp") if self.pipeline is not None else None)
        self.grad_bytes = max(self.grad_bytes, self.held_grad_bytes, held_grad_bytes(self.model))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for _, moe in moe_layers(self.model):  # the step's routing statistics, as the Trainer ends a step
            moe.end_step()
        return self.ledger.pop_step_collectives(), activations

    def held_activations(self, by_chunk: dict, counted_micro: int) -> float:
        """The most activation bytes this pipeline rank holds at once in a step of the real
        micro-batch count: each chunk's bytes per micro-batch (counted over
        ``counted_micro`` of them) held from its forward to its backward, in this rank's
        order (``schedule.held_counts``: the planner prices the same moments)."""
        order = self.pipeline.orders_for(self.n_micro, self.micro_rows)
        chunks = chunks_per_rank(self.cfg.parallel.pp_schedule, self.cfg.parallel.pp_virtual_stages)
        per_micro = [by_chunk.get(c, 0) / counted_micro for c in range(chunks)]
        return held_peak(held_counts(order), per_micro)

    def dry_step(self) -> dict:
        """Every micro-batch has the same shapes, so a step's collectives are affine in the
        micro-batch count m (per-micro-batch traffic plus once-per-step reductions): two
        short steps with m1 < m2 micro-batches give the count and bytes for the real m
        exactly, at the cost of m1 + m2 micro-batches instead of m."""
        self.ledger.pop_step()  # building is not a step
        self.grad_bytes = 0
        micro = self.micro_batches(self.fake_batch())
        self.n_micro = m = len(micro)
        self.micro_rows = micro[0]["inputs"].shape[0]
        p = self.cfg.parallel
        unit = p.pp if p.pp > 1 and p.pp_schedule == "interleaved" else 1
        gpu = self.gpu
        self._step = gpu.stepping(self._step) if gpu else self._step
        if m <= 2 * unit:
            coll, activations = self._step(micro)
            g = gpu.pop_step() if gpu else None
        else:
            c1, activations = self._step(micro[:unit])
            g1 = gpu.pop_step() if gpu else None
            c2, _ = self._step(self.micro_batches(self.fake_batch())[:2 * unit])  # fresh tensors: no cache hits
            g2 = gpu.pop_step() if gpu else None
            k = (m - unit) / unit
            coll = {d: {f: int(round(c1.get(d, {}).get(f, 0) + k * (c2.get(d, {}).get(f, 0)
                                                                    - c1.get(d, {}).get(f, 0))))
                        for f in ("count", "bytes")} for d in sorted(set(c1) | set(c2))}
            g = {f: gpucheck.extrapolate(g1[f], g2[f], k) for f in g1} if gpu else None
        extra = {"gpu": {**g, **gpu.report()}} if gpu else {}
        if self.pipeline is not None:
            self.grad_bytes = max(self.grad_bytes, self.held_pipeline_grads())
        return {**extra, "param_bytes": _param_bytes(self.model, self.optimizer),
                "grad_bytes": self.grad_bytes, "optimizer_bytes": _optimizer_bytes(self.optimizer),
                "activation_bytes": int(activations), "collectives": coll, "micro_batches": m}


def _param_bytes(model: torch.nn.Module, opt) -> int:
    """The parameter bytes the rank holds: its local pieces, except that ZeRO-1 under bf16
    holds only its own segment of the fp32 values (``ShardedAdamW.held_param_bytes``)."""
    held = getattr(opt, "held_param_bytes", None)
    if held is not None and opt.compute_dtype is not None:
        mine = {id(p) for p in opt.params}
        return held() + sum(_local_bytes(q) for q in model.parameters() if id(q) not in mine)
    return sum(_local_bytes(q) for q in model.parameters())


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def held_grad_bytes(model: torch.nn.Module) -> int:
    """Gradient bytes the rank holds now: the local pieces of its parameters' gradients,
    plus FSDP2's unsharded gradients, which it keeps between micro-batches while gradient
    sync is off (in the reduce dtype, ``unsharded_accumulated_grad``, once a second
    micro-batch has been added to them) and which ``model.parameters()`` does not show."""
    total = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fp in (group.fsdp_params if group is not None else ()):
            unsharded = getattr(fp, "_unsharded_param", None)
            for g in (getattr(unsharded, "grad", None), getattr(fp, "unsharded_accumulated_grad", None)):
                if g is not None:
                    total += _local_bytes(g)
    return total


def _optimizer_bytes(opt) -> int:
    if hasattr(opt, "parts"):  # ZeRO-1 with expert parallel: the dense and the expert part
        return sum(_optimizer_bytes(part) for part in opt.parts)
    inner = getattr(opt, "optim", None)  # ZeRO-1: the rank's own optimizer
    states = list(opt.state.values()) + (list(inner.state.values()) if inner is not None else [])
    return sum(_local_bytes(v) for s in states for v in s.values() if isinstance(v, torch.Tensor) and v.dim())


def representative_ranks(cfg: Config, world: int) -> list[int]:
    """Coordinate 0 on every dimension but pp, one rank per distinct pipeline-rank shape
    (the layer counts of its chunks, and whether it holds the embedding or the output);
    see the module doc."""
    p = cfg.parallel
    per_stage = world // cfg.lowcomm.n_workers // p.pp
    if p.pp == 1:
        return [0]
    split, _ = stage_split(cfg)
    last = len(split) - 1
    seen, ranks = set(), []
    for r in range(p.pp):
        stages = [stage_of(p.pp_schedule, p.pp, r, c) for c in range(chunks_per_rank(p.pp_schedule,
                                                                                       p.pp_virtual_stages))]
        shape = tuple((split[s], s == 0, s == last) for s in stages)
        if shape not in seen:
            seen.add(shape)
            ranks.append(r * per_stage)
    return ranks


@contextlib.contextmanager
def _real_mesh_tensors():
    """DeviceMesh computes its rank tables with tensor ops (FSDP2 over tensor-parallel
    DTensors joins two meshes; expert parallel unflattens the dp_cp mesh into (edp, ep) and
    joins ep with tp); under the fake mode those would become fake tensors with no values.
    Run them for real."""
    original, init = DeviceMesh.mesh, DeviceMesh.__init__
    unflatten, concatenate = DeviceMesh._unflatten, DeviceMesh.__dict__["_concatenate"]

    def mesh(self):
        with unset_fake_temporarily():
            return original.fget(self)

    def real_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            init(self, *args, **kwargs)

    def real_unflatten(self, *args, **kwargs):
        with unset_fake_temporarily():
            return unflatten(self, *args, **kwargs)

    def real_concatenate(*args, **kwargs):
        with unset_fake_temporarily():
            return concatenate.__func__(*args, **kwargs)

    DeviceMesh.mesh, DeviceMesh.__init__ = property(mesh), real_init
    DeviceMesh._unflatten, DeviceMesh._concatenate = real_unflatten, staticmethod(real_concatenate)
    try:
        yield
    finally:
        DeviceMesh.mesh, DeviceMesh.__init__ = original, init
        DeviceMesh._unflatten, DeviceMesh._concatenate = unflatten, concatenate


@contextlib.contextmanager
def _ddp_without_shape_check():
    """DDP's constructor compares parameter shapes across ranks by reading their values
    (``_verify_param_shape_across_processes``), which fake tensors do not have; every
    simulated rank builds its model by the same code, so the check is skipped here. And DDP
    runs its first backward with all gradients in one bucket, then rebuilds the buckets
    (``bucket_cap_mb``) in the order gradients arrived, which copies values fake tensors do
    not have (``_KeptBuckets`` stops it): here the buckets are cut at the cap from the
    start, so the simulated step sends what every step after a real run's first sends."""
    original = ddp_module._verify_param_shape_across_processes
    assign = dist._compute_bucket_assignment_by_size

    def steady_buckets(params, limits, *args, **kwargs):
        return assign(params, [BUCKET_MB * 2**20] if list(limits) == [sys.maxsize] else limits, *args, **kwargs)

    ddp_module._verify_param_shape_across_processes = lambda *args, **kwargs: None
    dist._compute_bucket_assignment_by_size = steady_buckets
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = original
        dist._compute_bucket_assignment_by_size = assign


class _KeptBuckets:
    """DDP's reducer, as DDP's Python side calls it, except that it never rebuilds its
    buckets: after the first backward DDP re-allocates them in the order gradients arrived,
    copying parameter values, which fake tensors do not have. The dry-run's DDP cuts its
    buckets at the cap from the start (``_ddp_without_shape_check``) and keeps them."""

    def __init__(self, reducer):
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def simulate_rank(cfg: Config, world: int, rank: int, device: str = "cpu") -> dict:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        reset_ledger()
        cuda = device == "cuda"  # every op recorded as a CUDA run would do it (meshfold/gpucheck.py)
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings(), _real_mesh_tensors(), \
                _ddp_without_shape_check(), gpucheck.recording() if cuda else contextlib.nullcontext() as gpu:
            warnings.simplefilter("ignore")
            trainer = DryTrainer(dataclasses.replace(cfg), device)
            if gpu is not None:
                gpu.attach(trainer.dims, gpucheck.layer_modules(trainer.model_parts), gpucheck.blocks(trainer.model_parts))
            trainer.gpu = gpu
            return trainer.dry_step()
    finally:
        dist.destroy_process_group()


def planner_prediction(cfg: Config, world: int, cluster_spec: str) -> dict:
    """The planner's prediction for this layout (``Estimate.footprint``: per-rank memory,
    max over stages, and rank 0's collectives with call counts), plus its step time and
    peak. Attention is priced as the fused kernel (no s x s scores) that the runtime runs
    on both CPU (``_scaled_dot_product_flash_attention_for_cpu``) and GPU."""
    cluster = load_cluster(cluster_spec, devices=world)
    workload = dataclasses.replace(workload_from_config(cfg, cluster), flash=True)
    est = CostModel(workload, cluster).estimate(layout_from_config(cfg, world))
    out = {k: int(round(v)) for k, v in est.footprint().items() if k != "collectives"}
    out["collectives"] = {d: {"count": x["count"], "bytes": int(round(x["bytes"]))}
                          for d, x in est.collectives.items()}
    out["step_time_s"], out["peak_mem_bytes"] = est.step_time_s, int(est.peak_mem_bytes)
    return out


def _on_gpu(cluster) -> bool:  # as planner/cli.py's workload_from_config decides
    return not cluster.device.name.startswith("cpu")


def with_target_numerics(cfg: Config, cluster_spec: str) -> Config:
    """``train.dtype = auto`` resolved for the cluster the layout is meant for (bfloat16
    autocast over fp32 master weights on GPUs, float32 on CPUs), as ``train`` would
    resolve it there: the simulation itself runs on this CPU, where ``auto`` would mean
    float32, but what it reports is for the target's run."""
    if cfg.train.dtype != "auto":
        return cfg
    dtype = "bfloat16" if _on_gpu(load_cluster(cluster_spec)) else "float32"
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dtype=dtype))


class DryRunError(RuntimeError):
    """A simulated rank failed: one line naming the rank and the error (the CLI prints it)."""


def _one_line(e: BaseException) -> str:
    """``Type: message (at file:line)``, the innermost meshfold frame the error passed."""
    text = " ".join(str(e).split())
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}meshfold{os.sep}" in f.filename]
    where = f" (at {os.path.relpath(frames[-1].filename, os.path.dirname(os.path.dirname(__file__)))}:" \
            f"{frames[-1].lineno})" if frames else ""
    return (f"{type(e).__name__}: {text[:400]}" if text else type(e).__name__) + where


def _child(out, i: int, fn, args) -> None:
    try:
        answer = (i, True, fn(*args))
    except BaseException as e:  # handed to the parent, which raises it: a refusal as itself,
        # anything else as one line (its objects may hold fake tensors that cannot travel)
        answer = (i, False, ConfigError(str(e)) if isinstance(e, ConfigError) else
                  DryRunError(f"dry-run: the process simulating {args[1:]} failed: {_one_line(e)}"))
    try:  # the queue serializes in a feeder thread, where a failure would be lost (the child then
        ForkingPickler.dumps(answer)  # exits 0 without an answer): find out here, with its pickler
    except Exception as e:
        answer = (i, False, DryRunError(f"dry-run: the process simulating {args[1:]} could not send its "
                                        f"answer: {_one_line(e)}"))
    out.put(answer)


def _fork_is_clean() -> bool:
    """No process group and no other thread (a fork copies only the calling thread: a lock
    another thread held, e.g. an OpenMP or BLAS pool's or a queue feeder's, would stay held)."""
    if dist.is_initialized() or not os.path.isdir("/proc/self/task"):
        return False
    return len(os.listdir("/proc/self/task")) == 1


def _in_fresh_processes(fn, calls: list[tuple], parallel: int, raise_first: bool = True,
                        clean_parent: bool = False) -> list:
    """``fn(*args)`` for each of ``calls``, each in a fresh process (torch caches meshes and
    groups per process), ``parallel`` at a time; results in order. A child's exception is
    raised here; a child that dies without an answer (killed, out of memory) is an error
    naming it, never a wait without end (as a ``multiprocessing.Pool`` whose worker died
    would). The children are forked from a forkserver that has imported this module once
    (and nothing else has run there), so each starts without any process group or mesh and
    without paying torch's import again. ``clean_parent``: this process has itself run nothing
    but imports and reading the config (``meshfold dry-run``); where it also has one thread
    and no process group, the children are forked from it, which saves starting the
    forkserver (a second import of torch and meshfold, about 4 CPU-seconds)."""
    ctx = multiprocessing.get_context("fork" if clean_parent and _fork_is_clean() else "forkserver")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload([__name__])
    else:  # a forked child flushes the stdio buffers it copied: empty them once, here
        sys.stdout.flush()
        sys.stderr.flush()
    out = ctx.Queue()
    results: list = [None] * len(calls)
    pending, running, silent = list(enumerate(calls)), {}, {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                i, args = pending.pop(0)
                proc = ctx.Process(target=_child, args=(out, i, fn, args), daemon=True)
                proc.start()
                running[i] = proc
            try:
                i, ok, value = out.get(timeout=1.0)
            except queue.Empty:
                for i, proc in running.items():
                    # exit code 0: its answer may still be in the pipe; give it a few checks
                    silent[i] = silent.get(i, 0) + (not proc.is_alive())
                    if proc.exitcode not in (0, None) or silent[i] > 5:
                        raise DryRunError(f"dry-run: the process simulating {calls[i][1:]} died with exit code "
                                           f"{proc.exitcode} before answering (out of memory?)")
                continue
            running.pop(i).join()
            if not ok and raise_first:
                raise value
            results[i] = value  # (an exception when not raise_first)
    finally:
        for proc in running.values():
            proc.kill()
    return results


def dry_run(cfg: Config, world: int, cluster: str = "h100", device: str = "cpu", clean_parent: bool = False) -> dict:
    """``device = "cuda"``: the ranks run on fake CUDA tensors and the report adds ``gpu``
    (host syncs, attention kernels, wire dtypes, errors: meshfold/gpucheck.py)."""
    return dry_run_many([(cfg, world)], cluster, device, clean_parent)[0]


def dry_run_many(cases: list[tuple[Config, int]], cluster: str = "h100", device: str = "cpu",
                 clean_parent: bool = False) -> list:
    """``dry_run`` of each (config, world), their simulated ranks sharing one pool of fresh
    processes (as many at a time as this machine has cores). A case that validation
    refuses, or whose simulation fails, is its exception in the list (``dry_run``: raised).
    ``clean_parent``: see ``_in_fresh_processes``."""
    start = time.perf_counter()
    ready, calls = [], []
    for cfg, world in cases:
        try:
            cfg = with_target_numerics(validate(cfg, world), cluster)
            ranks = representative_ranks(cfg, world)
        except ConfigError as e:
            ready.append(e)
            continue
        ready.append((cfg, world, ranks, len(calls)))
        calls += [(cfg, world, r, device) for r in ranks]
    results = _in_fresh_processes(simulate_rank, calls, max(1, min(len(calls), os.cpu_count() or 1)),
                                  raise_first=len(cases) == 1, clean_parent=clean_parent)
    out = []
    for case in ready:
        if isinstance(case, Exception):
            if len(cases) == 1:
                raise case
            out.append(case)
            continue
        cfg, world, ranks, first = case
        mine = results[first:first + len(ranks)]
        failed = next((r for r in mine if isinstance(r, Exception)), None)
        out.append(failed if failed is not None else
                   _report(cfg, world, cluster, dict(zip(ranks, mine)), start, device))
    return out


def _report(cfg: Config, world: int, cluster: str, per_rank: dict, start: float, device: str) -> dict:
    gpu = {"gpu": gpucheck.summary({r: v["gpu"] for r, v in per_rank.items()})} if device == "cuda" else {}
    runtime = {f: max(v[f] for v in per_rank.values()) for f in FIELDS}
    runtime["collectives"] = per_rank[0]["collectives"]
    runtime["ranks"] = {str(r): v for r, v in per_rank.items()}
    layout = dataclasses.asdict(layout_from_config(cfg, world))
    return {"world": world, "layout": layout, "runtime": runtime,
            "planner": planner_prediction(cfg, world, cluster), **gpu,
            "seconds": round(time.perf_counter() - start, 2)}


# --------------------------------------------------------------------------- cli


def add_parser(sub) -> None:
    p = sub.add_parser("dry-run", help="build and step a layout for N ranks on this machine (fake ranks, "
                                       "fake tensors): memory per rank and collectives, next to the planner's")
    p.add_argument("config")
    p.add_argument("--world", type=int, required=True, help="number of ranks (GPUs) to simulate")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--cluster", default="h100", help="planner cluster preset or TOML (default h100)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: fake CUDA tensors; adds host syncs, attention kernels, wire dtypes and errors "
                        "(docs/gpu.md); exit 1 when there are errors")
    p.add_argument("--json", action="store_true")


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:,.4f}"


def run(args: argparse.Namespace) -> int:
    if args.world < 1:
        raise ConfigError(f"--world must be >= 1, got {args.world}")
    cfg = load_config(args.config, args.set)
    if args.device == "cpu":
        cfg.data.balance = "none"  # data placement does not change memory or collectives
    try:
        out = dry_run(cfg, args.world, args.cluster, args.device, clean_parent=True)  # a fresh process
    except DryRunError as e:
        print(f"meshfold: error: {e}", file=sys.stderr)
        return 1
    failed = int(bool(out.get("gpu", {}).get("errors")))
    if args.json:
        print(json.dumps(out))
        return failed
    rt, pl = out["runtime"], out["planner"]
    print(f"dry-run: {args.world} ranks, layout {out['layout']}; simulated ranks {list(rt['ranks'])} "
          f"in {out['seconds']} s")
    print(f"{'per rank (max), GiB':24s} {'runtime':>12s} {'planner':>12s}")
    for f in FIELDS:
        print(f"{f:24s} {_gib(rt[f]):>12s} {_gib(pl[f]):>12s}")
    print(f"{'collectives per step':24s} {'runtime count':>14s} {'runtime GiB':>12s} {'planner count':>14s} "
          f"{'planner GiB':>12s}")
    for d in sorted(set(rt["collectives"]) | set(pl["collectives"])):
        r, p = rt["collectives"].get(d, {}), pl["collectives"].get(d, {})
        print(f"{d:24s} {r.get('count', '-')!s:>14s} {_gib(r.get('bytes')):>12s} {p.get('count', '-')!s:>14s} "
              f"{_gib(p.get('bytes')):>12s}")
    if "gpu" in out:
        g = out["gpu"]
        print(f"gpu: {g['host_syncs_per_step']} host syncs per step (rank 0); attention {g['attention']}; "
              f"wire dtypes {g['wire_dtypes']}")
        for s in g["host_syncs"]:
            print(f"  sync x{s['count']:<4d} {s['where']}")
        for e in g["errors"]:
            print(f"  error: {e}")
    return failed
