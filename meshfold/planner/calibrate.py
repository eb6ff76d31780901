"""``meshfold calibrate``: measure the cluster at hand and write a cluster file.

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
- host_cores = this machine's core count: the processes share them (cost.py uses it for
  pipeline bubbles, which free cores for the busy stages).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from meshfold import comm
from meshfold.config import TrainConfig, from_dict
from meshfold.models.config import ModelConfig
from meshfold.models.llama import Transformer
from meshfold.models.presets import attention_params, mlp_params
from meshfold.parallel.context import ContextParallelAttention, ContextParallelPlan, _MetaCache
from meshfold.planner.cluster import Cluster, Device, cluster_to_toml
from meshfold.planner.cost import CostModel, layout_from_config, workload_from_config
from meshfold.testing import free_port, tiny_config
from meshfold.parallel.optim import _adamw_kwargs
from meshfold.train.trainer import Trainer


BLOCK_DIMS = (16, 64, 256)  # widths of the timed transformer blocks
BLOCK_SEQ, BLOCK_BATCH = 64, 4


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


def _measure(rank: int, world: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    res = {}

    def fixed_reps(fn, reps):
        """Median of a fixed number of calls: fn runs collectives, so every rank must
        call it equally often (a time-based loop would leave ranks mismatched)."""
        fn()
        samples = []
        for _ in range(reps):
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def barrier_time(fn):
        comm.barrier()
        return _timeit(fn)

    # Compute: forward+backward of one real transformer block at three widths, all ranks
    # at once. The tiny one is pure dispatch cost; the other two, less that cost, fix the
    # rate and how it falls off at small widths (-> peak, half width).
    steps = {}
    for dim in BLOCK_DIMS:
        torch.manual_seed(0)
        cfg = ModelConfig(dim=dim, n_layers=1, n_heads=max(2, dim // 32), vocab_size=32, seq_len=BLOCK_SEQ)
        model = Transformer(cfg)
        block = model.layers["0"]
        rope = model._rope(None, BLOCK_SEQ, "cpu")
        x = torch.randn(BLOCK_BATCH, BLOCK_SEQ, dim, requires_grad=True)

        def step(block=block, x=x, rope=rope):
            block(x, rope).sum().backward()

        res[f"block_{dim}"] = barrier_time(step)
        steps[dim] = step
    # Latency of a collective while the ranks are busy computing, as in training: with
    # more processes than cores a woken rank waits for a core (the scheduler's wake-up
    # granularity, ~1 ms here, not the ~50 us of an idle host), once per sequential hop.
    # A small all-reduce between blocks over groups of 2, 4 and everyone, minus the blocks
    # alone; the group sizes separate the per-hop latency from a per-call cost.
    res.update(busy_collective_costs(world, rank, steps[BLOCK_DIMS[1]]))
    # The tiled attention that context parallelism runs: the same attention as one tile
    # and as 36 visible tiles; the difference is the fixed cost of a tile.
    for tile in (BLOCK_SEQ, BLOCK_SEQ // 8):
        res[f"tiled_attention_{tile}"] = barrier_time(tiled_attention_step(tile))
    # memory-bound work: the optimizer pass itself, the training's AdamW over 1M float32
    # parameters (its foreach kernels stream the states several times)
    res["optimizer_step_1m"] = barrier_time(optimizer_step(1 << 20))
    # the framework's fixed cost per optimizer step (data, clipping, optimizer, loss
    # reductions): a real Trainer step of a one-layer model, all ranks data-parallel
    import tempfile

    # DDP, then FSDP2 (the difference prices FSDP's collectives), then DDP with more
    # layers (what a layer costs inside a real step beyond its block: hooks, optimizer and
    # clipping per tensor, autograd bookkeeping), then a two-stage pipeline (what the
    # schedule executor adds per stage operation)
    probes = [("tiny_step_z0", 0, 1, 1), ("tiny_step_z3", 3, 1, 1), ("tiny_step_z0_l3", 0, 3, 1)]
    if world % 2 == 0:
        probes.append(("tiny_step_pp2", 0, 2, 2))
    for key, zero, layers, pp in probes:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = Trainer(from_dict(tiny_step_config(world, tmp, zero, layers, pp)))
            res[key] = fixed_reps(trainer.train_step, 12)
            del trainer
    # all-reduce over everyone: latency and bandwidth
    for size in (2, 1 << 20):  # float32 elements: 8 bytes, 4 MiB
        t = torch.zeros(size, device="cpu")  # these workers run gloo on the host
        samples = []
        for _ in range(10 if size > 2 else 50):
            comm.barrier()
            t0 = time.perf_counter()
            comm.all_reduce(t, None, "calibrate")
            samples.append(time.perf_counter() - t0)
        res[f"ar_{size * 4}"] = min(samples)
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

    ctx = mp.get_context("spawn")
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
    opt = torch.optim.AdamW([{"params": params, "weight_decay": cfg.weight_decay}], **_adamw_kwargs(cfg, "cpu"))
    return opt.step


def tiny_step_config(world: int, run_dir: str, zero: int = 0, layers: int = 1, pp: int = 1) -> dict:
    """A tiny model whose training step is mostly the framework's fixed cost (zero 0: DDP
    over all ranks; zero 3: FSDP2 over all ranks; pp 2: DDP over world/2 two-stage
    pipelines, 1F1B over 4 micro-batches)."""

    parallel = {"dp_replicate": world, "dp_shard": 1, "zero": 0} if zero == 0 else {"dp_shard": world, "zero": zero}
    train = {"global_batch": world, "dtype": "float32", "steps": 1000}
    if pp > 1:
        parallel = {"pp": pp, "dp_replicate": world // pp, "dp_shard": 1, "zero": 0, "pp_schedule": "1f1b",
                    "pp_microbatches": 4}
        train.update(global_batch=4 * (world // pp), micro_batch=1)
    return tiny_config(run_dir, model={"dim": 16, "n_layers": layers, "n_heads": 2, "n_kv_heads": 1, "seq_len": 16},
                       parallel=parallel, train=train)


def block_flops(dim: int) -> float:
    """Forward+backward FLOPs of one calibration block, counted as the cost model does
    (3x forward; no fused attention on CPU, so the whole score matrix)."""

    cfg = ModelConfig(dim=dim, n_layers=1, n_heads=max(2, dim // 32), vocab_size=32, seq_len=BLOCK_SEQ)
    tokens = BLOCK_BATCH * BLOCK_SEQ
    fwd = 2 * (attention_params(cfg) + mlp_params(cfg, cfg.hidden_dim)) * tokens + 4 * tokens * BLOCK_SEQ * dim
    return 3.0 * fwd


def cluster_from_measurements(nproc: int, r: dict, name: str = "calibrated-cpu") -> Cluster:
    """Solve the cost model's own per-layer form, t(w) = overhead + F(w) / (P w / (w + H)),
    for overhead (tiny block), P and H (the two larger blocks)."""
    overhead = r[f"block_{BLOCK_DIMS[0]}"]
    (w1, w2) = BLOCK_DIMS[1:]
    t1 = max(1e-9, r[f"block_{w1}"] - overhead)
    t2 = max(1e-9, r[f"block_{w2}"] - overhead)
    f1, f2 = block_flops(w1), block_flops(w2)
    # t_i = F_i (w_i + H) / (P w_i)  =>  a_i = t_i w_i / F_i = (w_i + H) / P
    a1, a2 = t1 * w1 / f1, t2 * w2 / f2
    if a2 > a1:
        peak = (w2 - w1) / (a2 - a1)
        half = max(0.0, a1 * peak - w1)
    else:  # no fall-off measured: a flat rate
        peak, half = f2 / t2, 0.0
    n = nproc
    a_small, a_big, size = r["ar_8"], r[f"ar_{4 << 20}"], float(4 << 20)
    idle_alpha = a_small / max(1, 2 * (n - 1)) if n > 1 else 1e-4
    # beta from the idle all-reduces (the same conditions as the alpha it subtracts)
    beta = (2 * (n - 1) / n * size) / max(1e-9, a_big - 2 * (n - 1) * idle_alpha) if n > 1 else 1e9
    alpha, call = busy_alpha_and_call(n, r) if n > 1 else (idle_alpha, 0.0)
    tile_us = max(0.0, r[f"tiled_attention_{BLOCK_SEQ // 8}"] - r[f"tiled_attention_{BLOCK_SEQ}"]) / 35 * 1e6
    # the cost model's optimizer pass moves 2 (param + grad + states) bytes per parameter
    optimizer_GBps = 2 * (4 + 4 + 8) * (1 << 20) / r["optimizer_step_1m"] / 1e9
    # a layer inside a real step: its block (the tiny block is nearly all overhead) plus
    # what the step adds per layer, never less than the block alone
    per_layer = max(overhead, (r["tiny_step_z0_l3"] - r["tiny_step_z0"]) / 2)
    device = Device("cpu-calibrated", peak_tflops=peak / 1e12, memory_gib=24.0 / max(1, n),
                    hbm_GBps=optimizer_GBps, matmul_eff=1.0, matmul_half_width=half, reserved_gib=0.3,
                    layer_overhead_us=per_layer * 1e6, attention_tile_us=tile_us)
    # elementwise work is inside the measured block times already: no separate term
    cluster = Cluster(name=name, nodes=1, devices_per_node=n, device=device, intra_node_GBps=beta / 1e9,
                      inter_node_GBps=beta / 1e9, intra_node_alpha_us=alpha * 1e6, inter_node_alpha_us=alpha * 1e6,
                      overlap=0.0, elementwise_traffic=0.0, host_cores=os.cpu_count() or 1,
                      collective_overhead_us=call * 1e6, in_step_alpha_us=idle_alpha * 1e6)
    # what the model does not explain of a real one-layer training step is fixed per step
    def predict(zero: int, fsdp_us: float) -> float:
        return predict_tiny_step(replace(cluster, fsdp_overhead_us=fsdp_us), n, zero)

    if n > 1:  # predicted time is linear in FSDP's per-call cost: solve for it from FSDP - DDP
        calls = predict(3, 1.0) - predict(3, 0.0)  # seconds per us
        excess = (r["tiny_step_z3"] - r["tiny_step_z0"]) - (predict(3, 0.0) - predict(0, 0.0))
        cluster = replace(cluster, fsdp_overhead_us=max(0.0, excess / calls) if calls > 0 else 0.0)
    predicted = predict(0, cluster.fsdp_overhead_us)
    cluster = replace(cluster, step_overhead_s=max(0.0, r["tiny_step_z0"] - predicted))
    if "tiny_step_pp2" in r:  # the executor's cost per stage operation: what the pipeline step leaves
        def predict_pp(op_us: float) -> float:
            return predict_tiny_step(replace(cluster, pipeline_op_us=op_us), n, 0, layers=2, pp=2)

        lo, hi = 0.0, 1e6  # the prediction grows with the op cost: bisect
        if predict_pp(lo) < r["tiny_step_pp2"]:
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if predict_pp(mid) < r["tiny_step_pp2"] else (lo, mid)
        cluster = replace(cluster, pipeline_op_us=lo)
    return cluster


def predict_tiny_step(cluster: Cluster, n: int, zero: int, layers: int = 1, pp: int = 1) -> float:
    """The cost model's step time for one of the tiny calibration steps on ``cluster``."""

    cfg = from_dict(tiny_step_config(n, "unused", zero, layers, pp))
    workload = workload_from_config(cfg, on_gpu=not cluster.device.name.startswith("cpu"))
    return CostModel(workload, cluster).estimate(layout_from_config(cfg, n)).step_time_s


