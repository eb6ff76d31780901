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
other dimension) is simulated for each pipeline rank ``s`` of a distinct shape; N ranks never need to exist.

MoE layers route as a perfectly balanced router would (the planner's assumption): fake
tensors carry no routing, so the counts the dispatch needs come from one seam
(``models/moe.py``: ``count_rows`` / ``read_counts``) that gives the balanced counts for
tensors without values and is exactly ``bincount`` / ``tolist`` otherwise.

Next to each simulated rank, the planner's terms for its pipeline rank
(``CostModel.rank_footprints``); each side's ``runtime`` / ``planner`` values are the
largest of each term over the same simulated ranks, and both sides' collectives rank 0's. Both are
for the target's numerics: ``train.dtype = auto`` is resolved for ``--cluster`` (bfloat16 on
a GPU cluster) before the simulation, which itself runs on this CPU. docs/memory.md says
what each side counts and how closely they agree.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
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
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from meshfold import gpucheck
from meshfold.comm import reset_ledger
from meshfold.config import Config, load_config, validate
from meshfold.data.micro import micro_batch_count
from meshfold.dryrun.observer import RowsWithoutCorpus, StepObserver, observe
from meshfold.errors import ConfigError
from meshfold.mesh import build_mesh
from meshfold.parallel.dp.replicate import BUCKET_MB
from meshfold.parallel.pp.stage_modules import stage_split
from meshfold.planner.cli import layout_from_config, workload_from_config
from meshfold.planner.cluster import load_cluster
from meshfold.planner.cost import CostModel
from meshfold.schedules import get_schedule
from meshfold.train.trainer import Surroundings, Trainer

STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")  # a rank's model states
FIELDS = (*STATES, "activation_bytes")


def representative_ranks(cfg: Config, world: int) -> list[int]:
    """Coordinate 0 on every dimension but pp, one rank per distinct pipeline-rank shape
    (the blocks of its chunks by kind, and whether it holds the embedding or the output);
    see the module doc."""
    p, m = cfg.parallel, cfg.model
    per_stage = world // cfg.lowcomm.n_workers // p.pp
    if p.pp == 1:
        return [0]
    split, _ = stage_split(cfg)
    starts = [sum(split[:s]) for s in range(len(split))]
    last, schedule = len(split) - 1, get_schedule(p.pp_schedule)
    seen, ranks = set(), []
    for r in range(p.pp):
        stages = [schedule.stage_of(p.pp, r, c) for c in range(schedule.chunks_per_rank(p.pp_virtual_stages))]
        shape = tuple((tuple(m.is_moe_layer(i) for i in range(starts[s], starts[s] + split[s])), s == 0, s == last)
                      for s in stages)
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


class _NeutralReads(TorchDispatchMode):
    """Host reads of tensors without values (the loss, the NaN guard's norm, the pipeline's
    and context parallel's step statistics) answered with a neutral value (1, 1.0, True),
    as ``--device cuda``'s recorder answers them (meshfold/gpucheck.py): the step runs on
    as a finite one. Entered inside the fake mode, so it sees every op first."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        x = args[0] if args else None
        if func in _READS and isinstance(x, FakeTensor) and x.constant is None:
            return True if x.dtype == torch.bool or func is not _READS[0] else \
                (1.0 if x.dtype.is_floating_point else 1)
        return func(*args, **(kwargs or {}))


_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)


def _as_simulated(cfg: Config, device: str) -> Config:
    """The config the simulated rank's trainer runs: on this CPU, with the batches in the
    observer's hands (no data placement: ``data.balance`` does not change memory or
    collectives) and, except for ``--device cuda``, rows without documents."""
    data = dataclasses.replace(cfg.data, balance="none", doc_mask=cfg.data.doc_mask and device == "cuda")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, device="cpu"), data=data)


def simulate_rank(cfg: Config, world: int, rank: int, device: str = "cpu") -> dict:
    """What global rank ``rank`` of ``world`` holds and sends: the ``Trainer`` built on a
    fake process group and fake tensors, with the observer attached (dryrun/observer.py),
    and its step measured (``_measure``)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        reset_ledger()
        cuda = device == "cuda"  # every op recorded as a CUDA run would do it (meshfold/gpucheck.py)
        cfg = _as_simulated(cfg, device)
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings(), _real_mesh_tensors(), \
                _ddp_without_shape_check(), gpucheck.recording() if cuda else _NeutralReads() as reads:
            warnings.simplefilter("ignore")
            with unset_fake_temporarily():  # the mesh holds real rank tables
                dims = build_mesh(cfg.parallel, cfg.lowcomm.n_workers, "cpu")
            data = types.SimpleNamespace(train=RowsWithoutCorpus(cfg.train.global_batch * cfg.lowcomm.n_workers),
                                         val=None, tokenizer=None)
            with contextlib.redirect_stdout(io.StringIO()):  # stdout carries the report (--json: JSON only)
                trainer = Trainer(cfg, Surroundings(dims=dims, data=data, features=(observe,), collectives_wait=False,
                                                    kernel_device=device))  # cuda: the fused AdamW a GPU rank runs
            observer = trainer.features.of_type(StepObserver)
            gpu = reads if cuda else None  # the CUDA recorder (it answers reads too)
            if gpu is not None:
                gpu.attach(trainer.dims, gpucheck.layer_modules(trainer.model_parts), gpucheck.blocks(trainer.model_parts))
            return _measure(trainer, observer, gpu)
    finally:
        dist.destroy_process_group()


