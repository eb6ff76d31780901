"""One cost model: (model, cluster, layout, batch) -> predicted step time and memory per
device, each with a breakdown. ``docs/planner.md`` writes out every equation.

Conventions shared with the runtime:
- a layout is a ``ParallelConfig`` plus ``train.micro_batch`` and ``train.recompute``;
- mesh order (outermost first) pp, dp_replicate, dp_shard, cp, tp (``meshfold/mesh.py``):
  a dimension's groups are ``size`` ranks ``stride`` apart, stride = product of the sizes
  inside it, which decides the link level each group spans (``Cluster.link``);
- communication bytes follow ``meshfold/comm.py`` (bytes a rank sends, ring algorithm),
  per optimizer step, for global rank 0 (what ``metrics.jsonl`` reports as ``comm_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshfold.config import ModelConfig, ParallelConfig
from meshfold.models.presets import attention_params, ffn_params, mlp_params
from meshfold.planner.cluster import GiB, Cluster

DTYPE_BYTES = {  # (parameter, gradient, optimizer incl. master copy, activation) bytes
    "bf16": (2, 2, 12, 2),  # mixed precision Adam: fp32 master + m + v = 12 (ZeRO paper's K)
    "float32": (4, 4, 8, 4),
    "float64": (8, 8, 16, 8),
}
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0}
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
         "all_to_all": lambda n: n - 1, "send": lambda n: 1}


@dataclass(frozen=True)
class Workload:
    """What is trained: the model, the batch and the numerics."""

    model: ModelConfig
    global_batch: int  # sequences per optimizer step
    seq_len: int = 0  # 0 = model.seq_len
    dtype: str = "bf16"  # bf16 | float32 | float64
    flash: bool = True  # fused attention: no s^2 activations, causal half of the score FLOPs
    dropout: bool = False  # GPT/Megatron-style dropout masks (Korthikanti's 34 sbh)

    @property
    def s(self) -> int:
        return self.seq_len or self.model.seq_len


@dataclass(frozen=True)
class Layout:
    """A plan: the ``[parallel]`` section plus micro-batch size and recomputation."""

    dp_replicate: int = 1
    dp_shard: int = 1
    zero: int = 0
    tp: int = 1
    sp: bool = False
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    ep: int = 1
    micro_batch: int = 1  # sequences per micro-batch on one data-parallel rank
    recompute: str = "none"  # none | selective | full

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def microbatches(self, global_batch: int) -> int:
        return global_batch // self.dp // self.micro_batch

    def parallel_config(self, global_batch: int) -> ParallelConfig:
        return ParallelConfig(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                              zero=self.zero if (self.dp_shard * self.cp > 1 or self.zero <= 1) else self.zero,
                              tp=self.tp, sp=self.sp, pp=self.pp, pp_schedule=self.pp_schedule,
                              pp_microbatches=self.microbatches(global_batch) if self.pp > 1 else 0,
                              pp_virtual_stages=self.pp_virtual_stages, cp=self.cp, cp_mode=self.cp_mode,
                              ep=self.ep)

    def to_toml(self, global_batch: int) -> str:
        p = self.parallel_config(global_batch)
        lines = ["[parallel]"]
        for key in ("dp_replicate", "dp_shard", "zero", "tp", "sp", "pp", "pp_schedule", "pp_microbatches",
                    "pp_virtual_stages", "cp", "cp_mode", "ep"):
            value = getattr(p, key)
            lines.append(f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value).replace(chr(39), chr(34))}")
        lines += ["", "[train]", f"global_batch = {global_batch}",
                  f"micro_batch = {self.micro_batch}", f'recompute = "{self.recompute}"']
        return "\n".join(lines) + "\n"

    def short(self) -> str:
        parts = [f"dp{self.dp_replicate}x{self.dp_shard}", f"z{self.zero}", f"tp{self.tp}" + ("sp" if self.sp else "")]
        if self.pp > 1:
            v = f"v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""
            parts.append(f"pp{self.pp}{self.pp_schedule}{v}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}{self.cp_mode}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts += [f"mb{self.micro_batch}", self.recompute]
        return " ".join(parts)


@dataclass
class Estimate:
    layout: Layout
    step_time_s: float
    time: dict  # seconds by component, on the slowest pipeline stage
    memory: dict  # bytes by component, on the device that holds the most
    peak_mem_bytes: float
    fits: bool
    model_flops: float  # per step, whole cluster (3x forward, no recompute)
    mfu: float
    tflops_per_device: float  # model FLOPs / step time / devices
    comm_bytes: dict = field(default_factory=dict)  # rank 0, per step, by dimension

    def row(self) -> dict:
        return {"layout": self.layout.short(), "step_time_s": self.step_time_s, "mfu": self.mfu,
                "tflops_per_device": self.tflops_per_device, "peak_mem_bytes": self.peak_mem_bytes,
                "fits": self.fits}


# --------------------------------------------------------------------------- pieces


def model_state_bytes(params: float, zero: int, shards: int, dtype: str = "bf16") -> dict:
    """Parameters, gradients and optimizer states per device under ZeRO stage ``zero``
    with ``shards`` ranks sharing them (Rajbhandari et al. 2020, Sec. 5)."""
    pb, gb, ob, _ = DTYPE_BYTES[dtype]
    n = max(1, shards)
    return {"params": params * pb / (n if zero >= 3 else 1),
            "grads": params * gb / (n if zero >= 2 else 1),
            "optimizer": params * ob / (n if zero >= 1 else 1)}


def layer_activation_bytes(m: ModelConfig, s: int, b: int, tp: int, sp: bool, recompute: str,
                           act: int, flash: bool, dropout: bool) -> float:
    """Activation bytes one transformer layer keeps for backward, for one micro-batch of
    ``b`` sequences of ``s`` tokens on one device (Korthikanti et al. 2022, Sec. 4,
    generalised to GQA and SwiGLU; with GPT's shape, act=2, dropout and no flash it is
    exactly ``s b h (34 + 5 a s / h)`` at tp=1 and ``s b h (10 + 24/t + 5 a s / (h t))``)."""
    h, a = m.dim, m.n_heads
    hkv = m.kv_heads * m.head_dim
    if recompute == "full":  # only the layer input survives
        return act * s * b * h / (tp if sp else 1)
    # Replicated across tp ranks unless sequence parallel: two norm inputs, the inputs of
    # the QKV and first MLP projections, and the two dropout masks (1 byte each).
    replicated = s * b * h * (2 * act + act + act) + (2 * s * b * h if dropout else 0)
    # Split over tp ranks: Q, K, V, attention output (input of the out-projection), the MLP
    # hidden activations (GELU: fc1 output and GELU output; SwiGLU: gate, silu(gate), up,
    # product), and the attention output dropout mask.
    f = m.hidden_dim
    mlp = (2 if m.mlp == "gelu" else 4) * act * s * b * f
    if m.moe_experts:  # top-k experts each see the token
        mlp = (4 * act * s * b * m.expert_dim) * (m.moe_topk + m.moe_shared_experts)
    split = act * s * b * (2 * h + 2 * hkv) + mlp
    # Scores: softmax output, dropout mask and dropout output (5 a s^2 b with act=2);
    # fused attention keeps only the log-sum-exp.
    if flash or recompute == "selective":
        scores = 0.0 if not flash else 4 * a * s * b
    else:
        scores = a * s * s * b * (act + (1 + act if dropout else 0))
    return (replicated / (tp if sp else 1)) + (split + scores) / tp


def inflight_microbatches(schedule: str, pp: int, m: int, v: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once, in units
    of one micro-batch through that stage's layers."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        return min(float(m), pp * (1 + (pp - 1) / (pp * v)))
    return float(min(m, pp))  # 1f1b and zbv (ZB-V keeps 1F1B's memory)


def pipeline_time(schedule: str, pp: int, m: int, v: int, t_f: float, t_b: float) -> tuple[float, float]:
    """(makespan, bubble) of a schedule with per-micro-batch stage times t_f, t_b (whole
    stage, all its chunks). GPipe/1F1B: (m + p - 1)(t_f + t_b) (Huang et al.; Narayanan
    et al. 2021); interleaved: (m + (p - 1)/v)(t_f + t_b); ZB-V: weight gradients
    (half of t_b) fill the bubble, leaving (p - 1)(t_f + t_b - 2 t_w) = (p - 1) t_f
    (Qi et al. 2024)."""
    busy = m * (t_f + t_b)
    if pp == 1:
        return busy, 0.0
    if schedule == "interleaved":
        bubble = (pp - 1) / v * (t_f + t_b)
    elif schedule == "zbv":
        bubble = (pp - 1) * t_f
    else:
        bubble = (pp - 1) * (t_f + t_b)
    return busy + bubble, bubble


def matmul_efficiency(cluster: Cluster, width: float) -> float:
    """Achievable fraction of peak for GEMMs whose per-device width is ``width``."""
    d = cluster.device
    return d.matmul_eff * width / (width + d.matmul_half_width)


def collective_time(cluster: Cluster, op: str, size_bytes: float, n: int, stride: int) -> float:
    """alpha-beta time of one collective over a group of n ranks ``stride`` apart."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    alpha, beta = cluster.link(stride, n)
    return STEPS[op](n) * alpha + RING[op](n) * size_bytes / beta


