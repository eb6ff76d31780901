"""``meshfold calibrate``: measure the cluster at hand and write a cluster file (the
solve from measurements to cluster is the planner's pure ``planner/calibrate.py``).

Here the cluster is N gloo processes on this machine, all running at once (they share
the cores, so every number is measured with all N busy):

- compute: forward+backward of one real transformer block (float32, seq 64, batch 4) at
  widths 16, 64 and 256, solved for the cost model's per-layer form
  t(w) = overhead + F(w) / (P * w / (w + H)): the width-16 block is almost pure dispatch
  cost, the other two give P (-> ``peak_tflops``,
  ``matmul_eff`` = 1) and H (-> ``matmul_half_width``); elementwise work is inside these
  times, so ``elementwise_traffic`` = 0;
- memory-bound work: the training's AdamW step over 1M float32 parameters, as the
  bandwidth at which the cost model's optimizer pass (2 x 16 bytes a parameter) takes that
  long (-> ``hbm_GBps``);
- fixed cost per step: a real ``Trainer.train_step`` of a one-layer model on all N ranks
  with DDP, minus what the model predicts for it (-> ``step_overhead_s``); with three
  layers, what one more layer adds to a real step (-> ``layer_overhead_us``: the block's
  dispatch plus the step's per-layer hooks, optimizer and clipping work); the same step with
  FSDP2 (ZeRO-3) prices FSDP's own work per collective (hooks, copy-in/out): the measured
  FSDP - DDP difference beyond the predicted one, over FSDP's collective calls
  (-> ``fsdp_overhead_us``); and a two-stage 1F1B pipeline, whose time beyond the
  prediction is the schedule executor's fixed work per stage operation (-> ``pipeline_op_us``);
- links: all-reduce time at 8 bytes and at 4 MiB over all N idle ranks, solved for the
  alpha-beta model t = 2(n-1) alpha + 2(n-1)/n S / beta (-> ``intra_node_GBps``, and the
  idle alpha as ``in_step_alpha_us``, for reductions whose ranks arrive in step); and a
  small all-reduce between compute blocks, over groups of 2, 4 and all N ranks, minus the
  blocks alone: the latency of one hop while the ranks are busy, as they are in training
  (-> ``intra_node_alpha_us``; with more processes than cores it is the scheduler's
  wake-up delay, ~1 ms, twenty times the idle figure) and a cost per call
  (-> ``collective_overhead_us``);
- the tiled attention context parallelism runs, on one rank, as 1 tile and as 36 visible
  tiles (-> ``attention_tile_us``);
- overlap = 0: gloo's progress threads compete with compute for the same cores;
- host_cores = this machine's core count: the processes share them (planner/pipeline.py uses it for
  pipeline bubbles, which free cores for the busy stages).

``meshfold calibrate --gpu PRESET`` measures one GPU instead and keeps PRESET's datasheet
figures and links: square bf16 GEMMs of 4096-16384 (the fastest over the preset's peak ->
``matmul_eff``, as ``mamf-finder.py`` measures MAMF), a 1 GiB device copy (-> ``hbm_eff``),
causal ``scaled_dot_product_attention`` forward and backward at 32 heads x 8192 x 128
(-> ``attention_eff``, ``attention_bwd_eff``); the solve is ``planner/calibrate.py:
gpu_device_from_measurements``.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from meshfold import comm
from meshfold.config import ConfigError, ModelConfig, TrainConfig, from_dict
from meshfold.models.llama import Transformer
from meshfold.parallel.cp.attention import ContextParallelAttention, _MetaCache
from meshfold.parallel.cp.groups import ContextParallelPlan
from meshfold.optim.adamw import adamw_kwargs
from meshfold.planner.calibrate import (
    BLOCK_BATCH,
    BLOCK_DIMS,
    BLOCK_SEQ,
    GPU_ATTENTION,
    GPU_COPY_BYTES,
    GPU_GEMM_SIZES,
    gpu_device_from_measurements,
    measurements_path,
    tiny_step_config,
    write_cluster,
)
from meshfold.planner.cluster import Cluster, cluster_to_toml, load_cluster
from meshfold.testing import free_port
from meshfold.train.trainer import Trainer


def _timeit(fn, min_time: float = 1.0, reps_min: int = 5) -> float:
    """Median seconds per call while every rank runs the same loop: the processes share
    the cores the way training steps do (a minimum would catch moments when a process
    briefly had a core to itself and overstate the rate)."""
    fn()
    samples = []
    start = time.perf_counter()
    while len(samples) < reps_min or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _fixed_reps(fn, reps: int) -> float:
    """Median of a fixed number of calls: fn runs collectives, so every rank must call it
    equally often (a time-based loop would leave ranks mismatched)."""
    fn()
    samples = []
    for _ in range(reps):
        comm.barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _barrier_time(fn) -> float:
    comm.barrier()
    return _timeit(fn)


def _block_steps() -> dict:
    """Forward+backward of one real transformer block at each of BLOCK_DIMS, as callables."""
    import torch

    steps = {}
    for dim in BLOCK_DIMS:
        torch.manual_seed(0)
        cfg = ModelConfig(dim=dim, n_layers=1, n_heads=max(2, dim // 32), vocab_size=32, seq_len=BLOCK_SEQ)
        model = Transformer(cfg)
        block = model.layers["0"]
        rope = model.rope_cos[:BLOCK_SEQ].unsqueeze(0), model.rope_sin[:BLOCK_SEQ].unsqueeze(0)
        x = torch.randn(BLOCK_BATCH, BLOCK_SEQ, dim, requires_grad=True)

        def step(block=block, x=x, rope=rope):
            block(x, rope).sum().backward()

        steps[dim] = step
    return steps


def _trainer_step_costs(world: int) -> dict:
    """The framework's fixed cost per optimizer step (data, clipping, optimizer, loss
    reductions): real Trainer steps of tiny models, all ranks data-parallel. DDP, then
    FSDP2 (the difference prices FSDP's collectives), then DDP with more layers (what a
    layer costs inside a real step beyond its block: hooks, optimizer and clipping per
    tensor, autograd bookkeeping), then a two-stage pipeline (what the schedule executor
    adds per stage operation)."""
    import tempfile

    res = {}
    probes = [("tiny_step_z0", 0, 1, 1), ("tiny_step_z3", 3, 1, 1), ("tiny_step_z0_l3", 0, 3, 1)]
    if world % 2 == 0:
        probes.append(("tiny_step_pp2", 0, 2, 2))
    for key, zero, layers, pp in probes:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(from_dict(tiny_step_config(world, tmp, zero, layers, pp)))
            res[key] = _fixed_reps(trainer.train_step, 12)
            del trainer
    return res


def _all_reduce_costs() -> dict:
    """All-reduce over everyone: the fastest of several calls at 8 bytes and 4 MiB."""
    import torch

    res = {}
    for size in (2, 1 << 20):  # float32 elements: 8 bytes, 4 MiB
        t = torch.zeros(size, device="cpu")  # these workers run gloo on the host
        samples = []
        for _ in range(10 if size > 2 else 50):
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(t, None, "calibrate")
            samples.append(time.perf_counter() - t0)
        res[f"ar_{size * 4}"] = min(samples)
    return res


def _measure(rank: int, world: int, port: int, out) -> None:
    """One calibration process: every probe, in the same order on every rank (they run
    collectives), then the results gathered onto rank 0."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    # Compute: one block at three widths, all ranks at once. The tiny one is pure dispatch
    # cost; the other two, less that cost, fix the rate and how it falls off at small widths
    # (-> peak, half width).
    steps = _block_steps()
    res = {f"block_{dim}": _barrier_time(step) for dim, step in steps.items()}
    # Latency of a collective while the ranks are busy computing, as in training: with
    # more processes than cores a woken rank waits for a core (the scheduler's wake-up
    # granularity, ~1 ms here, not the ~50 us of an idle host), once per sequential hop.
    # A small all-reduce between blocks over groups of 2, 4 and everyone, minus the blocks
    # alone; the group sizes separate the per-hop latency from a per-call cost.
    res.update(busy_collective_costs(world, rank, steps[BLOCK_DIMS[1]]))
    # The tiled attention that context parallelism runs: the same attention as one tile
    # and as 36 visible tiles; the difference is the fixed cost of a tile.
    for tile in (BLOCK_SEQ, BLOCK_SEQ // 8):
        res[f"tiled_attention_{tile}"] = _barrier_time(tiled_attention_step(tile))
    # memory-bound work: the optimizer pass itself, the training's AdamW over 1M float32
    # parameters (its foreach kernels stream the states several times)
    res["optimizer_step_1m"] = _barrier_time(optimizer_step(1 << 20))
    res.update(_trainer_step_costs(world))
    res.update(_all_reduce_costs())
    gathered = comm.all_gather_object(res)
    if rank == 0:
        out.put(gathered)
    comm.barrier()
    dist.destroy_process_group()


def tiled_attention_step(tile: int):
    """Forward + backward of context parallelism's tiled attention on this rank alone
    (cp = 1), width 64 (2 heads of 32), at ``tile`` tokens per tile."""
    import torch

    plan = ContextParallelPlan(1, 1, False, 0, None, None, None, tile=tile)
    attn = ContextParallelAttention(plan, _MetaCache(plan))
    q, k, v = (torch.randn(BLOCK_BATCH, BLOCK_SEQ, 2, 32, requires_grad=True) for _ in range(3))

    def step():
        attn(q, k, v).sum().backward()

    return step


def busy_collective_costs(world: int, rank: int, compute, iters: int = 30, rounds: int = 5) -> dict:
    """Seconds one small all-reduce adds to a loop of ``compute`` calls on every rank, over
    groups of 2 and 4 consecutive ranks (where they tile the world) and of all ranks
    (``busy_ar_<size>``); medians over rounds."""
    import torch
    import torch.distributed as dist

    groups = {world: None}
    for size in (2, 4):
        if size < world and world % size == 0:
            for start in range(0, world, size):  # every rank creates every group, in order
                group = dist.new_group(list(range(start, start + size)))
                if start <= rank < start + size:
                    groups[size] = group
    buf = torch.zeros(1024, device="cpu")

    def loop(group_size):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            compute()
            if group_size:
                comm.all_reduce(buf, groups[group_size], "calibrate")
        comm.barrier()
        return (time.perf_counter() - t0) / iters

    samples: dict[str, list] = {}
    for _ in range(rounds):
        base = loop(0)
        for g in groups:
            samples.setdefault(f"busy_ar_{g}", []).append(loop(g) - base)
    return {k: statistics.median(v) for k, v in samples.items()}


def measure(nproc: int) -> dict:
    """Run the measurements on ``nproc`` gloo processes; per-quantity medians over ranks."""
    import multiprocessing as mp

    # Forked from a forkserver that imported this module (torch, the trainer) once: nproc
    # spawned processes would each import them again (about 4 CPU-seconds each), and a test
    # session's server (meshfold/testing.py's) is already running.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_measure, args=(r, nproc, port, out)) for r in range(nproc)]
    for p in procs:
        p.start()
    try:
        import queue

        deadline = time.time() + 300
        while True:
            try:
                gathered = out.get(timeout=1)
                break
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) or time.time() > deadline:
                    raise RuntimeError("calibration processes failed; see their output above") from None
    finally:
        for p in procs:
            p.join(timeout=60)
    return {k: statistics.median(r[k] for r in gathered) for k in gathered[0]}


