"""``meshfold calibrate``: measure the cluster at hand and write a cluster file.

Here the cluster is N gloo processes on this machine, all running at once (they share
the cores, so every number is measured with all N busy):

- compute: float32 GEMM rate at a large width (-> ``peak_tflops``, ``matmul_eff`` = 1)
  and at a small width (-> ``matmul_half_width`` from eff(w) = w / (w + H));
- memory bandwidth: an elementwise add over large tensors (-> ``hbm_GBps``);
- per-layer fixed cost: forward+backward of a 4-layer minus a 2-layer tiny Transformer
  (-> ``layer_overhead_us``: dispatch cost, which dominates tiny models on CPU);
- links: all-reduce time at 8 bytes and at 4 MiB over all N ranks, solved for the
  alpha-beta model t = 2(n-1) alpha + 2(n-1)/n S / beta (-> ``intra_node_alpha_us``,
  ``intra_node_GBps``);
- overlap = 0: gloo's progress threads compete with compute for the same cores.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

from meshfold.planner.cluster import Cluster, Device, cluster_to_toml


def _timeit(fn, min_time: float = 0.3, reps_min: int = 3) -> float:
    """Median seconds per call over repeated batches."""
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

    from meshfold.config import ModelConfig
    from meshfold.models.llama import Transformer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    res = {}

    def barrier_time(fn):
        dist.barrier()
        return _timeit(fn)

    # GEMMs: rate at a large and a small width (1024 tokens), each sample ~the same FLOPs
    for width in (512, 64):
        a, b = torch.randn(1024, width), torch.randn(width, width)
        reps = max(1, (512 * 512) // (width * width))

        def gemms(a=a, b=b, reps=reps):
            for _ in range(reps):
                a @ b

        res[f"gemm_{width}"] = reps * 2 * 1024 * width * width / barrier_time(gemms)
    # elementwise bandwidth: read two, write one
    x, y = torch.randn(4_000_000), torch.randn(4_000_000)
    res["bandwidth"] = 3 * 4 * x.numel() / barrier_time(lambda: x.add_(y))
    # per-layer fixed cost of a tiny model's forward + backward
    times = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(dim=16, n_layers=layers, n_heads=2, vocab_size=32, seq_len=8))
        tokens = torch.randint(0, 32, (1, 8))

        def step():
            model(tokens).sum().backward()

        times[layers] = barrier_time(step)
    res["layer_s"] = max(1e-7, (times[4] - times[2]) / 2)
    # all-reduce over everyone: latency and bandwidth
    for size in (2, 1 << 20):  # float32 elements: 8 bytes, 4 MiB
        t = torch.zeros(size)
        samples = []
        for _ in range(10 if size > 2 else 50):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - t0)
        res[f"ar_{size * 4}"] = statistics.median(samples)
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        out.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def measure(nproc: int) -> dict:
    """Run the measurements on ``nproc`` gloo processes; per-quantity medians over ranks."""
    import multiprocessing as mp

    from meshfold.testing import free_port

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


def cluster_from_measurements(nproc: int, r: dict, name: str = "calibrated-cpu") -> Cluster:
    big, small = r["gemm_512"], r["gemm_64"]
    # eff(w) = w / (w + H) relative to the large-width rate: small/big = (64/(64+H)) / (512/(512+H))
    ratio = min(0.999, small / big)
    half = max(0.0, 64 * 512 * (1 - ratio) / (512 * ratio - 64)) if 512 * ratio > 64 else 512.0
    peak = big * (512 + half) / 512  # the asymptotic rate the efficiency curve is relative to
    n = nproc
    a_small, a_big, size = r["ar_8"], r[f"ar_{4 << 20}"], float(4 << 20)
    alpha = a_small / max(1, 2 * (n - 1)) if n > 1 else 1e-4
    beta = (2 * (n - 1) / n * size) / max(1e-9, a_big - 2 * (n - 1) * alpha) if n > 1 else 1e9
    device = Device("cpu-calibrated", peak_tflops=peak / 1e12, memory_gib=24.0 / max(1, n), hbm_GBps=r["bandwidth"] / 1e9,
                    matmul_eff=1.0, matmul_half_width=half, reserved_gib=0.3, layer_overhead_us=r["layer_s"] * 1e6)
    return Cluster(name=name, nodes=1, devices_per_node=n, device=device, intra_node_GBps=beta / 1e9,
                   inter_node_GBps=beta / 1e9, intra_node_alpha_us=alpha * 1e6, inter_node_alpha_us=alpha * 1e6,
                   overlap=0.0)


def calibrate(nproc: int, out_path: str | Path, step_overhead_s: float | None = None) -> tuple[Cluster, dict]:
    r = measure(nproc)
    cluster = cluster_from_measurements(nproc, r)
    if step_overhead_s is not None:
        cluster = replace(cluster, step_overhead_s=step_overhead_s)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(f"# written by `meshfold calibrate --nproc {nproc}` on {time.strftime('%Y-%m-%d %H:%M')}\n"
                        + cluster_to_toml(cluster))
    return cluster, r