def _measure(trainer: Trainer, observer: StepObserver, gpu) -> dict:
    """Every micro-batch has the same shapes, so a step's collectives are affine in the
    micro-batch count m (per-micro-batch traffic plus once-per-step reductions): two short
    steps with m1 < m2 micro-batches (the fewest the schedule runs, then twice that) give
    the count and bytes for the real m exactly, at the cost of m1 + m2 micro-batches."""
    p = trainer.cfg.parallel
    schedule = get_schedule(p.pp_schedule)
    unit = next(k for k in range(1, p.pp + 1) if schedule.microbatch_problem(p.pp, k) is None)
    step = gpu.stepping(trainer.train_step) if gpu else trainer.train_step

    t = trainer.cfg.train
    m = micro_batch_count(t.global_batch // p.dp, t.micro_batch, p.pp, p.pp_microbatches)  # as the engine cuts

    def run(take):
        observer.take = take
        step()
        metrics = trainer.pop_step_metrics()
        activations = (observer.held_activations(take or m) if observer.pipeline is not None
                       else metrics.get("activation_bytes", 0))
        return observer.collectives, activations, gpu.pop_step() if gpu else None

    if m <= 2 * unit:
        coll, activations, g = run(None)
    else:
        c1, activations, g = run(unit)
        c2, _, g2 = run(2 * unit)  # a fresh batch: fresh tensors, no cache hits
        k = (m - unit) / unit
        coll = {d: {f: int(round(c1.get(d, {}).get(f, 0) + k * (c2.get(d, {}).get(f, 0) - c1.get(d, {}).get(f, 0))))
                    for f in ("count", "bytes")} for d in sorted(set(c1) | set(c2))}
        g = {f: gpucheck.extrapolate(g[f], g2[f], k) for f in g} if gpu else None
    extra = {"gpu": {**g, **gpu.report()}} if gpu else {}
    return {**extra, **observer.state_bytes(), "activation_bytes": int(activations), "collectives": coll,
            "micro_batches": m, "pp_rank": trainer.dims.rank("pp")}


def planner_prediction(cfg: Config, world: int, cluster_spec: str, device: str = "cuda") -> dict:
    """The planner's prediction for this layout (``Estimate.footprint``: per-rank memory,
    max over stages, and rank 0's collectives with call counts), plus its step time and
    peak, and ``pp_ranks``: each pipeline rank's own model states and activations
    (``CostModel.rank_footprints``), in pp coordinate order. Attention is priced as the
    fused kernel (no s x s scores) that the runtime runs on both CPU
    (``_scaled_dot_product_flash_attention_for_cpu``) and GPU; expert groups padded as the
    grouped GEMM of ``device`` (the dry-run's kernel device) pads them."""
    cluster = load_cluster(cluster_spec, devices=world)
    workload = dataclasses.replace(workload_from_config(cfg, cluster), flash=True, aligned_groups=device == "cuda")
    model, layout = CostModel(workload, cluster), layout_from_config(cfg, world)
    est = model.estimate(layout)
    out = {k: int(round(v)) for k, v in est.footprint().items() if k != "collectives"}
    out["collectives"] = {d: {"count": x["count"], "bytes": int(round(x["bytes"]))}
                          for d, x in est.collectives.items()}
    out["step_time_s"], out["peak_mem_bytes"] = est.step_time_s, int(est.peak_mem_bytes)
    out["pp_ranks"] = [{k: int(round(v)) for k, v in rank.items()} for rank in model.rank_footprints(layout)]
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
    # Both sides for the same ranks: each simulated rank's measurement beside the planner's
    # terms for its pipeline rank, and on each side the most of each term over those ranks
    # (like for like, whichever rank holds it); collectives are rank 0's on both sides.
    planner = planner_prediction(cfg, world, cluster, device)
    by_pp = planner.pop("pp_ranks")
    measured = {str(r): v for r, v in per_rank.items()}
    priced = {r: {**by_pp[v["pp_rank"]], "pp_rank": v["pp_rank"]} for r, v in measured.items()}
    runtime = {**_most(measured), "collectives": per_rank[0]["collectives"], "ranks": measured}
    planner.update(_most(priced), ranks=priced)
    layout = dataclasses.asdict(layout_from_config(cfg, world))
    return {"world": world, "layout": layout, "runtime": runtime, "planner": planner, **gpu,
            "seconds": round(time.perf_counter() - start, 2)}


def _most(ranks: dict) -> dict:
    """Each of ``FIELDS``' largest value over ``ranks`` (``{rank: {field: bytes}}``)."""
    return {f: max(v[f] for v in ranks.values()) for f in FIELDS}


# --------------------------------------------------------------------------- cli


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
    print(f"{'GiB, most over the ranks':24s} {'runtime':>12s} {'planner':>12s}")
    for f in FIELDS:
        print(f"{f:24s} {_gib(rt[f]):>12s} {_gib(pl[f]):>12s}")
    if len(rt["ranks"]) > 1:
        for r, v in rt["ranks"].items():
            print(f"rank {r} (pp rank {v['pp_rank']})")
            for f in FIELDS:
                print(f"  {f:22s} {_gib(v[f]):>12s} {_gib(pl['ranks'][r][f]):>12s}")
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