def _split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


# --------------------------------------------------------------------------- the model


def estimate(w: Workload, cluster: Cluster, L: Layout) -> Estimate:
    """Predict one layout. Raises ValueError for layouts that do not tile the batch."""
    m, s = w.model, w.s
    pb, gb, ob, act = DTYPE_BYTES[w.dtype]
    tp, pp, cp, v = L.tp, L.pp, L.cp, (L.pp_virtual_stages if L.pp_schedule == "interleaved" else 1)
    dp, b = L.dp, L.micro_batch
    if w.global_batch % dp or (w.global_batch // dp) % b:
        raise ValueError(f"global batch {w.global_batch} does not split into dp={dp} x micro_batch={b}")
    n_micro = w.global_batch // dp // b
    s_loc = s // cp
    tokens = b * s_loc  # per micro-batch per device (before tp, which splits work not tokens)
    peak = cluster.device.peak_tflops * 1e12
    hbm = cluster.device.hbm_GBps * 1e9
    h, V = m.dim, m.vocab_size

    # ---- strides of each mesh dimension's groups (tp innermost)
    st_tp, st_cp = 1, tp
    st_dps = tp * cp
    st_dpr = tp * cp * L.dp_shard
    st_pp = tp * cp * dp

    # ---- per-layer quantities (dense layer; MoE experts split over ep)
    attn_p = attention_params(m)
    layers = range(m.n_layers)
    ffn_active = [ffn_params(m, i, active=True) for i in layers]
    ffn_total = [ffn_params(m, i) for i in layers]
    norm_p = 2 * m.dim * (2 if (m.norm == "layernorm" and m.bias) else 1)
    ep = max(1, L.ep)
    layer_params = [attn_p / tp + (ffn_total[i] / (tp * (ep if m.is_moe_layer(i) else 1))) + norm_p for i in layers]

    eff = matmul_efficiency(cluster, h / tp)
    causal = 0.5 if w.flash else 1.0
    attn_core = 4 * tokens * s * h / tp * causal  # QK^T and AV, forward, this device's queries
    layer_fwd_flops = [2 * (attn_p + ffn_active[i]) / tp * tokens + attn_core for i in layers]
    act_full = layer_activation_bytes(m, s_loc, b, tp, L.sp, "none", act, w.flash, w.dropout)
    act_kept = layer_activation_bytes(m, s_loc, b, tp, L.sp, L.recompute, act, w.flash, w.dropout)
    elementwise_fwd = cluster.elementwise_traffic * act_full / hbm / 3  # fwd third, bwd two thirds
    overhead = cluster.device.layer_overhead_us * 1e-6

    # Tensor parallel: 2 all-reduces (or all-gather + reduce-scatter with sp: same bytes)
    # of the b*s*h activations per layer forward, 2 in backward, 2 more when recomputing.
    tp_bytes_op = act * tokens * h
    tp_ar = collective_time(cluster, "all_reduce", tp_bytes_op, tp, st_tp)
    # Context parallel: ring passes K and V around (cp-1 hops) forward, K,V and dK,dV
    # backward; Ulysses: 4 all-to-alls of q,k,v,out forward and 4 backward.
    hkv = m.kv_heads * m.head_dim
    if cp > 1 and L.cp_mode == "ulysses":
        cp_fwd_bytes = 4 * act * tokens * h / tp
        cp_fwd = 4 * collective_time(cluster, "all_to_all", act * tokens * h / tp, cp, st_cp)
        cp_fwd_sent = 4 * RING["all_to_all"](cp) * act * tokens * h / tp
    elif cp > 1:
        kv = 2 * act * tokens * hkv / min(tp, m.kv_heads)
        alpha, beta = cluster.link(st_cp, cp)
        cp_fwd = (cp - 1) * (alpha + kv / beta)
        cp_fwd_sent = (cp - 1) * kv
        # ring hops overlap with the attention block they feed: only what exceeds it shows
        cp_fwd = max(cp_fwd - attn_core / (peak * eff), cp_fwd / max(1, cp - 1) if cp > 1 else 0.0)
    else:
        cp_fwd = cp_fwd_sent = 0.0

    recompute_fwd = {"none": 0.0, "selective": 1.0, "full": 1.0}[L.recompute]

    def layer_times(i: int) -> tuple[float, float]:
        fwd_c = layer_fwd_flops[i] / (peak * eff)
        fwd = fwd_c + elementwise_fwd + 2 * tp_ar + cp_fwd + overhead / 3
        if L.recompute == "full":
            rec = fwd
        elif L.recompute == "selective":
            rec = attn_core / (peak * eff) + (elementwise_fwd / 2)
        else:
            rec = 0.0
        bwd = 2 * fwd_c + 2 * elementwise_fwd + 2 * tp_ar + 2 * cp_fwd + rec * recompute_fwd + 2 * overhead / 3
        return fwd, bwd

    per_layer = [layer_times(i) for i in layers]
    out_fwd = 2 * h * V / tp * tokens / (peak * eff) + (act + 8) * tokens * V / tp / hbm
    out_bwd = 2 * out_fwd

    # ---- pipeline stages: contiguous layers, first stages take the remainder
    counts = _split(m.n_layers, pp * v)
    stage_layers: list[list[int]] = [[] for _ in range(pp)]
    start = 0
    for chunk, c in enumerate(counts):
        stage_layers[chunk % pp].extend(range(start, start + c))
        start += c
    p2p_bytes = act * tokens * h / (tp if L.sp else 1)
    if pp > 1:  # point-to-point to the next stage, over the link the pp dimension spans
        alpha, beta = cluster.link(st_pp, pp)
        p2p = alpha + p2p_bytes / beta
    else:
        p2p = 0.0
    t_f = t_b = 0.0
    stage_params = []
    for st in range(pp):
        f = sum(per_layer[i][0] for i in stage_layers[st])
        bw = sum(per_layer[i][1] for i in stage_layers[st])
        emb = V * h / tp if st == 0 else 0
        if st == pp - 1:
            f, bw = f + out_fwd, bw + out_bwd
            emb += 0 if (m.tie_embeddings and pp == 1) else V * h / tp
        if pp > 1:
            f, bw = f + v * p2p, bw + v * p2p
        t_f, t_b = max(t_f, f), max(t_b, bw)
        stage_params.append(sum(layer_params[i] for i in stage_layers[st]) + emb + m.dim)
    makespan, bubble = pipeline_time(L.pp_schedule, pp, n_micro, v, t_f, t_b)

    # ---- data parallel: gradient reduction (and ZeRO gathers), over dp x cp ranks
    P0 = stage_params[0]  # rank 0's stage, for comm_bytes
    Pmax = max(stage_params)
    n_shard, n_rep = L.dp_shard * cp, L.dp_replicate
    n_all = dp * cp
    comm: dict[str, float] = {}
    dp_exposed = 0.0
    if L.zero >= 2 and n_shard > 1:
        # FSDP2 per micro-batch: all-gather each block (twice with ZeRO-3: forward and
        # backward, the root module once), reduce-scatter its gradients, HSDP all-reduce.
        def fsdp(P: float, root_frac: float) -> tuple[float, float]:
            gathers = (2 - root_frac) if L.zero == 3 else 1.0
            t = (gathers * collective_time(cluster, "all_gather", P * pb, n_shard, st_dps)
                 + collective_time(cluster, "reduce_scatter", P * gb, n_shard, st_dps)
                 + collective_time(cluster, "all_reduce", P * gb / n_shard, n_rep, st_dpr))
            sent = (gathers * RING["all_gather"](n_shard) * P * pb + RING["reduce_scatter"](n_shard) * P * gb
                    + (RING["all_reduce"](n_rep) * P * gb / n_shard if n_rep > 1 else 0))
            return t, sent
        root0 = (stage_params[0] - sum(layer_params[i] for i in stage_layers[0])) / max(stage_params[0], 1)
        t_mb, _ = fsdp(Pmax, 0.0)
        _, sent_mb = fsdp(P0, root0)
        comm["dp"] = sent_mb * n_micro
        hide = cluster.overlap * (t_f + t_b)
        n_blocks = max(1, len(stage_layers[0]))
        dp_exposed = n_micro * max(t_mb - hide, t_mb / (n_blocks + 1))
    elif n_all > 1:
        # DDP: one all-reduce of the gradients after the last micro-batch's backward,
        # bucketed, overlapping that backward; ZeRO-1 then gathers the updated shards.
        t_ar = collective_time(cluster, "all_reduce", Pmax * gb, n_all, st_dps if L.dp_replicate == 1 else tp)
        comm["dp"] = RING["all_reduce"](n_all) * P0 * gb
        t_z1 = 0.0
        if L.zero == 1 and n_shard > 1:
            t_z1 = collective_time(cluster, "all_gather", Pmax * pb, n_shard, st_dps)
            comm["dp"] += RING["all_gather"](n_shard) * P0 * pb
        last_bucket = t_ar * min(1.0, 25e6 / max(Pmax * gb, 1))
        dp_exposed = max(t_ar - cluster.overlap * t_b / max(1, v), last_bucket) + t_z1
    if tp > 1:
        per_layer_ops = 4 + (2 if L.recompute == "full" else 0)
        comm["tp"] = len(stage_layers[0]) * per_layer_ops * RING["all_reduce"](tp) * tp_bytes_op * n_micro
    if pp > 1:
        comm["pp"] = 2 * v * p2p_bytes * n_micro if pp > 1 else 0  # rank 0 sends activations, receives grads
        comm["pp"] = v * p2p_bytes * n_micro  # stage 0 sends forward activations only
    if cp > 1:
        comm["cp"] = 3 * cp_fwd_sent * len(stage_layers[0]) * n_micro

    # ---- optimizer step: memory-bound pass over the local shard of states
    shards = n_shard if L.zero >= 1 else 1
    opt_time = Pmax * (pb + gb + ob) * 2 / max(1, shards if L.zero >= 1 else 1) / hbm
    # loss / token-count / grad-norm all-reduces over the world: latency-bound
    small = 3 * collective_time(cluster, "all_reduce", 8, L.world, 1) if L.world > 1 else 0.0
    step = makespan + dp_exposed + opt_time + small + cluster.step_overhead_s

    compute = sum(layer_fwd_flops[i] for i in stage_layers[0])  # informative only
    time = {
        "compute_fwd_bwd": n_micro * (t_f + t_b),
        "of_which_tp_comm": n_micro * sum(4 * tp_ar for _ in stage_layers[0]),
        "of_which_cp_comm": n_micro * 3 * cp_fwd * len(stage_layers[0]),
        "of_which_pp_p2p": n_micro * 2 * v * p2p,
        "pipeline_bubble": bubble,
        "dp_exposed": dp_exposed,
        "optimizer": opt_time,
        "latency_small": small + cluster.step_overhead_s,
    }
    del compute

    # ---- memory on the fullest device (stage 0 holds most in-flight activations)
    states = model_state_bytes(Pmax, L.zero if n_shard > 1 or L.zero <= 1 else 0, n_shard, w.dtype)
    if L.zero == 3 and n_shard > 1:
        states["gathered_blocks"] = 2 * max(layer_params) * pb  # current + prefetched block
    if L.zero == 2 and n_shard > 1:
        states["params"] = Pmax * pb  # reshard_after_forward=False keeps them gathered
    inflight = inflight_microbatches(L.pp_schedule, pp, n_micro, v)
    n_l0 = len(stage_layers[0])
    acts = inflight * n_l0 * act_kept
    if L.recompute == "full":
        acts += act_full  # one layer's activations while it is recomputed
    acts += inflight * act * tokens * h  # embedding output
    logits = (act + 8) * tokens * V / tp if pp == 1 else 0.0
    last_acts = min(1.0, inflight) * len(stage_layers[-1]) * act_kept + (act + 8) * tokens * V / tp
    memory = {**states, "activations": acts, "logits": logits,
              "buffers": 2 * min(25e6, Pmax * gb) if (n_all > 1 and L.zero < 2) else 0.0,
              "reserved": cluster.device.reserved_gib * GiB}
    peak_mem = sum(memory.values())
    if pp > 1:  # the last stage holds logits but fewer in-flight micro-batches
        last = model_state_bytes(stage_params[-1], L.zero, n_shard, w.dtype)
        peak_mem = max(peak_mem, sum(last.values()) + last_acts + memory["reserved"])
    fits = peak_mem <= cluster.device.memory_gib * GiB

    flops_model = 3 * w.global_batch * s * (2 * _matmul_active(m) + 4 * s * h * m.n_layers * causal)
    devices = L.world
    tflops = flops_model / step / devices
    return Estimate(L, step, time, memory, peak_mem, fits, flops_model, tflops / peak, tflops / 1e12,
                    {k: float(v) for k, v in comm.items()})


def _matmul_active(m: ModelConfig) -> float:
    total = m.vocab_size * m.dim
    for i in range(m.n_layers):
        total += attention_params(m) + ffn_params(m, i, active=True)
    return total


def megatron_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, Eq. (3): FLOPs per iteration of a GPT model with full
    activation recomputation (4 forward-pass equivalents):
    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


__all__ = ["Workload", "Layout", "Estimate", "estimate", "model_state_bytes", "layer_activation_bytes",
           "pipeline_time", "inflight_microbatches", "megatron_flops_per_iteration", "mlp_params"]