def busy_alpha_and_call(n: int, r: dict) -> tuple[float, float]:
    """(per-hop latency, per-call cost) in seconds from the busy all-reduces: a ring
    all-reduce over g ranks takes 2(g-1) hops, so t(g) = call + 2(g-1) alpha, fitted by
    least squares over the group sizes measured. With one size (n = 2) the call cost
    cannot be told apart and is taken as 0."""
    import numpy as np

    sizes = sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("busy_ar_"))
    hops = np.array([2.0 * (g - 1) for g in sizes])
    t = np.array([max(0.0, r[f"busy_ar_{g}"]) for g in sizes])
    if len(sizes) == 1:
        return float(t[0] / hops[0]), 0.0
    alpha, call = np.polyfit(hops, t, 1)
    if call < 0:  # no per-call cost: a line through the origin
        return float((hops @ t) / (hops @ hops)), 0.0
    return max(0.0, float(alpha)), float(call)


def measurements_path(cluster_path: str | Path) -> Path:
    """Where ``calibrate`` keeps the raw measurements behind a cluster file."""
    return Path(cluster_path).with_suffix(".measurements.json")


def calibrate(nproc: int, out_path: str | Path, step_overhead_s: float | None = None) -> tuple[Cluster, dict]:
    """Measure, solve, and write the cluster file (and its raw measurements beside it, so
    the cluster can be re-derived from them by ``cluster_from_measurements``)."""
    r = measure(nproc)
    raw = measurements_path(out_path)
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps({"nproc": nproc, "measurements": r}, indent=1))
    cluster = cluster_from_measurements(nproc, r)
    if step_overhead_s is not None:
        cluster = replace(cluster, step_overhead_s=step_overhead_s)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(f"# written by `meshfold calibrate --nproc {nproc}` on {time.strftime('%Y-%m-%d %H:%M')}\n"
                        + cluster_to_toml(cluster))
    return cluster, r
