"""``meshfold calibrate``: the solve from measurements to a cluster file (exact round trips
through the cost model's own forms), the cost terms it feeds, and one real calibration
on 2 gloo processes."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from meshfold.calibration import calibrate
from meshfold.config import from_dict
from meshfold.planner.calibrate import (BLOCK_SEQ, LATENCY_FLOOR_S, busy_alpha_and_call, cluster_from_measurements,
                                        measurements_path, tiny_step_config)
from meshfold.planner.cli import layout_from_config, workload_from_config
from meshfold.planner.cluster import cluster_from_dict, cluster_to_toml, load_cluster
from meshfold.planner.cost import STEPS, CostModel, Layout, Workload
from meshfold.planner.kernels import attention_tiles_per_rank, collective_time
from meshfold.models.presets import preset


def synthetic_measurements(n: int, alpha: float, call: float, sizes=(2, 4)) -> dict:
    """Measurements as a host with these busy-hop and per-call costs would give them."""
    r = {"block_16": 1.5e-3, "block_64": 6e-3, "block_256": 3e-2, "optimizer_step_1m": 2e-3,
         "tiny_step_z0_l3": 0.03 + 2 * 2e-3, "tiny_step_pp2": 0.1,
         "tiled_attention_64": 1.6e-3, "tiled_attention_8": 1.6e-3 + 35 * 5e-4,
         "ar_8": 2 * (n - 1) * 5e-5, "ar_4194304": 6e-3, "tiny_step_z0": 0.03, "tiny_step_z3": 0.08}
    for g in [s for s in sizes if s < n and n % s == 0] + [n]:
        r[f"busy_ar_{g}"] = call + 2 * (g - 1) * alpha
    return r


def same_cluster(a, b) -> bool:
    """Equal in every number (a file names neither the cluster nor its device)."""
    return a == replace(b, name=a.name, device=replace(b.device, name=a.device.name))


@pytest.mark.parametrize("n,sizes", [(2, ()), (4, (2,)), (8, (2, 4))])
def test_busy_fit_recovers_hop_latency_and_call_cost(n, sizes):
    alpha, call = 1.1e-3, 4e-4
    r = synthetic_measurements(n, alpha, call if sizes else 0.0, sizes)
    got_alpha, got_call = busy_alpha_and_call(n, r)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    assert got_call == pytest.approx(call if sizes else 0.0, abs=1e-12)


def test_latencies_lost_in_a_busy_hosts_noise_are_floored_not_zero():
    """Under load the busy all-reduce can time at or below its compute-only loop: the hop is
    then below what the host resolves, which the cluster file records as the floor, not 0."""
    r = synthetic_measurements(2, -1e-5, 0.0, ())
    r["ar_8"] = -2e-6
    c = cluster_from_measurements(2, r)
    assert c.intra_node_alpha_us == pytest.approx(LATENCY_FLOOR_S * 1e6)
    assert c.in_step_alpha_us == pytest.approx(LATENCY_FLOOR_S * 1e6)


def test_busy_fit_never_returns_a_negative_call_cost():
    # noisy pairs slower than the line through the larger groups: fit through the origin
    r = {"busy_ar_2": 1e-3, "busy_ar_4": 5e-3, "busy_ar_8": 1.4e-2}
    alpha, call = busy_alpha_and_call(8, r)
    assert call == 0.0 and alpha > 0


def _tiny_prediction(cluster, n, zero, layers=1, pp=1):
    cfg = from_dict(tiny_step_config(n, "unused", zero, layers, pp))
    return CostModel(workload_from_config(cfg, cluster), cluster).estimate(layout_from_config(cfg, n)).step_time_s


@pytest.mark.parametrize("n", [2, 4, 8])
def test_cluster_from_measurements_round_trips_through_the_cost_model(n):
    call = 3e-4 if n > 2 else 0.0  # one group size cannot separate a call cost
    r = synthetic_measurements(n, 1e-3, call)
    c = cluster_from_measurements(n, r)
    # the per-tile cost of the tiled attention and the in-step hop latency, as measured
    assert c.device.attention_tile_us == pytest.approx(5e-4 * 1e6)
    assert c.in_step_alpha_us == pytest.approx(50.0)
    assert c.intra_node_alpha_us == pytest.approx(1e3)
    assert c.collective_overhead_us == pytest.approx(call * 1e6, abs=1e-6)
    # the tiny DDP step is reproduced exactly (the step overhead absorbs the rest), and the
    # FSDP step too (FSDP's per-call cost absorbs the difference)
    assert _tiny_prediction(c, n, 0) == pytest.approx(r["tiny_step_z0"], rel=1e-9)
    assert c.fsdp_overhead_us > 0
    assert _tiny_prediction(c, n, 3) == pytest.approx(r["tiny_step_z3"], rel=1e-9)
    # and the pipeline step too (the executor's per-operation cost absorbs the difference)
    assert c.pipeline_op_us > 0
    assert _tiny_prediction(c, n, 0, layers=2, pp=2) == pytest.approx(r["tiny_step_pp2"], rel=1e-9)
    # a layer costs what it adds to a real step; the optimizer pass takes what it measured
    assert c.device.layer_overhead_us == pytest.approx(2e-3 * 1e6)
    assert c.device.hbm_GBps == pytest.approx(32 * (1 << 20) / 2e-3 / 1e9)
    # the file round-trips
    again = cluster_from_dict(tomllib.loads(cluster_to_toml(c))["cluster"], name=c.name)
    assert same_cluster(again, c)


def test_tile_cost_enters_context_parallel_layers_only():
    m = replace(preset("debug"), n_layers=4)
    w = Workload(model=m, global_batch=8, dtype="float32", flash=False)
    base = cluster_from_dict({"preset": "cpu-gloo"})
    tiled = replace(base, device=replace(base.device, attention_tile_us=100.0))
    for cp, mode, ring in ((2, "ring", 2), (4, "ring", 4), (4, "ulysses", 1)):
        lay = Layout(dp_shard=1, cp=cp, cp_mode=mode, micro_batch=8)
        extra = CostModel(w, tiled).estimate(lay).step_time_s - CostModel(w, base).estimate(lay).step_time_s
        tiles = attention_tiles_per_rank(cp, ring)
        assert extra == pytest.approx(m.n_layers * tiles * 100e-6, rel=1e-9)
    lay = Layout(dp_replicate=2, micro_batch=4)
    assert CostModel(w, tiled).estimate(lay).step_time_s == CostModel(w, base).estimate(lay).step_time_s
    # 8 tiles a side at cp <= 4 (36 visible); 16 at cp = 8 (136), split over the ring
    assert attention_tiles_per_rank(2, 2) == 18 and attention_tiles_per_rank(8, 8) == 17


def test_all_to_all_latency_grows_with_log_of_group():
    c = replace(cluster_from_dict({"preset": "cpu-gloo"}), intra_node_alpha_us=1000.0)
    t = {n: collective_time(c, "all_to_all", 0.0 + 1e-9, n, 1) for n in (2, 4, 8)}
    assert [STEPS["all_to_all"](n) for n in (2, 4, 8)] == [1, 2, 3]
    assert t[8] == pytest.approx(3e-3, rel=1e-3) and t[2] == pytest.approx(1e-3, rel=1e-3)
    assert STEPS["all_reduce"](8) == 14 and math.isclose(STEPS["all_gather"](8), 7)


def test_calibrate_two_gloo_processes(tmp_path):
    out = tmp_path / "cpu.toml"
    cluster, r = calibrate(2, out)
    loaded = load_cluster(out)
    assert same_cluster(loaded, cluster)
    for value in (loaded.device.peak_tflops, loaded.device.hbm_GBps, loaded.intra_node_GBps,
                  loaded.intra_node_alpha_us, loaded.in_step_alpha_us):
        assert math.isfinite(value) and value > 0
    assert loaded.host_cores >= 1 and loaded.devices_per_node == 2
    saved = json.loads(measurements_path(out).read_text())
    assert saved["nproc"] == 2 and saved["measurements"] == pytest.approx(r)
    assert f"tiled_attention_{BLOCK_SEQ // 8}" in r and "busy_ar_2" in r and "tiny_step_pp2" in r
    # re-deriving from the saved measurements gives the same cluster
    assert same_cluster(cluster_from_measurements(2, saved["measurements"]), cluster)


def test_gpu_calibration_solve_recovers_efficiencies():
    """``meshfold calibrate --gpu``'s solve: kernel times made from known efficiencies give
    those efficiencies back, and the preset's datasheet figures stay."""
    from meshfold.planner.calibrate import (GPU_COPY_BYTES, GPU_GEMM_SIZES, gpu_attention_flops,
                                            gpu_device_from_measurements)
    from meshfold.planner.cluster import DEVICES

    base = DEVICES["h100-sxm"]
    peak = base.peak_tflops * 1e12
    r = {f"gemm_{n}": 2 * n**3 / (peak * (0.6 if n < 16384 else 0.72)) for n in GPU_GEMM_SIZES}
    r["copy"] = 2 * GPU_COPY_BYTES / (base.hbm_GBps * 1e9 * 0.85)
    r["attention_fwd"] = gpu_attention_flops() / (peak * 0.5)
    r["attention_bwd"] = 2.5 * gpu_attention_flops() / (peak * 0.4)
    d = gpu_device_from_measurements(base, r)
    assert (d.matmul_eff, d.hbm_eff, d.attention_eff, d.attention_bwd_eff) == pytest.approx((0.72, 0.85, 0.5, 0.4))
    assert (d.peak_tflops, d.hbm_GBps, d.memory_gib) == (base.peak_tflops, base.hbm_GBps, base.memory_gib)