def optimizer_step(numel: int):
    """One AdamW step (the training's settings on CPU) over ``numel`` float32 parameters."""
    import torch

    params = [torch.nn.Parameter(torch.randn(numel // 4)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    cfg = TrainConfig()
    opt = torch.optim.AdamW([{"params": params, "weight_decay": cfg.weight_decay}], **adamw_kwargs(cfg, "cpu"))
    return opt.step


def calibrate(nproc: int, out_path: str | Path, step_overhead_s: float | None = None) -> tuple[Cluster, dict]:
    """Measure, solve, and write the cluster file (and its raw measurements beside it, so
    the cluster can be re-derived from them by ``cluster_from_measurements``)."""
    r = measure(nproc)
    return write_cluster(nproc, r, out_path, step_overhead_s), r


# --------------------------------------------------------------------------- one GPU


def _cuda_seconds(fn, reps: int = 20) -> float:
    """Median seconds per call of ``fn`` on the current CUDA device (CUDA events, after
    warm-up), the way ``mamf-finder.py`` times its GEMMs."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_gpu() -> dict:
    """Seconds per call of the kernels ``planner/calibrate.py: gpu_device_from_measurements``
    solves for: bf16 GEMMs, a device copy, causal fused attention forward and backward."""
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise ConfigError("meshfold calibrate --gpu needs a CUDA (or ROCm) device; none is visible")
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    r = {}
    for n in GPU_GEMM_SIZES:
        a, b = torch.randn(n, n, device=dev, dtype=bf16), torch.randn(n, n, device=dev, dtype=bf16)
        r[f"gemm_{n}"] = _cuda_seconds(lambda a=a, b=b: a @ b)
        del a, b
    x = torch.empty(GPU_COPY_BYTES // 2, device=dev, dtype=bf16).normal_()
    y = torch.empty_like(x)
    r["copy"] = _cuda_seconds(lambda x=x, y=y: y.copy_(x))
    del x, y
    g = GPU_ATTENTION
    shape = (g["batch"], g["heads"], g["seq"], g["head_dim"])
    q, k, v = (torch.randn(shape, device=dev, dtype=bf16, requires_grad=True) for _ in range(3))
    r["attention_fwd"] = _cuda_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    r["attention_bwd"] = _cuda_seconds(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
    return r


def calibrate_gpu(preset: str, out_path: str | Path) -> Cluster:
    """Measure this machine's first GPU, put its efficiencies into ``preset``'s cluster, and
    write the cluster file (and the raw measurements beside it)."""
    cluster = load_cluster(preset)
    r = measure_gpu()
    device = gpu_device_from_measurements(cluster.device, r)
    cluster = replace(cluster, device=device, name=f"{cluster.name}-calibrated")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    measurements_path(out_path).write_text(json.dumps({"preset": preset, "measurements": r}, indent=1))
    out_path.write_text(f"# written by `meshfold calibrate --gpu {preset}` on "
                        f"{time.strftime('%Y-%m-%d %H:%M')}\n" + cluster_to_toml(cluster))
    return cluster


# --------------------------------------------------------------------------- command


def run(args) -> int:
    if args.gpu:
        out = args.out or "cluster-gpu.toml"
        d = calibrate_gpu(args.gpu, out).device
        print(f"{d.name}: GEMM {100 * d.matmul_eff:.1f}% of {d.peak_tflops:g} TF, HBM {100 * d.hbm_eff:.1f}% of "
              f"{d.hbm_GBps:g} GB/s, fused attention {100 * d.attention_eff:.1f}% / {100 * d.attention_bwd_eff:.1f}%")
        print(f"wrote {out}", file=sys.stderr)
        return 0
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")
    out = args.out or f"cluster-cpu-{args.nproc}.toml"
    cluster, raw = calibrate(args.nproc, out)
    d = cluster.device
    print(f"{args.nproc} gloo processes: GEMM {d.peak_tflops * 1e3:.3g} GFLOP/s/process (half width "
          f"{d.matmul_half_width:.3g}), memory {d.hbm_GBps:.3g} GB/s, layer overhead {d.layer_overhead_us:.0f} us, "
          f"all-reduce alpha {cluster.intra_node_alpha_us:.0f} us beta {cluster.intra_node_GBps:.3g} GB/s")
    print(f"wrote {out}", file=sys.stderr)
    return 0
