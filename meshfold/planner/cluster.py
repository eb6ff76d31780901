"""Cluster descriptions: device presets, link levels, heterogeneous node groups, TOML files.

A cluster is ``nodes x devices_per_node`` devices. Links form levels: inside a node
(NVLink/NVSwitch, Infinity Fabric, or loopback for gloo processes) and between nodes
(each device's share of the NICs). Nodes can come in *groups* with different NIC
bandwidths (Holmes/Pipette's heterogeneous clusters); traffic between two groups uses
``inter_group_GBps``. Every link level has an alpha (latency per message hop, seconds)
and a beta (bandwidth, bytes/s per device, one direction): a collective step costs
``alpha + bytes / beta`` (see ``cost.py``).

Bad files or fields raise ``ConfigError`` with one line naming the field.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from meshfold.errors import ConfigError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Device:
    """One accelerator. Every default and preset value is listed with its source in
    ``docs/planner.md`` ("Device specs"); the efficiencies come from published
    micro-benchmarks of one kernel class each (never from the training tables the tests
    predict), or from ``meshfold calibrate`` on the device itself."""

    name: str
    peak_tflops: float  # dense bf16 (or the training dtype's) peak per device
    memory_gib: float
    hbm_GBps: float
    # Fraction of peak that large bf16 GEMMs reach (the maximum achievable matmul FLOPS,
    # MAMF, measured per device generation); kernels.gemm_time prices each GEMM's shape on top.
    matmul_eff: float = 0.80
    # GEMM width (columns per device) at which efficiency drops to half of matmul_eff: the
    # CPU calibration's fall-off (0 on GPUs, whose small GEMMs are priced by gemm_tile and
    # the roofline instead).
    matmul_half_width: float = 0.0
    # Memory the runtime keeps for itself (CUDA context, NCCL buffers, fragmentation).
    reserved_gib: float = 4.0
    # Fixed time per transformer layer per micro-batch (forward + backward): kernel
    # launches on GPUs, Python/ATen dispatch on CPU, where it dominates tiny models.
    layer_overhead_us: float = 30.0
    # Fixed time per tile of the tiled attention that context parallelism runs (forward +
    # backward, beyond its FLOPs): its few dozen small ops per tile. 0 = negligible.
    attention_tile_us: float = 0.0
    # Dense fp8 peak (0 = no fp8 tensor cores): what Float8 linears run at.
    fp8_tflops: float = 0.0
    # Fraction of hbm_GBps that streaming (elementwise, reduction, optimizer) kernels reach.
    hbm_eff: float = 0.90
    # Fused (flash) attention's fraction of peak, forward and backward (counting the
    # backward as 2.5x the forward's FLOPs, as the FlashAttention papers do); 0 = priced
    # as GEMMs (the CPU calibration's blocks include attention in their measured rate).
    attention_eff: float = 0.0
    attention_bwd_eff: float = 0.0
    # GEMM output tile (rows = columns) for tile quantization and the HBM roofline of each
    # GEMM (kernels.gemm_time); 0 = neither (a calibrated CPU rate already includes them).
    gemm_tile: int = 128
    # Streaming multiprocessors (AMD: compute units): a GEMM's tiles run in waves of this
    # many, and a partial last wave leaves the rest idle (wave quantization). 0 = ignore.
    sms: int = 0
    # Compute/communication contention: a collective running beside compute takes SMs and
    # HBM bandwidth from it, so the compute it overlaps runs this fraction slower for as
    # long as they overlap (published overlap measurements, docs/planner.md "Contention";
    # 0 = none, e.g. a calibrated CPU cluster, whose measured rates already include it).
    overlap_slowdown: float = 0.0
    # > 0: the GEMM kernels run one output tile per thread block, writing it after the
    # k-loop while the SM's tensor cores wait (cuBLAS on Ampere), and this is the inner
    # dimension of the shape MAMF was measured at: GEMMs with a shorter k lose more to the
    # tiles' writes (``kernels.gemm_time``). 0: persistent kernels that overlap a tile's
    # write with the next tile's loop (Hopper, Blackwell), or a calibrated rate.
    gemm_epilogue_k: int = 0
    # Fraction of hbm_GBps PyTorch's eager memory-bound kernels reach, one kernel per op (the
    # blocks' norms, RoPE, activations, adds, copies and the loss's passes, as counted by
    # ``kernels.elementwise_bytes``); 0 = hbm_eff. Measured on an H200 (docs/planner.md).
    eager_hbm_eff: float = 0.0
    # Fraction of hbm_GBps an eager elementwise op with a broadcast operand and a dtype change
    # reaches (TensorIterator's non-vectorized path: the chunked loss's ``logits - max``, bf16
    # in, fp32 out); 0 = eager_hbm_eff. Measured on an H200 (docs/planner.md).
    broadcast_hbm_eff: float = 0.0
    # Fraction of the dense GEMM time (``kernels.gemm_time`` at the experts' active width) a
    # dropless MoE's routed experts reach as grouped GEMMs; 0 = as dense. Measured on an H200.
    grouped_gemm_eff: float = 0.0


# Data-sheet numbers (dense, no sparsity) and measured efficiencies; sources in docs/planner.md.
_A100 = dict(matmul_eff=0.859, attention_eff=0.73, attention_bwd_eff=0.63,  # MAMF; FlashAttention-2 paper
             overlap_slowdown=0.2, gemm_epilogue_k=2048)  # MAMF's best shape 6912x16384x2048  # NCCL beside GEMMs: 10-30 % measured (docs/planner.md)
_H100 = dict(matmul_eff=0.801, attention_eff=0.35, attention_bwd_eff=0.29,  # MAMF; FA2 on H100 (FA3 paper; bwd measured)
             overlap_slowdown=0.2, eager_hbm_eff=0.744,  # meshfold's eager step on an H200 (docs/planner.md)
             broadcast_hbm_eff=0.268,  # the loss's broadcast subtractions in the same (docs/planner.md)
             grouped_gemm_eff=0.82)  # torch._grouped_mm's experts in gpt-oss's step on an H200 (docs/planner.md)
DEVICES: dict[str, Device] = {
    "a100-80gb": Device("a100-80gb", 312.0, 80.0, 2039.0, sms=108, **_A100),
    "a100-40gb": Device("a100-40gb", 312.0, 40.0, 1555.0, sms=108, **_A100),
    "h100-sxm": Device("h100-sxm", 989.4, 80.0, 3350.0, fp8_tflops=1978.9, sms=132, **_H100),
    "h100-pcie": Device("h100-pcie", 756.0, 80.0, 2000.0, fp8_tflops=1513.0, sms=114, **_H100),
    "h100-nvl": Device("h100-nvl", 835.0, 94.0, 3900.0, fp8_tflops=1670.0, sms=132, **_H100),
    # Meta's Grand Teton H100 (torchtitan's benchmarks): 96 GB HBM2e at 2.4 TB/s, run at a
    # 500 W cap; its peak is "between SXM and NVL" (torchtitan's note): interpolated by
    # power between the NVL (400 W, 835 TF) and the SXM (700 W, 989.4 TF).
    "h100-96gb-500w": Device("h100-96gb-500w", 835.0 + (989.4 - 835.0) * (500 - 400) / (700 - 400), 96.0,
                             2400.0, fp8_tflops=2 * (835.0 + (989.4 - 835.0) / 3), sms=132, **_H100),
    "h200": Device("h200", 989.4, 141.0, 4800.0, fp8_tflops=1978.9, sms=132, **_H100),
    # Blackwell: no published MAMF or attention figure yet: Hopper's efficiencies (assumed).
    "b200": Device("b200", 2250.0, 180.0, 8000.0, fp8_tflops=4500.0, sms=148, **_H100),
    "mi300x": Device("mi300x", 1307.4, 192.0, 5300.0, fp8_tflops=2614.9, matmul_eff=0.601,
                     attention_eff=0.35, attention_bwd_eff=0.35, sms=304),
    # One Graphics Compute Die of an MI250X: 383 TF bf16 per package / 2 GCDs, 64 GiB HBM2e.
    "mi250x-gcd": Device("mi250x-gcd", 191.5, 64.0, 1638.0, matmul_eff=0.767, sms=110),
    # This machine: one gloo process on a shared CPU core; `meshfold calibrate` measures it.
    "cpu": Device("cpu", 0.02, 8.0, 10.0, matmul_eff=1.0, matmul_half_width=0.0, reserved_gib=0.3,
                  hbm_eff=1.0, gemm_tile=0),
}


@dataclass(frozen=True)
class NodeGroup:
    nodes: int
    inter_node_GBps: float
    inter_node_alpha_us: float = 5.0


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra_node_GBps: float  # per device, one direction
    inter_node_GBps: float  # per device, one direction (its share of the node's NICs)
    intra_node_alpha_us: float = 2.0
    inter_node_alpha_us: float = 5.0
    node_groups: tuple[NodeGroup, ...] = ()  # heterogeneous: consecutive nodes per group
    inter_group_GBps: float = 0.0  # links between node groups (0 = the slower group's)
    inter_group_alpha_us: float = 10.0
    # Fraction of data-parallel communication that can hide behind backward compute
    # (1 on GPUs with separate copy/NCCL engines; CPU gloo shares the cores: measured).
    overlap: float = 1.0
    # Scale on the memory-bound bytes kernels.py counts op by op (norms, RoPE, activations,
    # residual adds, softmax, casts, the loss over the vocabulary): 1 = as counted; 0 = none
    # (a calibrated CPU block time already contains them).
    elementwise_traffic: float = 1.0
    # Fixed per-step overhead (optimizer launch, data loading, logging), seconds.
    step_overhead_s: float = 0.0
    # > 0: all devices are processes sharing this many CPU cores (this machine). A
    # waiting process frees its core for the others, so the step is bounded by the total
    # work over the cores as well as by the critical path (see pipeline.py).
    host_cores: int = 0
    # Software cost of issuing one collective beyond the alpha of its hops (Python and
    # the library's bookkeeping): small on GPUs, large for gloo on a busy CPU.
    collective_overhead_us: float = 0.0
    # Extra cost of each FSDP2 (ZeRO-2/3) collective on top of that: its pre/post hooks
    # and the copy-in/copy-out of the flat buffers.
    fsdp_overhead_us: float = 0.0
    # Hop latency for collectives whose ranks are already in step (the loss, token-count
    # and grad-norm reductions at the step's edges); 0 = the link's alpha. On a shared CPU
    # a hop after a compute segment waits for a busy core, one after a collective does not.
    in_step_alpha_us: float = 0.0
    # Fixed cost of one pipeline-stage operation (a micro-batch's forward or backward on a
    # stage, with its send and receive) beyond compute and the message itself: the
    # schedule executor's own work. 0 = negligible.
    pipeline_op_us: float = 0.0
    # Fraction of ``intra_node_GBps`` (the link's line rate) that NCCL's collectives carry:
    # its protocol's headers and flags take ~20 % of NVLink (370 of 450 GB/s on H100, NCCL's
    # maintainers, NVIDIA/nccl-tests#212); 1 = the rate as given (a calibrated cluster's
    # measured beta already is what its collectives reach).
    intra_node_eff: float = 1.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def with_nodes(self, nodes: int) -> "Cluster":
        return replace(self, nodes=nodes, node_groups=())

    # ------------------------------------------------------------------ link levels

    def _node_group_of_node(self) -> np.ndarray:
        if not self.node_groups:
            return np.zeros(self.nodes, dtype=np.int64)
        return np.repeat(np.arange(len(self.node_groups)), [g.nodes for g in self.node_groups])

    def link(self, stride: int, size: int) -> tuple[float, float]:
        """(alpha seconds, beta bytes/s) of the slowest link used by any group of ``size``
        ranks spaced ``stride`` apart (a mesh dimension, rank-major), over the whole
        cluster. Groups that stay inside a node use NVLink; others the NIC share of the
        slowest node group they touch, or the inter-group link when they cross groups."""
        return _link_cached(self, stride, size)


@lru_cache(maxsize=4096)
def _link_cached(cluster: Cluster, stride: int, size: int) -> tuple[float, float]:
    intra = (cluster.intra_node_alpha_us * 1e-6, cluster.intra_node_GBps * cluster.intra_node_eff * GB)
    if size <= 1:
        return intra
    dpn = cluster.devices_per_node
    if stride * (size - 1) < dpn and _always_intra(stride, size, dpn):
        return intra
    n = cluster.world_size
    block = stride * size
    if n % block:
        raise ConfigError(f"layout group of {size} ranks with stride {stride} does not tile {n} devices")
    ranks = np.arange(n).reshape(n // block, size, stride).transpose(0, 2, 1).reshape(-1, size)
    nodes = ranks // dpn
    spans = nodes.max(axis=1) != nodes.min(axis=1)
    if not spans.any():
        return intra
    if not cluster.node_groups:
        return (cluster.inter_node_alpha_us * 1e-6, cluster.inter_node_GBps * GB)
    group_of = cluster._node_group_of_node()[nodes[spans]]
    crossing = (group_of.max(axis=1) != group_of.min(axis=1)).any()
    touched = np.unique(group_of)
    alpha = max(cluster.node_groups[g].inter_node_alpha_us for g in touched) * 1e-6
    beta = min(cluster.node_groups[g].inter_node_GBps for g in touched) * GB
    if crossing:
        between = cluster.inter_group_GBps * GB if cluster.inter_group_GBps else beta
        beta = min(beta, between)
        alpha = max(alpha, cluster.inter_group_alpha_us * 1e-6)
    return (alpha, beta)


def _always_intra(stride: int, size: int, dpn: int) -> bool:
    # A group spanning stride*(size-1)+1 consecutive-ish ranks stays in one node when the
    # block it tiles (stride*size) divides the node, or fits in a node that it divides.
    block = stride * size
    return dpn % block == 0


# --------------------------------------------------------------------------- presets

# NCCL's share of an NVLink's line rate: the per-link bandwidth its topology model assigns
# (src/graph/topo.h: SM80_NVLINK_BW 20.0, SM90 20.6, SM100 40.1 GB/s) over the link's line
# rate one way (NVLink 3 and 4: 25 GB/s, NVLink 5: 50): its protocol's overhead, ~20 %
# (NCCL's maintainers: 370 of 450 GB/s on H100, NVIDIA/nccl-tests#212)
NVLINK_EFF = {"a100": 20.0 / 25.0, "hopper": 20.6 / 25.0, "b200": 40.1 / 50.0}
# NCCL's latency model for its Ring algorithm with the Simple protocol (what it picks for the
# large collectives that matter; src/graph/tuning.cc): a base latency per collective, 8.4 us
# (``collective_overhead_us``), and 3.4 us a ring step over NVLink (``intra_node_alpha_us``)
NCCL_LATENCY = dict(collective_overhead_us=8.4, intra_node_alpha_us=3.4)
PRESETS: dict[str, dict] = {
    # DGX A100: NVSwitch (600 GB/s bidirectional = 300 one way), 8x HDR 200 Gb/s = 25 GB/s/GPU.
    "a100-dgx": dict(devices_per_node=8, device="a100-80gb", intra_node_GBps=300.0, inter_node_GBps=25.0,
                     intra_node_eff=NVLINK_EFF["a100"], **NCCL_LATENCY),
    # DGX H100: NVLink 4 (900 GB/s bidirectional), 8x NDR 400 Gb/s = 50 GB/s/GPU.
    "h100-dgx": dict(devices_per_node=8, device="h100-sxm", intra_node_GBps=450.0, inter_node_GBps=50.0,
                     intra_node_eff=NVLINK_EFF["hopper"], **NCCL_LATENCY),
    "h200-dgx": dict(devices_per_node=8, device="h200", intra_node_GBps=450.0, inter_node_GBps=50.0,
                     intra_node_eff=NVLINK_EFF["hopper"], **NCCL_LATENCY),
    # Grand Teton (torchtitan's H100 benchmarks): 8 H100 96GB at 500 W, NVLink 4, 400 Gb/s RDMA per GPU.
    "h100-grand-teton": dict(devices_per_node=8, device="h100-96gb-500w", intra_node_GBps=450.0,
                             inter_node_GBps=50.0, intra_node_eff=NVLINK_EFF["hopper"], **NCCL_LATENCY),
    # PCIe servers: 8 cards on PCIe 5.0 x16 (64 GB/s one way; NVLink bridges join pairs
    # only), one 400 Gb/s NIC per GPU.
    "h100-pcie": dict(devices_per_node=8, device="h100-pcie", intra_node_GBps=64.0, inter_node_GBps=50.0),
    "h100-nvl": dict(devices_per_node=8, device="h100-nvl", intra_node_GBps=64.0, inter_node_GBps=50.0),
    # DGX B200: NVLink 5 (1.8 TB/s bidirectional = 900 one way), 8x 400 Gb/s ConnectX-7.
    "b200-dgx": dict(devices_per_node=8, device="b200", intra_node_GBps=900.0, inter_node_GBps=50.0,
                     intra_node_eff=NVLINK_EFF["b200"], **NCCL_LATENCY),
    # MI300X platform: 7 Infinity Fabric links of 64 GB/s one way per GPU (896 GB/s
    # aggregate bidirectional), 8x 400 Gb/s NICs.
    "mi300x": dict(devices_per_node=8, device="mi300x", intra_node_GBps=448.0, inter_node_GBps=50.0),
    # Frontier node: 4 MI250X = 8 GCDs, Infinity Fabric 50-100 GB/s between GCDs, 4x 25 GB/s
    # Slingshot NICs per node = 12.5 GB/s per GCD.
    "frontier": dict(devices_per_node=8, device="mi250x-gcd", intra_node_GBps=50.0, inter_node_GBps=12.5,
                     inter_node_alpha_us=8.0),
    # This machine: N gloo processes on loopback. Numbers are placeholders until
    # `meshfold calibrate` writes measured ones.
    "cpu-gloo": dict(nodes=1, devices_per_node=8, device="cpu", intra_node_GBps=0.5, inter_node_GBps=0.5,
                     intra_node_alpha_us=100.0, overlap=0.0, host_cores=os.cpu_count() or 1),
}
PRESET_ALIASES = {"a100": "a100-dgx", "h100": "h100-dgx", "h200": "h200-dgx", "b200": "b200-dgx",
                  "h100-96gb": "h100-grand-teton", "mi250x": "frontier", "cpu": "cpu-gloo"}

_FIELDS = {"nodes": int, "devices_per_node": int, "device": str, "peak_tflops": float, "memory_gib": float,
           "hbm_GBps": float, "matmul_eff": float, "matmul_half_width": float, "reserved_gib": float,
           "layer_overhead_us": float,
           "intra_node_GBps": float, "inter_node_GBps": float, "intra_node_alpha_us": float,
           "inter_node_alpha_us": float, "inter_group_GBps": float, "inter_group_alpha_us": float,
           "overlap": float, "elementwise_traffic": float, "step_overhead_s": float, "preset": str,
           "host_cores": int, "collective_overhead_us": float, "fsdp_overhead_us": float,
           "in_step_alpha_us": float, "attention_tile_us": float, "pipeline_op_us": float,
           "fp8_tflops": float, "hbm_eff": float, "attention_eff": float, "attention_bwd_eff": float,
           "gemm_tile": int, "sms": int, "intra_node_eff": float,
           "name": str, "node_groups": list}
_DEVICE_KEYS = ("peak_tflops", "memory_gib", "hbm_GBps", "matmul_eff", "matmul_half_width", "reserved_gib",
                "layer_overhead_us", "attention_tile_us", "fp8_tflops", "hbm_eff", "attention_eff",
                "attention_bwd_eff", "gemm_tile", "sms")
_POSITIVE = ("nodes", "devices_per_node", "peak_tflops", "memory_gib", "hbm_GBps", "intra_node_GBps",
             "inter_node_GBps")


def _check_type(where: str, key: str, value, want: type):
    if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if want is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if want in (str, list) and isinstance(value, want):
        return value
    raise ConfigError(f"{where}.{key} = {value!r} has the wrong type; expected {want.__name__}")


def cluster_from_dict(values: dict, name: str = "cluster", where: str = "cluster") -> Cluster:
    """Build a cluster from a ``[cluster]`` table (a ``preset`` key starts from a preset)."""
    import difflib

    values = dict(values)
    base: dict = {}
    if "preset" in values:
        preset = _check_type(where, "preset", values.pop("preset"), str)
        base = dict(PRESETS[_preset_name(preset, f"{where}.preset")])
    for key, value in values.items():
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, list(_FIELDS), n=1, cutoff=0.6)
            hint = f" (did you mean {where}.{close[0]}?)" if close else ""
            raise ConfigError(f"unknown field {where}.{key}{hint}")
        base[key] = _check_type(where, key, value, _FIELDS[key])
    merged = {"nodes": 1, **base}
    for key in ("devices_per_node", "intra_node_GBps"):
        if key not in merged:
            raise ConfigError(f"{where}.{key} is missing")
    if "inter_node_GBps" not in merged:
        if merged["nodes"] > 1 and "node_groups" not in merged:
            raise ConfigError(f"{where}.inter_node_GBps is missing (needed with {merged['nodes']} nodes)")
        merged["inter_node_GBps"] = merged["intra_node_GBps"]

    device_name = merged.pop("device", "")
    dev_over = {k: merged.pop(k) for k in _DEVICE_KEYS if k in merged}
    if device_name:
        if device_name not in DEVICES:
            raise ConfigError(f"{where}.device = {device_name!r} is not a known device; choose one of "
                              f"{', '.join(DEVICES)} or give peak_tflops, memory_gib and hbm_GBps")
        device = replace(DEVICES[device_name], **dev_over)
    else:
        missing = [k for k in ("peak_tflops", "memory_gib", "hbm_GBps") if k not in dev_over]
        if missing:
            raise ConfigError(f"{where}.{missing[0]} is missing (or name a preset in {where}.device)")
        device = Device("custom", **dev_over)
    for key in _POSITIVE:
        value = merged.get(key, getattr(device, key, None))
        if value is not None and value <= 0:
            raise ConfigError(f"{where}.{key} must be positive, got {value}")
    for key in ("matmul_eff", "hbm_eff"):
        if not 0 < getattr(device, key) <= 1:
            raise ConfigError(f"{where}.{key} must be in (0, 1], got {getattr(device, key)}")
    for key in ("attention_eff", "attention_bwd_eff"):
        if not 0 <= getattr(device, key) <= 1:
            raise ConfigError(f"{where}.{key} must be in [0, 1], got {getattr(device, key)}")
    if not 0 < merged.get("intra_node_eff", 1.0) <= 1:
        raise ConfigError(f"{where}.intra_node_eff must be in (0, 1], got {merged['intra_node_eff']}")
    if not 0 <= merged.get("overlap", 1.0) <= 1:
        raise ConfigError(f"{where}.overlap must be in [0, 1], got {merged['overlap']}")

    groups = []
    for i, g in enumerate(merged.pop("node_groups", []) or []):
        gw = f"{where}.node_groups[{i}]"
        if not isinstance(g, dict):
            raise ConfigError(f"{gw} must be a table with nodes and inter_node_GBps")
        for key in g:
            if key not in ("nodes", "inter_node_GBps", "inter_node_alpha_us"):
                raise ConfigError(f"unknown field {gw}.{key}")
        for key in ("nodes", "inter_node_GBps"):
            if key not in g:
                raise ConfigError(f"{gw}.{key} is missing")
        group = NodeGroup(_check_type(gw, "nodes", g["nodes"], int),
                          _check_type(gw, "inter_node_GBps", g["inter_node_GBps"], float),
                          _check_type(gw, "inter_node_alpha_us", g.get("inter_node_alpha_us", 5.0), float))
        if group.nodes <= 0 or group.inter_node_GBps <= 0:
            raise ConfigError(f"{gw}.nodes and .inter_node_GBps must be positive")
        groups.append(group)
    if groups:
        total = sum(g.nodes for g in groups)
        if "nodes" in values and values["nodes"] != total:
            raise ConfigError(f"{where}.nodes = {values['nodes']} but node_groups hold {total} nodes")
        merged["nodes"] = total
        merged["inter_node_GBps"] = min(g.inter_node_GBps for g in groups)
    merged.setdefault("name", name)
    return Cluster(device=device, node_groups=tuple(groups), **merged)


def presets_help() -> str:
    """What ``--cluster`` takes, for its help and its error (one list, so they agree)."""
    return (f"choose one of {', '.join(PRESETS)} (aliases {', '.join(PRESET_ALIASES)}), NAME:DEVICES for a "
            f"device count (e.g. h100:64), or a cluster TOML file")


def _preset_name(text: str, where: str) -> str:
    key = PRESET_ALIASES.get(text, text)
    if key not in PRESETS:
        raise ConfigError(f"{where} = {text!r} is not a cluster preset{did_you_mean(text, [*PRESETS, *PRESET_ALIASES])}; "
                          f"{presets_help()}")
    return key


def load_cluster(spec: str | Path, nodes: int | None = None, devices: int | None = None) -> Cluster:
    """A preset name (optionally ``NAME:DEVICES``) or a TOML file with a ``[cluster]``
    table. ``devices`` sets the node count to fit that many devices."""
    text = str(spec)
    if ":" in text and not Path(text).exists():
        text, count = text.rsplit(":", 1)
        if not count.isdigit():
            raise ConfigError(f"--cluster {spec!r}: expected NAME or NAME:DEVICES, e.g. h100:16384")
        devices = int(count)
    path = Path(text)
    if path.suffix == ".toml" or path.exists():
        if not path.exists():
            raise ConfigError(f"cluster file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err})") from None
        if "cluster" not in data or not isinstance(data["cluster"], dict):
            raise ConfigError(f"{path}: no [cluster] table")
        cluster = cluster_from_dict(data["cluster"], name=path.stem)
    else:
        name = _preset_name(text, "--cluster")
        cluster = cluster_from_dict({"preset": name}, name=name)
    if nodes is not None:
        cluster = cluster.with_nodes(nodes)
    if devices is not None:
        dpn = cluster.devices_per_node
        if devices < dpn:
            cluster = replace(cluster, nodes=1, devices_per_node=devices, node_groups=())
        elif devices % dpn:
            raise ConfigError(f"{devices} devices is not a multiple of {dpn} devices per node")
        else:
            cluster = cluster.with_nodes(devices // dpn)
    return cluster


def cluster_to_toml(c: Cluster) -> str:
    """The ``[cluster]`` table a file would need to describe ``c`` exactly."""
    d = c.device
    # The device it derives from (every number below overrides it): its name says whether
    # the cluster is a CPU host, which decides the numerics a plan assumes (float32 there).
    base = d.name.removesuffix("-calibrated")
    lines = ["[cluster]", f'name = "{c.name}"', f"nodes = {c.nodes}", f"devices_per_node = {c.devices_per_node}",
             *([f'device = "{base}"'] if base in DEVICES else []),
             f"peak_tflops = {d.peak_tflops!r}", f"memory_gib = {d.memory_gib!r}", f"hbm_GBps = {d.hbm_GBps!r}",
             f"matmul_eff = {d.matmul_eff!r}", f"matmul_half_width = {d.matmul_half_width!r}",
             f"reserved_gib = {d.reserved_gib!r}", f"layer_overhead_us = {d.layer_overhead_us!r}",
             f"attention_tile_us = {d.attention_tile_us!r}", f"fp8_tflops = {d.fp8_tflops!r}",
             f"hbm_eff = {d.hbm_eff!r}", f"attention_eff = {d.attention_eff!r}",
             f"attention_bwd_eff = {d.attention_bwd_eff!r}", f"gemm_tile = {d.gemm_tile!r}",
             f"sms = {d.sms!r}",
             f"intra_node_GBps = {c.intra_node_GBps!r}", f"intra_node_eff = {c.intra_node_eff!r}",
             f"inter_node_GBps = {c.inter_node_GBps!r}",
             f"intra_node_alpha_us = {c.intra_node_alpha_us!r}", f"inter_node_alpha_us = {c.inter_node_alpha_us!r}",
             f"overlap = {c.overlap!r}", f"elementwise_traffic = {c.elementwise_traffic!r}",
             f"step_overhead_s = {c.step_overhead_s!r}", f"host_cores = {c.host_cores!r}",
             f"collective_overhead_us = {c.collective_overhead_us!r}",
             f"fsdp_overhead_us = {c.fsdp_overhead_us!r}", f"in_step_alpha_us = {c.in_step_alpha_us!r}",
             f"pipeline_op_us = {c.pipeline_op_us!r}"]
    return "\n".join(lines) + "\n"
