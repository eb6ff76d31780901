"""``meshfold calibrate``'s solve, pure (no torch, no trainer): from the measurements
that ``meshfold/calibration.py`` takes on N gloo processes to a cluster file, through the
cost model's own forms (so a measured quantity round-trips exactly).

What is measured, and which cluster field each measurement fixes, is listed in
``meshfold/calibration.py``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from meshfold.config import ModelConfig, from_dict
from meshfold.models.counts import attention_params, mlp_params
from meshfold.planner.cluster import Cluster, Device, cluster_to_toml
from meshfold.planner.cost import CostModel
from meshfold.planner.from_config import layout_from_config, workload_from_config

BLOCK_DIMS = (16, 64, 256)  # widths of the timed transformer blocks
BLOCK_SEQ, BLOCK_BATCH = 64, 4


def tiny_step_config(world: int, run_dir: str, zero: int = 0, layers: int = 1, pp: int = 1) -> dict:
    """A tiny model whose training step is mostly the framework's fixed cost (zero 0: DDP
    over all ranks; zero 3: FSDP2 over all ranks; pp 2: DDP over world/2 two-stage
    pipelines, 1F1B over 4 micro-batches). The calibration runs it (``meshfold/calibration.py``)
    and the solve predicts it (``predict_tiny_step``)."""
    parallel = {"dp_replicate": world, "dp_shard": 1, "zero": 0} if zero == 0 else {"dp_shard": world, "zero": zero}
    train = {"steps": 1000, "global_batch": world, "lr": 1e-2, "dtype": "float32", "run_dir": run_dir,
             "progress": False, "tensorboard": False, "warmup_steps": 1}
    if pp > 1:
        parallel = {"pp": pp, "dp_replicate": world // pp, "dp_shard": 1, "zero": 0, "pp_schedule": "1f1b",
                    "pp_microbatches": 4}
        train.update(global_batch=4 * (world // pp), micro_batch=1)
    return {"model": {"dim": 16, "n_layers": layers, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 320, "seq_len": 16},
            "parallel": parallel, "train": train, "data": {"max_docs": 40, "val_docs": 0}}


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
    idle_alpha = max(LATENCY_FLOOR_S, a_small / max(1, 2 * (n - 1))) if n > 1 else 1e-4
    # beta from the idle all-reduces (the same conditions as the alpha it subtracts)
    beta = (2 * (n - 1) / n * size) / max(1e-9, a_big - 2 * (n - 1) * idle_alpha) if n > 1 else 1e9
    alpha, call = busy_alpha_and_call(n, r) if n > 1 else (idle_alpha, 0.0)
    alpha = max(LATENCY_FLOOR_S, alpha)
    tile_us = max(0.0, r[f"tiled_attention_{BLOCK_SEQ // 8}"] - r[f"tiled_attention_{BLOCK_SEQ}"]) / 35 * 1e6
    # the cost model's optimizer pass moves 2 (param + grad + states) bytes per parameter
    optimizer_GBps = 2 * (4 + 4 + 8) * (1 << 20) / r["optimizer_step_1m"] / 1e9
    # a layer inside a real step: its block (the tiny block is nearly all overhead) plus
    # what the step adds per layer, never less than the block alone
    per_layer = max(overhead, (r["tiny_step_z0_l3"] - r["tiny_step_z0"]) / 2)
    device = Device("cpu-calibrated", peak_tflops=peak / 1e12, memory_gib=24.0 / max(1, n),
                    hbm_GBps=optimizer_GBps, matmul_eff=1.0, matmul_half_width=half, reserved_gib=0.3,
                    layer_overhead_us=per_layer * 1e6, attention_tile_us=tile_us, hbm_eff=1.0, gemm_tile=0)
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
    w = workload_from_config(cfg, on_gpu=False)  # the calibration runs gloo processes on the host
    return CostModel(w, cluster).estimate(layout_from_config(cfg, n)).step_time_s


# A latency measured as a difference of two loops can come out at or below zero when the
# host is busy (the noise exceeds a hop); a hop is never free, so such a fit is read as
# "below what this machine resolves": 1 us, a shared-memory hop's order.
LATENCY_FLOOR_S = 1e-6


def busy_alpha_and_call(n: int, r: dict) -> tuple[float, float]:
    """(per-hop latency, per-call cost) in seconds from the busy all-reduces: a ring
    all-reduce over g ranks takes 2(g-1) hops, so t(g) = call + 2(g-1) alpha, fitted by
    least squares over the group sizes measured. With one size (n = 2) the call cost
    cannot be told apart and is taken as 0."""
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


def write_cluster(nproc: int, r: dict, out_path: str | Path, step_overhead_s: float | None = None) -> Cluster:
    """Solve ``r`` into a cluster and write it to ``out_path`` (and the raw measurements
    beside it, so the cluster can be re-derived by ``cluster_from_measurements``)."""
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
    return cluster


# --------------------------------------------------------------------------- one GPU

# The kernels ``meshfold calibrate --gpu`` times on one accelerator (``meshfold/calibration.py``):
# square bf16 GEMMs (the largest rate is the device's MAMF, as ``mamf-finder.py`` defines it),
# a device-to-device copy, and causal fused attention forward and backward at a training shape.
GPU_GEMM_SIZES = (4096, 8192, 16384)
GPU_COPY_BYTES = 1 << 30
GPU_ATTENTION = dict(batch=1, heads=32, seq=8192, head_dim=128)


def gpu_attention_flops() -> float:
    """Forward FLOPs of the timed causal attention, counted as the cost model counts them
    (QK^T and AV, half of the score matrix under the causal mask)."""
    a = GPU_ATTENTION
    return 4 * a["batch"] * a["seq"] ** 2 * a["heads"] * a["head_dim"] * 0.5


def gpu_device_from_measurements(base: Device, r: dict) -> Device:
    """A device preset's efficiencies replaced by one GPU's measurements (seconds per call):
    ``matmul_eff`` = the fastest square GEMM's rate over the preset's peak, ``hbm_eff`` = the
    copy's bandwidth (read + write) over ``hbm_GBps``, ``attention_eff`` and
    ``attention_bwd_eff`` = fused attention's forward and backward rates (backward: 2.5x the
    forward FLOPs) over the peak. The datasheet figures (peak, memory, HBM) stay the preset's."""
    peak = base.peak_tflops * 1e12
    gemm = max(2.0 * n**3 / r[f"gemm_{n}"] for n in GPU_GEMM_SIZES if f"gemm_{n}" in r)
    f = gpu_attention_flops()
    return replace(base, name=f"{base.name}-calibrated", matmul_eff=min(1.0, gemm / peak),
                   hbm_eff=min(1.0, 2 * GPU_COPY_BYTES / r["copy"] / (base.hbm_GBps * 1e9)),
                   attention_eff=min(1.0, f / r["attention_fwd"] / peak),
                   attention_bwd_eff=min(1.0, 2.5 * f / r["attention_bwd"] / peak))
